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
    # Sampling defaults: "auto" (the model's generation_config.json), "vllm" (none) or a path.
    generation_config: str = "auto"
    metrics_public: bool = False  # /metrics, /kv/blocks and /dashboard need no API key
    metrics_compat: str | None = None  # "vllm": /metrics also under vLLM's names (server/metrics_compat.py)
    reasoning_parser: str | None = None  # server/reasoning.py PARSERS: thinking -> reasoning_content
    tool_call_parser: str = "json"  # server/chat_output.py TOOL_CALL_PARSERS: how "auto" reads calls
    # Limits (each answered with a clear 4xx).
    max_logprobs: int = 20
    max_n: int = 16
    max_best_of: int = 16
    max_prompts_per_request: int = 64
    max_prompt_tokens_per_request: int = 262144  # prompt tokens over all prompts of one completions request
    max_stop_sequences: int = 16
    max_stop_str_len: int = 256  # characters of one stop string
    max_stop_token_ids: int = 256
    max_logit_bias: int = 1024  # entries of logit_bias
    max_messages: int = 2048  # messages of one chat request
    max_messages_chars: int = 1_000_000  # characters of message content over all messages of one chat request
    max_tools: int = 128
    max_tool_schema_bytes: int = 64 * 1024  # one tool's function definition, serialised as JSON
    max_total_tool_schema_bytes: int = 1024 * 1024  # all tools of one request together
    max_guided_choices: int = 1024  # choices of guided_choice / structured_outputs.choice
    max_structured_output_bytes: int = 64 * 1024  # one constraint: schema JSON, regex, grammar or choices
    max_json_depth: int = 64  # nesting of arrays and objects in a request body (and in a tool's schema)
    max_tokens_limit: int | None = None  # None: only the context bounds max_tokens
    max_request_body_bytes: int = 4 * 1024 * 1024
    max_queued_requests: int | None = None  # None: unbounded waiting queue
    # /v1/responses' stored responses (server/responses_store.py): the oldest go past either bound.
    responses_store: str | None = None  # a SQLite file that keeps them across restarts; None: memory only
    responses_store_max_count: int = 1000
    responses_store_max_bytes: int = 64 * 1024 * 1024  # their JSON, all together
    # Health: pending work but no engine step finished for this long (seconds) -> /health answers 503.
    engine_stall_timeout: float = 120.0
    # Shutdown.
    shutdown_timeout: float = 30.0  # seconds a SIGTERM drain waits for requests in flight
    log_level: str = "info"
    access_log: bool = True
    extra: dict = field(default_factory=dict)

    @property
    def think_format(self):
        """The reasoning parser's format, or None."""
        from server.reasoning import think_format

        return think_format(self.reasoning_parser) if self.reasoning_parser else None
