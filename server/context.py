"""`ServerContext`: what every route needs (settings, the async engine, model facts, metrics),
kept on `app.state.ctx`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from engine.core.admission import AdmissionLimits
from engine.loop.async_engine import AsyncEngine
from server.errors import OpenAIError, shown
from server.settings import ServerSettings


@dataclass
class ServerContext:
    settings: ServerSettings
    engine: AsyncEngine
    # Known once the engine has loaded (set on the engine thread by `on_engine_ready`).
    model_name: str | None = None
    max_model_len: int | None = None
    vocab_size: int | None = None
    # The engine's limits on a prompt (engine/core/admission.py), which server/admission.py admits against.
    admission_limits: AdmissionLimits | None = None
    # server.input_processor.InputProcessor, once the model has loaded: the server's one way to
    # the tokenizer (it holds its own copy; the engine detokenizes with the engine's)
    inputs: Any = None
    metrics: Any = None  # server.observability.Metrics, or the fallback
    created: int = 0  # unix time the model finished loading (for /v1/models)
    cache_info: dict = field(default_factory=dict)  # the engine's KV cache facts (block_size, num_gpu_blocks, ...)
    # Sampling defaults from --generation-config (server/generation_defaults.py) and their file.
    generation_defaults: dict = field(default_factory=dict)
    generation_config_file: str | None = None
    responses: Any = None  # server.responses_store.ResponseStore (/v1/responses' stored responses)
    draining: bool = False  # SIGTERM received: new requests get 503
    extra: dict = field(default_factory=dict)

    def check_model(self, model: str | None) -> str:
        """The served name; 404 for any other model name (None means the served one)."""
        name = self.model_name or ""
        if model is not None and model != name:
            raise OpenAIError(404, f"The model `{shown(model)}` does not exist.", param="model",
                              code="model_not_found")
        return name

    def client_disconnected(self) -> None:
        if self.metrics is not None:
            try:
                self.metrics.client_disconnected()
            except Exception:  # noqa: BLE001 - metrics never break serving
                pass


def get_ctx(request: Request) -> ServerContext:
    return request.app.state.ctx
