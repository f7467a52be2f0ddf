"""GET /v1/models, /health, /version."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from server import __version__
from server.context import get_ctx
from server.errors import OpenAIError
from server.protocol import ModelCard, ModelList
from server.routes.common import require_ready

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    """200 when ready; 503 while loading, draining, after the engine died, or while it is
    stalled (work pending and no step finished for --engine-stall-timeout seconds). Never
    touches the engine, so it answers at once however busy the engine is."""
    ctx = get_ctx(request)
    engine = ctx.engine
    if ctx.draining:
        return JSONResponse({"status": "draining"}, status_code=503)
    if not engine.is_ready:
        body = {"status": engine.state.value}
        if engine.public_dead_reason:
            body["reason"] = engine.public_dead_reason
        return JSONResponse(body, status_code=503)
    stalled = engine.watchdog.check()
    if stalled is not None:
        return JSONResponse({"status": "stalled", "reason": stalled}, status_code=503)
    return JSONResponse({"status": "ok"})


@router.get("/version")
async def version() -> dict:
    return {"version": __version__}


@router.get("/v1/models", response_model=ModelList)
async def list_models(request: Request) -> ModelList:
    ctx = get_ctx(request)
    require_ready(ctx)
    return ModelList(data=[_card(ctx)])


def _card(ctx) -> ModelCard:
    return ModelCard(id=ctx.model_name, created=ctx.created, root=ctx.model_name, max_model_len=ctx.max_model_len,
                     generation_defaults=ctx.generation_defaults, generation_config=ctx.generation_config_file)


@router.get("/v1/models/{model:path}", response_model=ModelCard)
async def get_model(model: str, request: Request) -> ModelCard:
    ctx = get_ctx(request)
    require_ready(ctx)
    if model != ctx.model_name:
        raise OpenAIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")
    return _card(ctx)
