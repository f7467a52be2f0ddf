"""`calibrate_step_cost`: train the scheduler's step-time model (engine/sched/step_cost.py) at start-up,
before the first request, by running a few small real requests through the real engine.

Why: the step-time cap is off until the model has seen 8 steps with prefill and 8 with decodes.
A server that starts into a burst (every stream's prompt at once) would run its first ~10 steps
uncapped: at 16 streams on a 2-core CPU those are 400 ms steps while more and more streams decode,
which is where the ITL tail of a run comes from. Real requests through `LLMEngine.step()` time the
same code the server runs (no second path to keep in step with the first).

What runs: up to `_REQUESTS` greedy requests of token ids (no text, so nothing detokenizes to a
user), one added per step, prompts of 16-160 tokens, 8 tokens each; so the steps mix prefills of
different sizes with 1-8 decodes over growing contexts, enough for the fit's four terms. It
stops as soon as the model answers: 9 steps, ~1 s on a 2-core CPU with SmolLM2-135M.

Afterwards nothing of it is left: unfinished requests are aborted and `LLMEngine.reset` gives a
fresh KV pool (no prefix-cache entries, blocks handed out from id 0 again), no preemption counts
or KV events, and totals at 0. Only the step-time model keeps what it learnt (and goes on
learning).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from engine.core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.loop.llm_engine import LLMEngine

logger = logging.getLogger(__name__)

_PROMPT_LENGTHS = (16, 96, 32, 160, 48, 128, 24, 64)
_REQUESTS = 12  # at most; lengths cycle
_MAX_STEPS = 48  # a bound whatever the scheduler does with them
_ID_PREFIX = "paged-serve-calibration-"


def calibrate_step_cost(engine: LLMEngine) -> bool:
    """Run calibration steps if the engine has a step-time model that cannot answer yet and no
    request of its own; True if the model answers afterwards. Raises what a real step raises
    (a broken engine should not start serving)."""
    cost = engine.scheduler.step_cost
    if cost is None or cost.coefficients() is not None or engine.has_unfinished_requests():
        return cost is not None and cost.coefficients() is not None
    t0 = time.perf_counter()
    vocab = engine.model_config.hf_config.vocab_size
    max_len = engine.model_config.max_model_len
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    added = steps = 0
    while steps < _MAX_STEPS and cost.coefficients() is None:
        if added < _REQUESTS:
            n = min(_PROMPT_LENGTHS[added % len(_PROMPT_LENGTHS)], max_len - 8)
            if n >= 1:
                # NOTE: distinct ids per request (no prefix-cache hits between them)
                prompt = [(997 * added + 31 * i + 1) % vocab for i in range(n)]
                engine.add_request(f"{_ID_PREFIX}{added}", prompt, params)
            added += 1
        elif not engine.has_unfinished_requests():
            break
        engine.step()
        steps += 1
    for request_id in [r for r in engine.requests if r.startswith(_ID_PREFIX)]:
        engine.abort_request(request_id)
    engine.reset()
    coef = cost.coefficients()
    if coef is None:
        logger.warning("step-time model: not trained after %d calibration steps (%.1f s); the cap "
                       "starts once it is", steps, time.perf_counter() - t0)
        return False
    a, b, c, d = coef
    logger.info("step-time model calibrated in %.1f s (%d steps): %.1f ms a step + %.2f ms a decode + "
                "%.2f ms a prefill token + %.2f ms per 1,000 context tokens", time.perf_counter() - t0, steps,
                a * 1e3, b * 1e3, c * 1e3, d * 1e3)
    return True
