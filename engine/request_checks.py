"""What the engine checks of a request before it queues it: a prompt of known token ids that
fits the context with its completion, and a width and size the scheduler can always run (its
admission contract, engine/scheduler.py). Each failure is a ValueError fit for the user (the
server answers 400); the server runs the same length checks earlier, off the engine thread."""

from __future__ import annotations

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.sampling_params import SamplingParams


def max_tokens_for(prompt_len: int, params: SamplingParams, max_model_len: int) -> int:
    """The request's max_tokens, capped at the end of the context (None: up to the end)."""
    room = max_model_len - prompt_len
    return room if params.max_tokens is None else min(params.max_tokens, room)


def check_request(token_ids: list[int], params: SamplingParams, config: EngineConfig, bm: BlockManager) -> None:
    if not token_ids:
        raise ValueError("The prompt must not be empty.")
    vocab = config.model.hf_config.vocab_size
    if any(not 0 <= t < vocab for t in token_ids):
        raise ValueError(f"Prompt token ids must be in [0, {vocab}).")
    max_len = config.model.max_model_len
    n_out = params.max_tokens if params.max_tokens is not None else 1
    if len(token_ids) + n_out > max_len:
        raise ValueError(
            f"This model's maximum context length is {max_len} tokens. However, you requested "
            f"{len(token_ids) + n_out} tokens ({len(token_ids)} in the messages, {n_out} in the "
            "completion). Please reduce the length of the messages or completion."
        )
    needed, total = bm.blocks_to_hold(len(token_ids)), bm.usage().num_device_blocks
    if needed > total:
        raise ValueError(
            f"The prompt needs {needed} KV blocks but the whole KV cache has {total}; "
            "it can never be scheduled."
        )
    _check_width(len(token_ids), params, config, bm)


def _check_width(prompt_len: int, params: SamplingParams, config: EngineConfig, bm: BlockManager) -> None:
    """At most max_num_seqs sequences per request, and beams (which run together) that fit the
    pool together."""
    max_seqs, width = config.scheduler.max_num_seqs, params.best_of
    field = "best_of" if params.best_of != params.n else "n"
    if width > max_seqs:
        raise ValueError(
            f"{field} must be at most {max_seqs} (the server's max_num_seqs: the most sequences one "
            f"request may run at once), got {width}."
        )
    if params.use_beam_search:
        length = max(prompt_len + max_tokens_for(prompt_len, params, config.model.max_model_len),
                     bm.reserve_tokens or 0)
        needed, total = width * bm.blocks_to_hold(length), bm.usage().num_device_blocks
        if needed > total:
            raise ValueError(
                f"{field} {width} is too wide for beam search over {length} tokens (prompt and max_tokens): "
                f"the beams may need {needed} KV blocks of {bm.block_size} tokens, and the whole KV cache has "
                f"{total}. Lower the beam width or max_tokens."
            )
