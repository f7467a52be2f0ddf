"""`InputProcessor`: everything between a request's fields and the token ids the engine takes:
chat templates (and the tool-calling prompt), tokenization, detokenization for echo and
/detokenize, and the length checks.

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

from engine.tokenizer import apply_chat_template, template_supports_tools
from server.errors import OpenAIError, bad_request, from_value_error
from server.tools import ToolPlan, check_tool_schemas, text_messages

T = TypeVar("T")
_WORKERS = 2


@dataclass(frozen=True)
class Prompt:
    """One prompt, ready for the engine."""

    token_ids: list[int]
    text: str | None  # the prompt's text (given, rendered, or decoded from its ids for echo)
    grammar: Any = None  # its structured-output state, started here (engine.structured_output.GrammarState)
    max_tokens: int | None = None  # the request's defaulted max_tokens capped to this prompt's room (None: as asked)


def context_length_error(prompt_len: int, max_tokens: int | None, max_model_len: int,
                         param: str = "prompt") -> OpenAIError | None:
    """The 400 for a prompt that cannot fit the context with its completion (OpenAI's wording);
    None if it fits. `max_tokens` None counts one generated token."""
    n_out = max_tokens if max_tokens is not None else 1
    if prompt_len + n_out <= max_model_len:
        return None
    return bad_request(
        f"This model's maximum context length is {max_model_len} tokens. However, you requested "
        f"{prompt_len + n_out} tokens ({prompt_len} in the messages, {n_out} in the completion). "
        "Please reduce the length of the messages or completion.", param=param, code="context_length_exceeded")


class InputProcessor:
    def __init__(self, tokenizer: Any, *, vocab_size: int, max_model_len: int, chat_template: str | None = None,
                 max_prompt_tokens: int | None = None, grammars: Any = None) -> None:
        """`tokenizer`: the model's (copied here; None for dummy weights, which take token ids
        only); `chat_template`: the server's --chat-template (None: the model's own);
        `max_prompt_tokens`: most prompt tokens of one request over all its prompts;
        `grammars`: the engine's StructuredOutputCompiler (thread-safe), which starts each
        constrained prompt's grammar here."""
        self.grammars = grammars
        self.tokenizer = copy.deepcopy(tokenizer) if tokenizer is not None else None
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.chat_template = chat_template
        self.max_prompt_tokens = max_prompt_tokens
        self._pool = ThreadPoolExecutor(max_workers=_WORKERS, thread_name_prefix="input")
        self._token_texts: dict[int, str] = {}  # decode_token's memo

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def _run(self, fn: Callable[[], T]) -> T:
        """`fn()` on a worker thread; its ValueError is a 400."""
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, fn)
        except ValueError as exc:
            raise from_value_error(exc) from None

    def _need_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise bad_request("This model has no tokenizer (dummy weights): send token ids.", param="prompt")
        return self.tokenizer

    def check_ids(self, ids: list[int], param: str) -> None:
        """400 unless every id is in the vocabulary (one linear pass)."""
        vocab = self.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise bad_request(f"{param} token ids must be in [0, {vocab}).", param=param)

    # ---------------------------------------------------------------- completions
    async def completion_prompts(self, prompts: list[str | list[int]], max_tokens: int | None,
                                 echo: bool = False, defaulted: bool = False) -> list[Prompt]:
        """Token ids for each prompt (text is tokenized as the model's tokenizer does by
        default); with `echo`, the text of token-id prompts too. 400 for ids out of the
        vocabulary, a prompt that cannot fit the context with `max_tokens`, or prompts over
        the request's token limit. `defaulted`: `max_tokens` is the server's default, not the
        request's (`_fit`)."""
        if any(isinstance(p, str) for p in prompts):
            self._need_tokenizer()
        for p in prompts:
            if not isinstance(p, str):
                self.check_ids(p, "prompt")

        def work() -> list[Prompt]:
            out = []
            for p in prompts:
                if isinstance(p, str):
                    out.append(Prompt(self.tokenizer(p).input_ids, p))
                else:
                    text = self.tokenizer.decode(p) if echo and self.tokenizer is not None else None
                    out.append(Prompt(list(p), text))
            return out

        result = await self._run(work)
        return self._fit(result, max_tokens, defaulted, "prompt")

    def _fit(self, prompts: list[Prompt], max_tokens: int | None, defaulted: bool, param: str) -> list[Prompt]:
        """`_check_lengths`, with a defaulted `max_tokens` capped at each prompt's room.
        NOTE: a default is not the user's ask, so (as vLLM does) a long prompt gets the room
        left in the context rather than a 400; only a prompt that leaves no room at all (or an
        explicit max_tokens that does not fit) is refused."""
        lengths = [len(p.token_ids) for p in prompts]
        if not defaulted or max_tokens is None:
            self._check_lengths(lengths, max_tokens, param)
            return prompts
        self._check_lengths(lengths, None, param)  # at least one token of room
        return [p if n + max_tokens <= self.max_model_len else replace(p, max_tokens=self.max_model_len - n)
                for p, n in zip(prompts, lengths)]

    def _check_lengths(self, lengths: list[int], max_tokens: int | None, param: str) -> None:
        total = sum(lengths)
        if self.max_prompt_tokens is not None and total > self.max_prompt_tokens:
            raise bad_request(f"{param} holds {total} tokens in all, more than this server accepts in one request "
                              f"({self.max_prompt_tokens}, --max-prompt-tokens-per-request).", param=param)
        for n in lengths:
            if n == 0:
                raise bad_request(f"{param} must not be empty.", param=param)
            error = context_length_error(n, max_tokens, self.max_model_len, param)
            if error is not None:
                raise error

    async def with_grammars(self, prompts: list[Prompt], spec: Any, param: str | None,
                            plan: ToolPlan | None = None) -> list[Prompt]:
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
    def render_chat(self, messages: list[dict], plan: ToolPlan | None = None) -> str:
        """The chat prompt's text (worker thread): the template's own tool rendering when it
        has one, else the tools described in the system prompt (server/tools.py)."""
        tokenizer = self._need_tokenizer()
        tools = plan.tools if plan is not None and plan.functions else None
        has_tool_turns = any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
        if tools is None and not has_tool_turns:
            return apply_chat_template(tokenizer, messages, chat_template=self.chat_template)
        if template_supports_tools(tokenizer, self.chat_template):
            return apply_chat_template(tokenizer, messages, chat_template=self.chat_template, tools=tools)
        return apply_chat_template(tokenizer, text_messages(messages, plan), chat_template=self.chat_template)

    async def chat_prompt(self, messages: list[dict], plan: ToolPlan | None, max_tokens: int | None,
                          defaulted: bool = False) -> Prompt:
        """The rendered, tokenized chat prompt (the template holds its special tokens: none are
        added); 400 if it cannot fit the context with `max_tokens` (capped instead when
        `defaulted`, as `completion_prompts`)."""
        self._need_tokenizer()

        def work() -> Prompt:
            text = self.render_chat(messages, plan)
            return Prompt(self.tokenizer(text, add_special_tokens=False).input_ids, text)

        prompt = await self._run(work)
        (prompt,) = self._fit([prompt], max_tokens, defaulted, "messages")
        return prompt

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
