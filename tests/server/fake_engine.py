"""A stand-in `LLMEngine` for server tests that need no model: deterministic, fast, and able to
fail on purpose. Start a server on it with `--engine-factory tests.server.fake_engine:build`.

Tokens are bytes (vocab 256). Each generated token is the next lowercase letter after the
previous token ('a' after 'z'). Prompt markers inject faults:
- "FAIL_REQUEST": the step raises an error naming this request (only it must fail);
- "ERROR_FIELD": the request's output carries `error` (the engine failed it alone);
- "KILL_ENGINE": the engine loop breaks (the server must report dead);
- "SLOW": every step takes 50 ms while this request runs (for drain / queue tests).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from engine.metrics import EngineStats
from engine.outputs import CompletionOutput, Logprob, RequestOutput
from engine.sampling_params import SamplingParams

BLOCK_SIZE = 4
NUM_BLOCKS = 64
MAX_MODEL_LEN = 128


class ByteTokenizer:
    def __len__(self) -> int:
        return 256

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("latin-1", errors="replace"))

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode("latin-1")

    def convert_ids_to_tokens(self, ids) -> list[str]:
        return [bytes([i]).decode("latin-1") for i in ids]


@dataclass
class ModelConfig:
    max_model_len: int = MAX_MODEL_LEN
    served_model_name: str = "fake-model"


class RequestFault(RuntimeError):
    def __init__(self, request_id: str) -> None:
        super().__init__(f"injected failure in {request_id}")
        self.request_id = request_id


@dataclass
class _Req:
    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int
    outputs: list[list[int]] = field(default_factory=list)
    done: list[str | None] = field(default_factory=list)
    blocks: int = 0


class FakeEngine:
    def __init__(self, step_delay: float = 0.002) -> None:
        self.tokenizer = ByteTokenizer()
        self.model_config = ModelConfig()
        self.step_delay = step_delay
        self.requests: dict[str, _Req] = {}
        self.last_stats = EngineStats(num_gpu_blocks=NUM_BLOCKS, num_free_gpu_blocks=NUM_BLOCKS)
        self.dead = False

    # The LLMEngine API used by the server.
    def cache_info(self) -> dict[str, str]:
        return {"block_size": str(BLOCK_SIZE), "num_gpu_blocks": str(NUM_BLOCKS), "dtype": "none",
                "preemption_mode": "recompute"}

    def chat_prompt(self, messages: list[dict], chat_template: str | None = None) -> str:
        for m in messages:
            if m["role"] not in ("system", "developer", "user", "assistant"):
                raise ValueError(f"unknown role {m['role']!r}")
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"

    def add_request(self, request_id, prompt, params: SamplingParams, arrival_time=None) -> None:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("The prompt is empty.")
        room = MAX_MODEL_LEN - len(ids)
        max_tokens = params.max_tokens if params.max_tokens is not None else room
        if len(ids) + max_tokens > MAX_MODEL_LEN:
            raise ValueError(
                f"This model's maximum context length is {MAX_MODEL_LEN} tokens. However, you requested "
                f"{len(ids) + max_tokens} tokens ({len(ids)} in the messages, {max_tokens} in the completion). "
                "Please reduce the length of the messages or completion.")
        req = _Req(request_id, prompt if isinstance(prompt, str) else None, ids, params, max_tokens)
        req.outputs = [[] for _ in range(params.n)]
        req.done = [None] * params.n
        self.requests[request_id] = req

    def abort_request(self, request_id: str) -> None:
        self.requests.pop(request_id, None)
        self._stats()

    def has_unfinished_requests(self) -> bool:
        if self.dead:
            raise RuntimeError("injected engine death")
        return bool(self.requests)

    def block_map(self) -> dict:
        used = self._used_blocks()
        return {"num_blocks": NUM_BLOCKS, "block_size": BLOCK_SIZE, "num_free": NUM_BLOCKS - used,
                "blocks": [{"id": i, "state": "used" if i < used else "free"} for i in range(NUM_BLOCKS)]}

    def step(self) -> list[RequestOutput]:
        slow = any("SLOW" in (r.prompt or "") for r in self.requests.values())
        time.sleep(0.05 if slow else self.step_delay)
        for req in self.requests.values():
            if "KILL_ENGINE" in (req.prompt or ""):
                self.dead = True
                raise RuntimeError("injected engine death")
            if "FAIL_REQUEST" in (req.prompt or ""):
                raise RequestFault(req.request_id)
        results = []
        for req in list(self.requests.values()):
            for i, toks in enumerate(req.outputs):
                if req.done[i] is not None:
                    continue
                last = toks[-1] if toks else req.prompt_ids[-1] + i
                toks.append(ord("a") + (last - ord("a") + 1) % 26 if ord("a") <= last <= ord("z") else ord("a") + i)
                text = self.tokenizer.decode(toks)
                if any(s in text for s in req.params.stop):
                    req.done[i] = "stop"
                elif len(toks) >= req.max_tokens:
                    req.done[i] = "length"
            finished = all(d is not None for d in req.done)
            outputs = []
            for i, toks in enumerate(req.outputs):
                text = self.tokenizer.decode(toks)
                stop_reason = None
                if req.done[i] == "stop":
                    s = next(s for s in req.params.stop if s in text)
                    stop_reason = s
                    if not req.params.include_stop_str_in_output:
                        text = text[: text.index(s)]
                lps = None
                if req.params.logprobs is not None:
                    lps = [{t: Logprob(-0.5, 1, chr(t)), **{(t + k) % 256: Logprob(-1.0 - k, k + 1, chr((t + k) % 256))
                                                          for k in range(1, req.params.logprobs + 1)}}
                           for t in toks]
                outputs.append(CompletionOutput(i, text, list(toks), -0.5 * len(toks), lps, req.done[i], stop_reason))
            if "ERROR_FIELD" in (req.prompt or ""):  # the engine's own per-request failure report
                finished = True
            results.append(RequestOutput(req.request_id, req.prompt, req.prompt_ids, outputs[: req.params.n],
                                         finished))
            if "ERROR_FIELD" in (req.prompt or ""):
                results[-1].error = "ValueError: injected sampling failure"
            if finished:
                del self.requests[req.request_id]
        self._stats()
        return results

    def _used_blocks(self) -> int:
        return sum(-(-(len(r.prompt_ids) + max(map(len, r.outputs))) // BLOCK_SIZE) for r in self.requests.values())

    def _stats(self) -> None:
        used = self._used_blocks()
        self.last_stats = EngineStats(num_running=len(self.requests), num_gpu_blocks=NUM_BLOCKS,
                                      num_free_gpu_blocks=NUM_BLOCKS - used, kv_cache_usage=used / NUM_BLOCKS)


def build(engine_args) -> FakeEngine:
    return FakeEngine()


def build_failing(engine_args) -> FakeEngine:
    raise RuntimeError("injected load failure")


def build_slow(engine_args) -> FakeEngine:
    time.sleep(4)
    return FakeEngine()
