"""Tokenizer loading, chat templates, and streaming token ids back into text.

The incremental detokenizer is vLLM's prefix/read-offset algorithm: each step decodes only a
small window (a few tokens of context before the unread ones) and emits the part of the text
past the context, holding back while the text ends in U+FFFD (a character whose bytes span
tokens and is not complete yet).
"""

from __future__ import annotations

import os
import re

from jinja2 import TemplateError

ROLES = ("system", "user", "assistant", "tool")
# Tool-calling keys a message keeps for the template (assistant tool_calls, a tool result's id and name).
_TOOL_KEYS = ("tool_calls", "tool_call_id", "name")
# Prompt tokens decoded ahead of the first generated one, so that the first piece of text
# starts right (a leading space, a character whose bytes began in the prompt).
_PROMPT_CONTEXT = 5
_REPLACEMENT = "\ufffd"


def load_tokenizer(path: str, chat_template: str | None = None):
    """An AutoTokenizer from a local HF directory (or a .gguf file); never downloads.

    `chat_template` (a Jinja string, or a path to a .jinja file) replaces the model's own.
    """
    from transformers import AutoTokenizer

    if os.path.isfile(path) and path.endswith(".gguf"):
        from pathlib import Path

        from engine.worker.models.loader import gguf_tokenizer_dir

        path = str(gguf_tokenizer_dir(Path(path)))  # NOTE: converted once, then cached
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    if chat_template is not None:
        tokenizer.chat_template = _resolve_template(chat_template)
    return tokenizer


def _resolve_template(template: str) -> str:
    """A template given as a file path is read; anything else is the template itself."""
    if os.path.isfile(template):
        with open(template, encoding="utf-8") as f:
            return f.read()
    if template.endswith((".jinja", ".jinja2", ".j2")) and "{" not in template:
        raise ValueError(f"chat template file {template!r} not found")
    return template


def template_supports_tools(tokenizer, chat_template: str | None = None) -> bool:
    """Whether the chat template (`chat_template`, else the tokenizer's) renders a `tools` list."""
    template = getattr(tokenizer, "chat_template", None)
    if chat_template is not None:
        template = _resolve_template(chat_template)
    if isinstance(template, dict):  # named templates; HF picks "tool_use" when tools are given
        template = " ".join(str(t) for t in template.values())
    return isinstance(template, str) and re.search(r"\btools\b", template) is not None


def apply_chat_template(
    tokenizer, messages: list[dict], add_generation_prompt: bool = True, chat_template: str | None = None,
    tools: list[dict] | None = None, template_kwargs: dict | None = None, continue_final_message: bool = False,
) -> str:
    """Render OpenAI-style chat messages into one prompt string with the chat template.

    Content given as a list of {"type": "text", "text": ...} parts is joined with newlines.
    Assistant messages may carry `tool_calls` (content may then be None) and "tool" messages a
    `tool_call_id`; both are passed to the template as they are, and so is `tools` (OpenAI-style
    function definitions), for templates that render them (`template_supports_tools`);
    `template_kwargs` are further variables for the template (e.g. enable_thinking).
    `continue_final_message`: the prompt ends inside the last (assistant) message, right after
    its text, so that the model continues it (HF's continue_final_message; no generation prompt).
    Raises ValueError (with a message fit for the user) on a bad role or content, or when
    there is no template. The result already holds the template's special tokens, so tokenize
    it without adding more (add_special_tokens=False).
    """
    template = _resolve_template(chat_template) if chat_template is not None else None
    if template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "this model has no chat template; pass one with --chat-template, or use the completions API"
        )
    conversation = [_normalize_message(i, m) for i, m in enumerate(_as_list(messages))]
    try:
        prompt = tokenizer.apply_chat_template(
            conversation, chat_template=template, tokenize=False,
            add_generation_prompt=add_generation_prompt and not continue_final_message,
            **({"continue_final_message": True} if continue_final_message else {}),
            **({"tools": tools} if tools else {}), **(template_kwargs or {}),
        )
    except TemplateError as e:  # includes the template's own raise_exception(...)
        raise ValueError(f"the chat template rejected these messages: {e}") from e
    if not isinstance(prompt, str):  # older transformers could return a list for one conversation
        prompt = prompt[0]
    return prompt


def _as_list(messages) -> list:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list of {role, content} objects")
    return list(messages)


def _normalize_message(index: int, message) -> dict:
    if not isinstance(message, dict):
        raise ValueError(f"messages[{index}] must be an object with 'role' and 'content'")
    role = message.get("role")
    if role not in ROLES:
        raise ValueError(f"messages[{index}].role must be one of {', '.join(ROLES)}; got {role!r}")
    extra = {k: message[k] for k in _TOOL_KEYS if message.get(k) is not None and (k != "name" or role == "tool")}
    content = message.get("content")
    if content is None and role == "assistant":
        content = ""  # an assistant turn may have no text (OpenAI allows null there)
    if isinstance(content, str):
        return {"role": role, "content": content, **extra}
    if isinstance(content, (list, tuple)):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(f"messages[{index}].content[{j}]: only text parts are supported, got {kind!r}")
            text = part.get("text")
            if not isinstance(text, str):
                raise ValueError(f"messages[{index}].content[{j}].text must be a string")
            texts.append(text)
        return {"role": role, "content": "\n".join(texts), **extra}
    raise ValueError(f"messages[{index}].content must be a string or a list of text parts")


