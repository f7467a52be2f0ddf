"""Operator routes: GET /metrics (Prometheus), GET /kv/blocks (the block pool map, JSON),
GET /kv/requests/{request_id} (one request's block tables, JSON) and GET /dashboard (the live
block map page from server/static/)."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, JSONResponse, Response

from server.context import get_ctx
from server.errors import OpenAIError, shown

router = APIRouter()

STATIC_DIR = Path(__file__).resolve().parent.parent / "static"
# Routes that --metrics-public opens without the API key (the dashboard page polls /kv/blocks).
OPS_PATHS = ("/metrics", "/kv/blocks", "/kv/requests/", "/dashboard")


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    ctx = get_ctx(request)
    if ctx.metrics is None:
        raise OpenAIError(503, "Metrics are available once the model has loaded.", code="model_loading")
    watchdog = ctx.engine.watchdog
    ctx.metrics.observe_watchdog(watchdog.seconds_without_progress(), watchdog.num_stalls)
    body, content_type = ctx.metrics.render()
    return Response(content=body, media_type=content_type)


@router.get("/kv/blocks")
async def kv_blocks(request: Request) -> JSONResponse:
    ctx = get_ctx(request)
    return JSONResponse(await ctx.engine.block_map())


@router.get("/kv/requests/{request_id}")
async def kv_request(request_id: str, request: Request) -> JSONResponse:
    """The block tables of one request that holds blocks (ids as /kv/blocks lists them); 404
    once it has finished."""
    ctx = get_ctx(request)
    tables = await ctx.engine.request_blocks(request_id)
    if tables is None:
        raise OpenAIError(404, f"No request {shown(request_id)!r} holds KV blocks (it may have finished).",
                          code="request_not_found")
    return JSONResponse(tables)


@router.get("/dashboard", include_in_schema=False)
async def dashboard() -> Response:
    page = STATIC_DIR / "dashboard.html"
    if not page.is_file():
        raise OpenAIError(404, "The dashboard is not installed (server/static/dashboard.html).")
    return FileResponse(page, media_type="text/html")
