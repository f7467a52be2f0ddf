"""POST /tokenize and /detokenize (vLLM's shapes), through the input processor's worker threads."""

from __future__ import annotations

from fastapi import APIRouter, Request

from server.context import get_ctx
from server.errors import bad_request
from server.protocol import DetokenizeRequest, TokenizeRequest
from server.chat_request import to_template_messages
from server.routes.common import require_ready

router = APIRouter()


@router.post("/tokenize")
async def tokenize(req: TokenizeRequest, request: Request) -> dict:
    ctx = get_ctx(request)
    require_ready(ctx)
    ctx.check_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("Give exactly one of prompt or messages.", param="prompt")
    messages = to_template_messages(req.messages) if req.messages is not None else None
    return await ctx.inputs.tokenize(req.prompt, messages, req.add_special_tokens, req.return_token_strs)


@router.post("/detokenize")
async def detokenize(req: DetokenizeRequest, request: Request) -> dict:
    ctx = get_ctx(request)
    require_ready(ctx)
    ctx.check_model(req.model)
    return {"prompt": await ctx.inputs.detokenize(req.tokens)}
