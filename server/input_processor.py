"""`InputProcessor`: everything between a request's fields and the token ids the engine takes:
chat templates (and the tool-calling prompt), tokenization, detokenization for echo and
/detokenize, and starting each constrained prompt's grammar. It checks nothing of a prompt's
length or ids: the admission pipeline (server/admission.py) does, through engine/core/admission.py.

The work runs on a small pool of worker threads, never on the event loop (which must keep
answering /health and streaming other requests) and never on the engine thread (which must keep
stepping): a request's template and tokenization cost time linear in its size, and the tokenizer
releases the GIL while it encodes. The processor keeps its own copy of the tokenizer, so that
its threads never share one with the engine's detokenizers.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from engine.core.admission import EngineRequest
from engine.loop.tokenizer import apply_chat_template, template_supports_tools
from server.errors import bad_request, from_request_error
from server.reasoning import ThinkFormat, reasoning_token_count
from server.tools import ToolPlan, check_tool_schemas, text_messages

T = TypeVar("T")
_WORKERS = 2


@dataclass(frozen=True)
class Prompt:
    """One prompt, tokenized (not yet admitted: engine/core/admission.py checks it)."""

    token_ids: list[int]
    text: str | None  # the prompt's text (given or rendered; None for token ids: `prompt_text`)


class InputProcessor:
    def __init__(self, tokenizer: Any, *, vocab_size: int, max_model_len: int, chat_template: str | None = None,
                 grammars: Any = None) -> None:
        """`tokenizer`: the model's (copied here; None for dummy weights, which take token ids
        only); `chat_template`: the server's --chat-template (None: the model's own);
        `grammars`: the engine's StructuredOutputCompiler (thread-safe), which starts each
        constrained prompt's grammar here."""
        self.grammars = grammars
        self.tokenizer = copy.deepcopy(tokenizer) if tokenizer is not None else None
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.chat_template = chat_template
        self._pool = ThreadPoolExecutor(max_workers=_WORKERS, thread_name_prefix="input")
        self._token_texts: dict[int, str] = {}  # decode_token's memo

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def _run(self, fn: Callable[[], T]) -> T:
        """`fn()` on a worker thread; its ValueError (a template's, the tokenizer's) is a 400."""
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, fn)
        except ValueError as exc:
            raise from_request_error(exc) from None

    def _need_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise bad_request("This model has no tokenizer (dummy weights): send token ids.", param="prompt")
        return self.tokenizer

    # ---------------------------------------------------------------- completions
    async def completion_prompts(self, prompts: list[str | list[int]]) -> list[Prompt]:
        """Token ids for each prompt (text is tokenized as the model's tokenizer does by
        default); a token-id prompt is taken as it is, its text None (`prompt_text`)."""
        if any(isinstance(p, str) for p in prompts):
            self._need_tokenizer()

        def work() -> list[Prompt]:
            return [Prompt(self.tokenizer(p).input_ids, p) if isinstance(p, str) else Prompt(list(p), None)
                    for p in prompts]

        return await self._run(work)

    def prompt_text(self, token_ids: list[int]) -> str | None:
        """The text of an admitted token-id prompt, for echo (worker thread); None without a
        tokenizer."""
        return self.tokenizer.decode(token_ids) if self.tokenizer is not None else None

    async def with_grammars(self, prompts: list[EngineRequest], spec: Any, param: str | None,
                            plan: ToolPlan | None = None) -> list[EngineRequest]:
        """Each prompt with its own grammar state for `spec` (None: unchanged), compiled,
        started and its first mask computed here, so that the engine thread never compiles one;
        400 (naming `param`, or the tool at fault) for a bad constraint or one too slow to
        evaluate. `plan`: the request's tool plan, when the constraint is its tool call."""
        if spec is None or self.grammars is None:
            return prompts

        def work() -> list:
            if plan is not None:
                check_tool_schemas(plan)  # raises OpenAIError naming the tool
            return [self.grammars.prepare(spec) for _ in prompts]

        try:
            states = await asyncio.get_running_loop().run_in_executor(self._pool, work)
        except ValueError as exc:
            raise bad_request(str(exc), param=param) from None
        return [replace(p, grammar=g) for p, g in zip(prompts, states)]

    # ---------------------------------------------------------------- chat
    def render_chat(self, messages: list[dict], plan: ToolPlan | None = None, template_kwargs: dict | None = None,
                    continue_final: bool = False) -> str:
        """The chat prompt's text (worker thread): the template's own tool rendering when it
        has one, else the tools described in the system prompt (server/tools.py).
        `template_kwargs`: the request's chat_template_kwargs, extra variables for the template.
        `continue_final`: the prompt ends in the final assistant message's text (a prefill)."""
        tokenizer = self._need_tokenizer()
        extra = self._template_kwargs(template_kwargs)
        if continue_final:
            extra["continue_final_message"] = True
        tools = plan.tools if plan is not None and plan.functions else None
        has_tool_turns = any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
        if tools is None and not has_tool_turns:
            return apply_chat_template(tokenizer, messages, chat_template=self.chat_template, **extra)
        if template_supports_tools(tokenizer, self.chat_template):
            return apply_chat_template(tokenizer, messages, chat_template=self.chat_template, tools=tools, **extra)
        return apply_chat_template(tokenizer, text_messages(messages, plan), chat_template=self.chat_template,
                                   **extra)

    def _template_kwargs(self, kwargs: dict | None) -> dict:
        """The request's chat_template_kwargs, refused (400) where one would set an argument of
        the tokenizer's apply_chat_template itself (tokenize, chat_template ...) rather than a
        template variable."""
        if not kwargs:
            return {}
        import inspect

        reserved = set(inspect.signature(self.tokenizer.apply_chat_template).parameters) | {"messages", "tools"}
        for name in kwargs:
            if name in reserved:
                raise bad_request(f"chat_template_kwargs may not set {name[:64]!r}: it is not a template variable.",
                                  param="chat_template_kwargs")
        return {"template_kwargs": kwargs}

    async def chat_prompt(self, messages: list[dict], plan: ToolPlan | None, template_kwargs: dict | None = None,
                          continue_final: bool = False) -> Prompt:
        """The rendered, tokenized chat prompt (the template holds its special tokens: none are
        added); `continue_final`: see `render_chat`."""
        self._need_tokenizer()

        def work() -> Prompt:
            text = self.render_chat(messages, plan, template_kwargs, continue_final)
            return Prompt(self.tokenizer(text, add_special_tokens=False).input_ids, text)

        return await self._run(work)

    # ---------------------------------------------------------------- /tokenize, /detokenize
    async def tokenize(self, prompt: str | None, messages: list[dict] | None, add_special_tokens: bool,
                       return_token_strs: bool) -> dict:
        tokenizer = self._need_tokenizer()

        def work() -> dict:
            if messages is not None:
                text, add = self.render_chat(messages), False
            else:
                text, add = prompt, add_special_tokens
            ids = tokenizer(text, add_special_tokens=add).input_ids
            result = {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids}
            if return_token_strs:
                result["token_strs"] = tokenizer.convert_ids_to_tokens(ids)
            return result

        return await self._run(work)

    async def detokenize(self, ids: list[int]) -> str:
        tokenizer = self._need_tokenizer()
        if any(not 0 <= t < self.vocab_size for t in ids):
            raise bad_request(f"tokens must be token ids in [0, {self.vocab_size}).", param="tokens")
        return await self._run(lambda: tokenizer.decode(ids))

    async def reasoning_tokens(self, think: ThinkFormat, opened: bool, token_ids: list[int]) -> int:
        """How many of an output's `token_ids` are its reasoning (server/reasoning.py's
        `reasoning_token_count`, decoding as the engine does: special tokens skipped); 0 without
        a tokenizer (dummy weights write no text to split)."""
        tokenizer = self.tokenizer
        if tokenizer is None or not token_ids:
            return 0

        def decode(ids: list[int]) -> str:
            return tokenizer.decode(ids, skip_special_tokens=True)

        return await self.off_loop(lambda: reasoning_token_count(think, opened, token_ids, decode))

    def decode_token(self, token_id: int) -> str:
        """One token's text, decoded once per token id and kept (logprobs name the same tokens
        over and over: a prompt's 20 alternatives per position). NOTE: at most one entry per id
        of the vocabulary, so the memo is bounded."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id]) if self.tokenizer is not None else ""
            self._token_texts[token_id] = text
        return text

    async def off_loop(self, fn: Callable[[], T]) -> T:
        """`fn()` on a worker thread (a response's work that grows with the request: a long
        prompt's logprobs), so the event loop keeps serving the other requests meanwhile."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn)
