"""The FastAPI app factory: routes, error handlers, middleware, and the engine's lifecycle.

The engine loads on its own thread after the server starts listening, so /health answers 503
while loading; everything model-dependent is filled in when it is ready (`_on_engine_ready`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from engine.loop.async_engine import AsyncEngine, EngineDeadError
from server import heap
from server.context import ServerContext
from server.anthropic_errors import error_response as anthropic_error_response, is_anthropic_path
from server.errors import install_error_handlers
from server.generation_defaults import load_generation_defaults
from server.input_processor import InputProcessor
from server.middleware import ApiKeyMiddleware, BodyLimitMiddleware
from server.protocol import now
from server.responses_store import ResponseStore
from server.routes import chat, completions, messages, models, ops, replica, responses, tokenize
from server.settings import ServerSettings

logger = logging.getLogger(__name__)


def make_metrics(model_name: str, cache_info: dict[str, str], compat: str | None = None) -> Any:
    """`server.observability.Metrics`, or a minimal fallback if that module is missing;
    `compat` is --metrics-compat."""
    try:
        from server.observability import Metrics
    except ImportError:
        from server.metrics_fallback import FallbackMetrics as Metrics
    return Metrics(model_name, cache_info, compat=compat)


def create_app(settings: ServerSettings, engine_factory: Callable[[], Any],
               on_load_failure: Callable[[BaseException], None] | None = None) -> FastAPI:
    """Build the app. `engine_factory()` returns a loaded `LLMEngine` (called on the engine
    thread); `on_load_failure(exc)` runs on the event loop if it raises (e.g. to exit 1)."""
    engine = AsyncEngine(engine_factory, max_queued_requests=settings.max_queued_requests,
                         stall_timeout=settings.engine_stall_timeout, freeze_gc=True)
    ctx = ServerContext(settings=settings, engine=engine)
    ctx.responses = ResponseStore(settings.responses_store_max_count, settings.responses_store_max_bytes,
                                  settings.responses_store)
    engine.on_ready = lambda llm: _on_engine_ready(ctx, llm)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        heap.while_loading()  # until _on_engine_ready's heap.after_loading()
        engine.start()
        watcher = asyncio.ensure_future(_watch_load(engine, on_load_failure))
        try:
            yield
        finally:
            watcher.cancel()
            engine.shutdown()
            if ctx.inputs is not None:
                ctx.inputs.shutdown()
            ctx.responses.close()

    app = FastAPI(title="paged-serve", version=_version(), lifespan=lifespan)
    app.state.ctx = ctx
    install_error_handlers(app, shapes=((is_anthropic_path, anthropic_error_response),))
    for module in (completions, chat, responses, messages, models, tokenize, ops, replica):
        app.include_router(module.router)

    # Middleware: the last added is the outermost (CORS, then auth, then the body's checks).
    counts = {"messages": (settings.max_messages, "messages"), "tools": (settings.max_tools, "tools"),
              "input": (settings.max_messages, "items"),
              "stop": (settings.max_stop_sequences, "sequences"),
              "stop_sequences": (settings.max_stop_sequences, "sequences"),  # /v1/messages
              "stop_token_ids": (settings.max_stop_token_ids, "token ids"),
              "logit_bias": (settings.max_logit_bias, "entries")}
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_request_body_bytes,
                       max_json_depth=settings.max_json_depth, max_counts=counts)
    if settings.api_key:
        # NOTE: /dashboard is a static page with no data (it asks for a key and sends it to the
        # guarded /kv/blocks); a browser cannot send a Bearer header when it opens a page.
        open_paths = ("/health", "/dashboard", *replica.OPEN_PATHS)
        open_paths += ops.OPS_PATHS if settings.metrics_public else ()
        app.add_middleware(ApiKeyMiddleware, api_key=settings.api_key, open_paths=open_paths)
    if settings.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.allowed_origins),
                           allow_methods=["*"], allow_headers=["*"], allow_credentials=True)
    return app


def _on_engine_ready(ctx: ServerContext, llm: Any) -> None:
    """Runs on the engine thread once the engine is built, before it is marked ready."""
    config = llm.model_config
    ctx.model_name = config.served_model_name
    ctx.max_model_len = config.max_model_len
    ctx.vocab_size = len(llm.tokenizer) if llm.tokenizer is not None else config.hf_config.vocab_size
    # NOTE: prompt ids must be both the model's (its embedding) and the tokenizer's (echo decodes them).
    limits = llm.admission_limits
    ctx.admission_limits = replace(limits, vocab_size=min(limits.vocab_size, ctx.vocab_size))
    ctx.inputs = InputProcessor(llm.tokenizer, vocab_size=ctx.vocab_size, max_model_len=ctx.max_model_len,
                                chat_template=ctx.settings.chat_template, grammars=llm.structured_outputs)
    _warm_structured_outputs(llm)
    ctx.generation_defaults, ctx.generation_config_file = load_generation_defaults(
        ctx.settings.generation_config, config.path)
    if ctx.generation_defaults:
        logger.info("Generation defaults from %s: %s", ctx.generation_config_file,
                    ", ".join(f"{k}={v}" for k, v in ctx.generation_defaults.items()))
    else:
        logger.info("Generation defaults: none (--generation-config %s)", ctx.settings.generation_config)
    ctx.created = now()
    try:
        ctx.cache_info = llm.cache_info()
        ctx.metrics = make_metrics(ctx.model_name, ctx.cache_info, ctx.settings.metrics_compat)
        ctx.engine.on_stats = ctx.metrics.observe
    except Exception:  # noqa: BLE001 - serve without metrics rather than not at all
        logger.exception("metrics could not be set up; /metrics will answer 503")
    logger.info("Serving %s (max_model_len %d); cache: %s", ctx.model_name, ctx.max_model_len,
                _safe(llm.cache_info))
    heap.after_loading()


def _warm_structured_outputs(llm: Any) -> None:
    """Build the structured-output tokenizer while loading rather than on the first constrained
    request, whose build would stall every stream (see `StructuredOutputCompiler.warm_up`).
    A failure here is logged; the build is then tried again (and fails that request alone)."""
    compiler = getattr(llm, "structured_outputs", None)
    if compiler is None:
        return
    try:
        seconds = compiler.warm_up()
    except Exception:  # noqa: BLE001 - structured outputs are one feature, not the server
        logger.exception("structured outputs: the vocabulary could not be prepared; constrained requests will fail")
        return
    if seconds:
        logger.info("Structured outputs: vocabulary prepared in %.2f s", seconds)


def _safe(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001
        return repr(exc)


async def _watch_load(engine: AsyncEngine, on_failure: Callable[[BaseException], None] | None) -> None:
    with contextlib.suppress(asyncio.CancelledError):
        try:
            await engine.wait_ready()
        except EngineDeadError as exc:
            if on_failure is not None:
                on_failure(exc)


def _version() -> str:
    from server import __version__

    return __version__
