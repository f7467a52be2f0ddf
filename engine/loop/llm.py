"""The offline API: `LLM(model=None).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from engine.core.admission import admit
from engine.core.outputs import OutputKind, RequestOutput
from engine.core.sampling_params import SamplingParams
from engine.loop.engine_args import EngineArgs
from engine.loop.llm_engine import LLMEngine

Prompt = str | list[int]


class LLM:
    """Runs prompts to completion with continuous batching. `model=None` is the default model;
    other keyword arguments are `EngineArgs` fields (block_size, kv_cache_memory, ...)."""

    def __init__(self, model: str | None = None, chat_template: str | None = None, **engine_args):
        self.engine = LLMEngine.from_engine_args(EngineArgs(model=model, **engine_args), chat_template)
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Outputs in the order of `prompts`. A single prompt may be a string or a token id list.
        Raises ValueError (a `RequestError` naming the field: engine/core/admission.py) for a prompt
        or settings the engine cannot run; then no prompt of the call is run."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params or SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError("give one SamplingParams, or one per prompt")
        requests = []
        for prompt, p in zip(prompts, params):
            text = prompt if isinstance(prompt, str) else None
            if text is not None:
                if self.tokenizer is None:
                    raise ValueError("this model has no tokenizer (dummy weights): give token ids")
                prompt = self.tokenizer(text).input_ids
            requests.append(admit(prompt, p, self.engine.admission_limits, text=text))
        # NOTE: every prompt admitted before any is queued, and the queued ones aborted if the
        # pool refuses a later one: a call that raises leaves nothing running.
        ids = []
        try:
            for request in requests:
                ids.append(f"offline-{next(self._ids)}")
                self.engine.add_admitted(ids[-1], request, output_kind=OutputKind.FINAL_ONLY)
        except ValueError:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        return self._run(ids)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        params: SamplingParams | None = None,
    ) -> list[RequestOutput]:
        """Applies the model's chat template to each conversation, then generates."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.engine.chat_prompt(c) for c in conversations]
        token_ids = [self.tokenizer(p, add_special_tokens=False).input_ids for p in prompts]
        return self.generate(token_ids, params)

    def _run(self, ids: list[str]) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[i] for i in ids]
