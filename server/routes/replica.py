"""What a router or an orchestrator asks a replica about itself: GET /livez (Kubernetes'
liveness), GET /server_info and /model_info (the SGLang model gateway, `sglang-router`, reads
them when a worker registers: the served model's name becomes the worker's model id), and
GET /get_load (its load monitor). /get_server_info and /get_model_info are the older spellings
the gateway falls back to.

/health stays the readiness answer (200 only when a request would be served); /livez answers
200 whenever restarting the process would not help: while the model loads, while serving, and
while draining after SIGTERM; 503 only once the engine is dead or stalled.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from engine.loop.engine_thread import EngineState
from server import __version__
from server.context import ServerContext, get_ctx
from server.routes.common import require_ready

router = APIRouter()

# Opened without the API key (with /health): the kubelet's probe carries no key.
OPEN_PATHS = ("/livez",)


@router.get("/livez")
async def livez(request: Request) -> JSONResponse:
    """200 while loading, ready or draining; 503 once the engine died (it serves nothing
    again) or stalled (work pending and no step for --engine-stall-timeout seconds)."""
    engine = get_ctx(request).engine
    if engine.state is EngineState.DEAD:
        return JSONResponse({"status": "dead", "reason": engine.public_dead_reason}, status_code=503)
    if engine.is_ready:
        stalled = engine.watchdog.check()
        if stalled is not None:
            return JSONResponse({"status": "stalled", "reason": stalled}, status_code=503)
    return JSONResponse({"status": "alive", "engine": engine.state.value})


@router.get("/server_info")
@router.get("/get_server_info", include_in_schema=False)
async def server_info(request: Request) -> dict:
    """The serving facts a router registers a worker with (SGLang's field names). No
    `model_path`: the gateway would try to load a tokenizer from it, which HTTP routing does
    not need. 503 until the model has loaded."""
    ctx = get_ctx(request)
    require_ready(ctx)
    block_size = _int(ctx.cache_info.get("block_size"))
    num_blocks = _int(ctx.cache_info.get("num_gpu_blocks"))
    return {
        "served_model_name": ctx.model_name,
        "version": __version__,
        "max_model_len": ctx.max_model_len,
        "context_length": ctx.max_model_len,
        "max_total_tokens": block_size * num_blocks if block_size and num_blocks else None,
        "max_queued_requests": ctx.settings.max_queued_requests,
        "page_size": block_size,
        "dp_size": 1,
        "enable_prefix_caching": ctx.cache_info.get("enable_prefix_caching") == "True",
    }


@router.get("/model_info")
@router.get("/get_model_info", include_in_schema=False)
async def model_info(request: Request) -> dict:
    """The model facts a router reads (SGLang's field names); 503 until loaded."""
    ctx = get_ctx(request)
    require_ready(ctx)
    return {"served_model_name": ctx.model_name, "is_generation": True,
            "max_model_len": ctx.max_model_len}


@router.get("/get_load")
async def get_load(request: Request) -> list[dict]:
    """This replica's load as SGLang reports it, one entry per data-parallel rank (here one):
    requests in flight, of which waiting, and KV cache tokens in use (whole blocks)."""
    ctx = get_ctx(request)
    require_ready(ctx)
    return [{"dp_rank": 0, "num_reqs": ctx.engine.num_in_flight,
             "num_waiting_reqs": ctx.engine.num_queued, "num_tokens": _kv_tokens_in_use(ctx)}]


def _kv_tokens_in_use(ctx: ServerContext) -> int:
    stats = ctx.engine.last_stats
    block_size = _int(ctx.cache_info.get("block_size"))
    if stats is None or not block_size:
        return 0
    return (stats.num_device_blocks - stats.num_free_device_blocks) * block_size


def _int(value) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0
