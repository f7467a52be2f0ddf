"""POST /tokenize and /detokenize (vLLM's shapes). The tokenizer runs on the engine thread."""

from __future__ import annotations

from fastapi import APIRouter, Request

from server.context import get_ctx
from server.errors import bad_request, from_value_error
from server.protocol import DetokenizeRequest, TokenizeRequest
from server.routes.chat import to_template_messages
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
    template = ctx.settings.chat_template

    def run(engine) -> dict:
        if messages is not None:
            text, add_special = engine.chat_prompt(messages, template), False
        else:
            text, add_special = req.prompt, req.add_special_tokens
        ids = engine.tokenizer.encode(text, add_special_tokens=add_special)
        result = {"count": len(ids), "max_model_len": ctx.max_model_len, "tokens": ids}
        if req.return_token_strs:
            result["token_strs"] = engine.tokenizer.convert_ids_to_tokens(ids)
        return result

    try:
        return await ctx.engine.call(run)
    except ValueError as exc:
        raise from_value_error(exc) from None


@router.post("/detokenize")
async def detokenize(req: DetokenizeRequest, request: Request) -> dict:
    ctx = get_ctx(request)
    require_ready(ctx)
    ctx.check_model(req.model)
    if ctx.vocab_size is not None and any(not 0 <= t < ctx.vocab_size for t in req.tokens):
        raise bad_request(f"tokens must be token ids in [0, {ctx.vocab_size}).", param="tokens")
    text = await ctx.engine.call(lambda engine: engine.tokenizer.decode(req.tokens))
    return {"prompt": text}
