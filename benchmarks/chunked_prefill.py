"""Decode inter-token latency of running requests while a long prompt arrives, chunked prefill
off vs on, on the default model.

    OMP_NUM_THREADS=1 python -m benchmarks.chunked_prefill --long-prompt 1024 --budget 128

A few short requests decode; then a long prompt arrives. Off, its whole prefill runs in one step
and every decoder waits for it; on, it is prefilled `--budget` tokens per step (decodes first),
so each decoder's inter-token latency stays near a decode step's. Prints, for each mode, the
median and max of the decoders' inter-token latencies from the long prompt's arrival until its
first token (and a decode-only step's time, for scale), that prompt's time to first token, and
the on/off ratios.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time

from engine import LLM, SamplingParams
from tests.engine.prompts import prompt_of_length


def run(chunked: bool, args) -> dict:
    kw = {"enable_chunked_prefill": True, "max_num_batched_tokens": args.budget} if chunked else {}
    llm = LLM(max_model_len=args.max_model_len, kv_cache_memory="512MiB", enable_prefix_caching=False, **kw)
    engine = llm.engine
    decode = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
    for i in range(args.num_decoders):
        engine.add_request(f"d{i}", prompt_of_length(llm.tokenizer, 32, 17 * i), decode)
    for _ in range(args.warmup_steps):
        engine.step()
    idle = []  # decode-only steps, for scale
    for _ in range(5):
        t0 = time.perf_counter()
        engine.step()
        idle.append(time.perf_counter() - t0)
    long = prompt_of_length(llm.tokenizer, args.long_prompt, 100)
    t_arrival = time.perf_counter()
    engine.add_request("long", long, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    last = {f"d{i}": t_arrival for i in range(args.num_decoders)}
    itls: list[float] = []
    ttft = None
    while ttft is None:
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            if o.request_id == "long" and o.outputs and o.outputs[0].token_ids:
                ttft = now - t_arrival
            elif o.request_id in last:
                itls.append(now - last[o.request_id])
                last[o.request_id] = now
    for rid in list(engine.requests):
        engine.abort_request(rid)
    return {
        "chunked_prefill": chunked,
        "budget": engine.config.scheduler.max_num_batched_tokens,
        "decode_only_step_median_ms": 1000 * statistics.median(idle),
        "decode_itl_median_ms": 1000 * statistics.median(itls),
        "decode_itl_max_ms": 1000 * max(itls),
        "long_ttft_ms": 1000 * ttft,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-decoders", type=int, default=4)
    ap.add_argument("--long-prompt", type=int, default=1024)
    ap.add_argument("--budget", type=int, default=128, help="max_num_batched_tokens with chunked prefill")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--warmup-steps", type=int, default=5)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    off, on = run(False, args), run(True, args)
    result = {
        "off": off,
        "on": on,
        "itl_max_ratio_on_over_off": on["decode_itl_max_ms"] / off["decode_itl_max_ms"],
        "itl_median_ratio_on_over_off": on["decode_itl_median_ms"] / off["decode_itl_median_ms"],
        "ttft_ratio_on_over_off": on["long_ttft_ms"] / off["long_ttft_ms"],
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
