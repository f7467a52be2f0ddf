"""The same over-committed workload under swap and under recompute preemption.

    python -m benchmarks.preemption --num-requests 32 --max-tokens 48 --num-blocks 40

All requests arrive at once into a KV pool too small for them; prints output tokens/s, p50/p99
end-to-end latency and the preemptions each mode caused, plus an ample-memory baseline.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import time

from engine import LLM, SamplingParams
from tests.engine.prompts import prompt_of_length


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def run(mode: str, blocks: int | None, args, prompts_seed: int) -> dict:
    llm = LLM(
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        num_gpu_blocks_override=blocks,
        preemption_mode=mode,
        swap_space=args.swap_gib,
        enable_prefix_caching=False,
    )
    rng = random.Random(prompts_seed)
    prompts = [prompt_of_length(llm.tokenizer, rng.randint(16, 96), rng.randrange(300)) for _ in range(args.num_requests)]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    e2e = [o.metrics.e2e_latency for o in outs]
    sched = llm.engine.scheduler
    stats = llm.engine.last_stats
    return {
        "mode": mode if blocks else "ample",
        "device_blocks": llm.engine.block_manager.usage().num_device_blocks,
        "output_tokens_per_s": args.num_requests * args.max_tokens / wall,
        "e2e_p50_s": statistics.median(e2e),
        "e2e_p99_s": percentile(e2e, 99),
        "preemptions": dict(sched.num_preemptions),
        "swap_out_mib": stats.swap_out_bytes_total / 2**20,
        "swap_in_mib": stats.swap_in_bytes_total / 2**20,
        "outputs": [o.outputs[0].token_ids for o in outs],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--num-blocks", type=int, default=40, help="device pool size in blocks (over-committed)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=256)
    ap.add_argument("--swap-gib", type=float, default=1.0)
    ap.add_argument("--json")
    args = ap.parse_args()
    logging.getLogger("engine.sched.scheduler").setLevel(logging.ERROR)
    results = [run(m, args.num_blocks, args, 0) for m in ("swap", "recompute")]
    results.append(run("swap", None, args, 0))
    same = all(r["outputs"] == results[-1]["outputs"] for r in results)
    print(f"{args.num_requests} requests x {args.max_tokens} tokens, block {args.block_size}")
    print(f"{'mode':10} {'blocks':>6} {'tok/s':>8} {'p50 s':>7} {'p99 s':>7} {'preempt':>8} {'out MiB':>8}")
    for r in results:
        n = sum(r["preemptions"].values())
        print(f"{r['mode']:10} {r['device_blocks']:6d} {r['output_tokens_per_s']:8.1f} {r['e2e_p50_s']:7.2f} "
              f"{r['e2e_p99_s']:7.2f} {n:8d} {r['swap_out_mib']:8.1f}")
    print(f"greedy outputs identical across modes: {same}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{k: v for k, v in r.items() if k != "outputs"} for r in results], f, indent=2)


if __name__ == "__main__":
    main()
