"""The families' real chat templates (tests/families/templates, as llama.cpp ships them) through
our apply_chat_template: chat_template_kwargs turn thinking off, tools are rendered in the
Hermes format that --tool-call-parser hermes reads, and the reasoning parser sees whether the
prompt leaves the thinking open."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.loop.tokenizer import apply_chat_template, load_tokenizer
from engine.worker.models.loader import default_gguf_path
from server.reasoning import ThinkFormat

TEMPLATES = Path(__file__).parent / "templates"
MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(str(default_gguf_path()))


@pytest.mark.parametrize("family", ["qwen3", "smollm3"])
def test_thinking_off_closes_an_empty_think_in_the_prompt(tokenizer, family):
    template = str(TEMPLATES / f"{family}.jinja")
    on = apply_chat_template(tokenizer, MESSAGES, chat_template=template)
    off = apply_chat_template(tokenizer, MESSAGES, chat_template=template, template_kwargs={"enable_thinking": False})
    assert "<think>\n\n</think>" in off and "<think>\n\n</think>" not in on
    assert not ThinkFormat().opened_by(on) and not ThinkFormat().opened_by(off)


def test_tools_are_rendered_in_the_hermes_format(tokenizer):
    # NOTE: Qwen3's only: the SmolLM3 template llama.cpp ships (Unsloth's edit) renders no tools
    prompt = apply_chat_template(tokenizer, MESSAGES, chat_template=str(TEMPLATES / "qwen3.jinja"), tools=TOOLS)
    assert "get_weather" in prompt and "<tool_call>" in prompt