def decode_token(tokenizer, token_id: int) -> str:
    """One token's text as the tokenizer decodes it alone (for logprobs): special tokens shown,
    a token holding part of a character's bytes shown as U+FFFD."""
    return tokenizer.decode([token_id], skip_special_tokens=False)


def _skipped_ids(tokenizer) -> frozenset[int]:
    """Token ids that decode(..., skip_special_tokens=True) drops."""
    if getattr(tokenizer, "is_fast", False):
        # NOTE: the Rust tokenizer skips by its own added-token flags, not transformers' map.
        return frozenset(i for i, t in tokenizer.added_tokens_decoder.items() if t.special)
    return frozenset(tokenizer.all_special_ids)


def _plain_rust_decoder(tokenizer):
    """The Rust `tokenizers.Tokenizer` behind `tokenizer` where its decode() is exactly
    `tokenizer.decode()` (transformers' own fast class, no clean-up of spaces), else None.
    NOTE: transformers' wrapper (argument conversion, the batch check) cost ~4x the Rust
    decode itself, twice per sequence per step: ~1 ms of a 64-sequence step on the engine thread."""
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return None
    backend = getattr(tokenizer, "_tokenizer", None)
    if (type(tokenizer)._decode is not TokenizersBackend._decode or type(tokenizer).decode is not TokenizersBackend.decode
            or getattr(tokenizer, "clean_up_tokenization_spaces", True) or not hasattr(backend, "decode")):
        return None
    return backend


class IncrementalDetokenizer:
    """Text for one sequence, one token at a time, O(1) per token.

    The window `_ids` holds already-emitted tokens (the context, `_ids[:_read]`) followed by
    those not emitted yet. Each step decodes the window and emits what extends past the
    context's text, unless it ends in U+FFFD. On emitting, the old context is dropped and the
    tokens just emitted become the next context, so the window stays a few tokens long.
    """

    def __init__(
        self,
        tokenizer,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._decode_kwargs = {"skip_special_tokens": skip_special_tokens}
        if not getattr(tokenizer, "is_fast", False):  # only the Python tokenizers know this flag
            self._decode_kwargs["spaces_between_special_tokens"] = spaces_between_special_tokens
        self._skipped = _skipped_ids(tokenizer) if skip_special_tokens else frozenset()
        self._backend = _plain_rust_decoder(tokenizer)
        self._text = ""

        # The last few prompt tokens that show as text are the context for the first token.
        context: list[int] = []
        for tok in reversed(prompt_token_ids[-4 * _PROMPT_CONTEXT :]):
            if tok not in self._skipped:
                context.append(tok)
                if len(context) == _PROMPT_CONTEXT:
                    break
        context.reverse()
        self._ids = context
        self._read = len(context)
        self._prefix_text: str | None = None
        # NOTE: a prompt that ends inside a character (made from raw ids) cannot give a clean
        # boundary; the output is then decoded as if it stood alone.
        if self._context_text().endswith(_REPLACEMENT):
            self._ids, self._read, self._prefix_text = [], 0, ""

    @property
    def text(self) -> str:
        """All text emitted so far (what flush() would add is not included)."""
        return self._text

    def step(self, token_id: int) -> str:
        """Add one generated token; return the text it completes ("" while held back)."""
        if token_id in self._skipped:
            # Decodes to nothing; keeping it out of the window keeps the window short.
            return ""
        self._ids.append(token_id)
        prefix_text = self._context_text()
        new_text = self._decode(self._ids)
        # NOTE: a trailing U+FFFD means an incomplete character: wait for its other bytes.
        # A stream of bytes that never completes keeps growing the window until it does.
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT):
            return ""
        return self._emit(new_text[len(prefix_text) :])

    def flush(self) -> str:
        """At the end of the sequence: the held-back text, as decode() shows it (possibly with
        U+FFFD for a character that never completed)."""
        if self._read == len(self._ids):
            return ""
        prefix_text = self._context_text()
        new_text = self._decode(self._ids)
        return self._emit(new_text[len(prefix_text) :])

    def _emit(self, delta: str) -> str:
        # The unread tokens become the context for the next ones; older tokens are dropped.
        del self._ids[: self._read]
        self._read = len(self._ids)
        self._prefix_text = None
        self._text += delta
        return delta

    def _context_text(self) -> str:
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[: self._read])
        return self._prefix_text

    def _decode(self, ids: list[int]) -> str:
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(ids, **self._decode_kwargs)
