"""What the engine checks of an admitted request (engine/core/admission.py) before it queues it:
what needs the engine's own capacity, which only the engine knows. A prompt that fits the KV
pool, a width (best_of) within max_num_seqs, and beams (which run together) that fit the pool
together: the scheduler's admission contract (engine/sched/scheduler.py) is that every queued request
can always run. Each failure is a `RequestError` naming the field at fault (the server answers 400).
"""

from __future__ import annotations

from engine.core.admission import EngineRequest
from engine.core.config import EngineConfig
from engine.core.request_error import RequestError
from engine.kv.block_manager import BlockManager


def check_fits(request: EngineRequest, config: EngineConfig, bm: BlockManager) -> None:
    """RequestError unless `request` can always run on this engine (its max_tokens is final)."""
    prompt_len = len(request.token_ids)
    needed, total = bm.blocks_to_hold(prompt_len), bm.usage().num_device_blocks
    if needed > total:
        raise RequestError(
            f"The prompt needs {needed} KV blocks but the whole KV cache has {total}; "
            "it can never be scheduled.", "prompt")
    _check_width(prompt_len, request, config, bm)


def _check_width(prompt_len: int, request: EngineRequest, config: EngineConfig, bm: BlockManager) -> None:
    """At most max_num_seqs sequences per request, and beams (which run together) that fit the
    pool together."""
    params = request.params
    max_seqs, width = config.scheduler.max_num_seqs, params.best_of
    field = "best_of" if params.best_of != params.n else "n"
    if width > max_seqs:
        raise RequestError(
            f"{field} must be at most {max_seqs} (the server's max_num_seqs: the most sequences one "
            f"request may run at once), got {width}.", field)
    if params.use_beam_search:
        length = max(prompt_len + params.max_tokens, bm.reserve_tokens or 0)
        needed, total = width * bm.blocks_to_hold(length), bm.usage().num_device_blocks
        if needed > total:
            raise RequestError(
                f"{field} {width} is too wide for beam search over {length} tokens (prompt and max_tokens): "
                f"the beams may need {needed} KV blocks of {bm.block_size} tokens, and the whole KV cache has "
                f"{total}. Lower the beam width or max_tokens.", field)
