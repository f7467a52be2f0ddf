"""Server-side settings (everything that is not the engine's): network, auth, limits, drain."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # guards every route but /health (and /metrics & co. if public)
    allowed_origins: tuple[str, ...] = ()  # CORS; empty: no CORS headers
    chat_template: str | None = None  # a Jinja template (the file's text when a path was given)
    metrics_public: bool = False  # /metrics, /kv/blocks and /dashboard need no API key
    # Limits (each answered with a clear 4xx).
    max_logprobs: int = 20
    max_n: int = 16
    max_best_of: int = 16
    max_prompts_per_request: int = 64
    max_stop_sequences: int = 16
    max_tokens_limit: int | None = None  # None: only the context bounds max_tokens
    max_request_body_bytes: int = 4 * 1024 * 1024
    max_queued_requests: int | None = None  # None: unbounded waiting queue
    # Shutdown.
    shutdown_timeout: float = 30.0  # seconds a SIGTERM drain waits for requests in flight
    log_level: str = "info"
    access_log: bool = True
    extra: dict = field(default_factory=dict)
