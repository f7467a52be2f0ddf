"""`EngineCore`: what the async engine needs of the engine it runs on its thread (`LLMEngine`
is one). A typed contract instead of an `Any` reached into with `getattr` and callables."""

from __future__ import annotations

from typing import Any, Protocol

from engine.core.admission import AdmissionLimits, EngineRequest
from engine.core.outputs import OutputKind, RequestOutput
from engine.core.sampling_params import SamplingParams
from engine.loop.metrics import EngineStats


class EngineCore(Protocol):
    last_stats: EngineStats  # the state after the latest step
    last_step_empty: bool  # the latest step ran nothing (with work pending: it could run nothing)
    newly_scheduled: list[str]  # requests the latest step scheduled for the first time

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    arrival_time: float | None = None, output_kind: OutputKind = OutputKind.CUMULATIVE,
                    prompt_text: str | None = None, grammar: Any = None) -> None:
        """Admit (engine/core/admission.py) and queue a request; ValueError for bad input (nothing
        is left behind)."""

    @property
    def admission_limits(self) -> AdmissionLimits:
        """The model's limits on a prompt, for callers that admit requests themselves."""

    def add_admitted(self, request_id: str, request: EngineRequest, arrival_time: float | None = None,
                     output_kind: OutputKind = OutputKind.CUMULATIVE) -> None:
        """Queue a request that passed `admit` against `admission_limits`; ValueError (nothing
        left behind) if it cannot fit this engine's pool or widths."""

    def abort_request(self, request_id: str) -> None:
        """End a request and free its blocks now; unknown ids are ignored."""

    def step(self) -> list[RequestOutput]:
        """Run one step; the outputs of the requests it advanced."""

    def has_unfinished_requests(self) -> bool: ...

    def check_health(self) -> None:
        """Raise (an exception marked `fatal`) if steps can no longer run."""

    def block_map(self) -> dict:
        """The KV pool, block by block, for the dashboard (built on demand): engine/kv/kv_view.py."""

    def request_blocks(self, request_id: str) -> dict | None:
        """One request's block tables (engine/kv/kv_view.py `request_tables`); None once it is gone."""

    def shutdown(self) -> None: ...
