"""Engine logprobs (one dict per token: token id -> Logprob, the sampled token first) in the
two OpenAI shapes: completions (`tokens` / `token_logprobs` / `top_logprobs` / `text_offset`)
and chat (`content`: a list of `{token, logprob, bytes, top_logprobs}`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from engine.core.outputs import Logprob
from server.protocol import ChatTokenLogprob, CompletionLogprobs, TopLogprob

Decode = Callable[[int], str]


def _finite(value: float) -> float:
    # NOTE: JSON has no -inf; OpenAI clients expect a number. -9999.0 is what vLLM sends.
    return value if math.isfinite(value) else -9999.0


def _text(token_id: int, lp: Logprob, decode: Decode) -> str:
    return lp.decoded_token if lp.decoded_token is not None else decode(token_id)


def _sampled(token_ids: Sequence[int], i: int, entry: dict[int, Logprob]) -> int:
    if i < len(token_ids) and token_ids[i] in entry:
        return token_ids[i]
    return next(iter(entry))


def completion_logprobs(entries: Sequence[dict[int, Logprob] | None], token_ids: Sequence[int],
                        decode: Decode, text_offset: int) -> tuple[CompletionLogprobs, int]:
    """Logprobs for the tokens `token_ids` (one entry each; None entries, e.g. the first prompt
    token, get a null logprob). Returns the object and the text offset after the last token."""
    out = CompletionLogprobs()
    for i, token_id in enumerate(token_ids):
        entry = entries[i] if i < len(entries) else None
        if not entry:
            token = decode(token_id)
            out.tokens.append(token)
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
        else:
            sampled = _sampled(token_ids, i, entry)
            token = _text(sampled, entry[sampled], decode)
            out.tokens.append(token)
            out.token_logprobs.append(_finite(entry[sampled].logprob))
            out.top_logprobs.append({_text(t, lp, decode): _finite(lp.logprob) for t, lp in entry.items()})
        out.text_offset.append(text_offset)
        text_offset += len(token)
    return out, text_offset


def chat_logprobs(entries: Sequence[dict[int, Logprob]], token_ids: Sequence[int], decode: Decode,
                  top_n: int) -> list[ChatTokenLogprob]:
    content = []
    for i, entry in enumerate(entries):
        if not entry:
            continue
        sampled = _sampled(token_ids, i, entry)
        token = _text(sampled, entry[sampled], decode)
        ranked = sorted(entry.items(), key=lambda kv: kv[1].rank)[:top_n]
        content.append(ChatTokenLogprob(
            token=token,
            logprob=_finite(entry[sampled].logprob),
            bytes=list(token.encode("utf-8")),
            top_logprobs=[
                TopLogprob(token=(t := _text(tid, lp, decode)), logprob=_finite(lp.logprob), bytes=list(t.encode("utf-8")))
                for tid, lp in ranked
            ],
        ))
    return content
