"""Host overhead per engine step: the time `LLMEngine.step()` spends outside the executor's
forward pass, on the tiny dummy model (configs/models/tiny-4kv.json), at several batch sizes.

Each case fills the engine with `batch` requests (greedy, or sampling with temperature 0.8 and
top_p 0.95) whose prompts leave them decoding at ~`context` tokens, then times `--steps` decode
steps: the whole step and the executor's `execute()` inside it. Prints medians, and the
overhead per sequence. Quote it as a ratio against a run of the same script on the same
machine (another commit, or before a change), never as an absolute figure.

    OMP_NUM_THREADS=1 python -m benchmarks.step_overhead --batch 1 64 256 --context 512 2048
"""

from __future__ import annotations

import argparse
import statistics
import time

from engine.config import EngineArgs
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams


def measure(batch: int, context: int, steps: int, sampling: str, seed: int = 0) -> dict:
    args = EngineArgs(model="tiny-4kv", load_format="dummy", max_model_len=context + steps + 16, block_size=16,
                      max_num_seqs=max(batch, 1), max_num_batched_tokens=max(8192, batch), seed=seed,
                      kv_cache_memory=f"{batch * (context + steps + 32) * 4096 + 64 * 2**20}",
                      enable_prefix_caching=True)
    engine = LLMEngine(args.create_engine_config())
    if sampling == "greedy":
        params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    else:
        params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=steps + 8, ignore_eos=True, seed=seed)
    for i in range(batch):
        prompt = [(7 * i + 13 * k) % 1000 + 3 for k in range(context - 8)]
        engine.add_request(f"r{i}", prompt, params)
    execute = engine.executor.execute
    spent: list[float] = []

    def timed(step_input):
        t0 = time.perf_counter()
        try:
            return execute(step_input)
        finally:
            spent.append(time.perf_counter() - t0)

    engine.executor.execute = timed
    while any(not g.seqs[0].output_token_ids for g in engine.requests.values()):  # prefill
        engine.step()
    for _ in range(8):  # warm up the decode path
        engine.step()
    totals, forwards = [], []
    for _ in range(steps):
        spent.clear()
        t0 = time.perf_counter()
        engine.step()
        totals.append(time.perf_counter() - t0)
        forwards.append(sum(spent))
    overhead = [t - f for t, f in zip(totals, forwards)]
    return {"batch": batch, "context": context, "sampling": sampling, "step_ms": statistics.median(totals) * 1e3,
            "forward_ms": statistics.median(forwards) * 1e3, "overhead_ms": statistics.median(overhead) * 1e3,
            "overhead_us_per_seq": statistics.median(overhead) * 1e6 / batch}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--context", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--sampling", nargs="+", default=["top_p", "greedy"], choices=["top_p", "greedy"])
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    print("| sampling | context | batch | step (ms) | forward (ms) | host overhead (ms) | per sequence (us) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for sampling in args.sampling:
        for context in args.context:
            for batch in args.batch:
                r = measure(batch, context, args.steps, sampling)
                print(f"| {sampling} | {context} | {batch} | {r['step_ms']:.2f} | {r['forward_ms']:.2f} | "
                      f"{r['overhead_ms']:.2f} | {r['overhead_us_per_seq']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
