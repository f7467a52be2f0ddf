"""Host overhead per engine step: the time `LLMEngine.step()` spends outside the executor's
forward pass, on the tiny dummy model (configs/models/tiny-4kv.json), at several batch sizes.

Each case fills the engine with `batch` requests (greedy, or sampling with temperature 0.8 and
top_p 0.95) whose prompts leave them decoding at ~`context` tokens, then times `--steps` decode
steps: the whole step, the executor's `execute()` inside it, and the model runner's input
preparation inside that (token ids, positions, attention metadata: host work that a GPU waits
for too). Host overhead = step - execute + preparation. Prints medians, the overhead per
sequence, and the overhead's p10 (the host work with the least interference). Quote it as
a ratio against a run of the same script on the same machine (another commit, or before a
change), never as an absolute figure.

`--evict-mb N` writes N MiB after every forward pass (counted as forward), so that every case's
host work starts from the same cold caches. NOTE: on a CPU the forward pass itself evicts the
host's working set (the sequences, tables and dicts a step walks), and its KV reads grow with
the context: without eviction, a longer context makes the same host work slower (cache misses,
not more work). On a GPU the forward pass leaves the host's caches alone. With 1024 the
comparison across contexts is of the work alone.

    OMP_NUM_THREADS=1 python -m benchmarks.step_overhead --batch 1 64 256 --context 512 2048
    OMP_NUM_THREADS=1 python -m benchmarks.step_overhead --batch 64 256 --evict-mb 1024
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from engine.core.outputs import OutputKind
from engine.core.sampling_params import SamplingParams
from engine.loop.engine_args import EngineArgs
from engine.loop.llm_engine import LLMEngine

REPO = Path(__file__).resolve().parents[1]


def tiny_config(max_len: int) -> str:
    """configs/models/tiny-4kv.json with room for `max_len` positions, as a temporary file.
    On a GPU its heads are 64 wide: the CUDA paged_attention is built for 64 and 128 only, and
    head size 32 would time the pure-torch reference instead."""
    config = json.loads((REPO / "configs/models/tiny-4kv.json").read_text())
    config["max_position_embeddings"] = max(config["max_position_embeddings"], max_len)
    if torch.cuda.is_available():
        config["head_dim"] = 64
    path = Path(tempfile.mkdtemp(prefix="step-overhead-")) / "tiny-4kv.json"
    path.write_text(json.dumps(config))
    return str(path)


def measure(batch: int, context: int, steps: int, sampling: str, seed: int = 0, evict_mb: int = 0) -> dict:
    budget = max(8192, batch)
    # NOTE: every request keeps decoding until the measured steps are done: the first ones start
    # while the last ones are still being prefilled (budget tokens a step).
    max_tokens = -(-batch * context // budget) + 8 + steps + 8
    max_len = context + max_tokens
    # NOTE: on a GPU the pool is sized by --gpu-memory-utilization, not kv_cache_memory: the
    # block count is given instead, and the last case's engine is collected first (its pool
    # would otherwise still hold the GPU's memory when this one sizes its own).
    gpu_blocks = batch * -(-(max_len + 16) // 16) + 64 if torch.cuda.is_available() else None
    args = EngineArgs(model=tiny_config(max_len), load_format="dummy", max_model_len=max_len, block_size=16,
                      max_num_seqs=max(batch, 1), max_num_batched_tokens=budget, seed=seed,
                      kv_cache_memory=f"{batch * (max_len + 16) * 4096 + 64 * 2**20}", enable_prefix_caching=True,
                      num_gpu_blocks_override=gpu_blocks)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    engine = LLMEngine(args.create_engine_config())
    gc.collect()
    gc.freeze()  # as the server does once its engine is loaded (engine/loop/async_engine.py)
    if sampling == "greedy":
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    else:
        params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=max_tokens, ignore_eos=True, seed=seed)
    for i in range(batch):
        prompt = [(7 * i + 13 * k) % 1000 + 3 for k in range(context - 8)]
        # NOTE: as the server asks for them when streaming: only what is new each step
        engine.add_request(f"r{i}", prompt, params, output_kind=OutputKind.DELTA)
    execute, runner = engine.executor.execute, engine.executor.runner
    prepare = runner._prepare
    spent: list[float] = []
    prepared: list[float] = []
    evict = torch.zeros(evict_mb * 2**18) if evict_mb else None  # float32: 4 bytes each

    def timed(step_input):
        t0 = time.perf_counter()
        try:
            out = execute(step_input)
            if out.logits.is_cuda:  # the forward pass ends on the GPU, not when execute() returns
                torch.cuda.synchronize()
            if evict is not None:
                evict.add_(1.0)
            return out
        finally:
            spent.append(time.perf_counter() - t0)

    def timed_prepare(step_input):
        t0 = time.perf_counter()
        try:
            return prepare(step_input)
        finally:
            prepared.append(time.perf_counter() - t0)

    engine.executor.execute, runner._prepare = timed, timed_prepare
    while any(not g.seqs[0].output_token_ids for g in engine.requests.values()):  # prefill
        engine.step()
    for _ in range(8):  # warm up the decode path
        engine.step()
    assert len(engine.scheduler.running) == batch, "not every request is decoding"
    totals, forwards, preps = [], [], []
    for _ in range(steps):
        spent.clear()
        prepared.clear()
        t0 = time.perf_counter()
        engine.step()
        totals.append(time.perf_counter() - t0)
        preps.append(sum(prepared))
        forwards.append(sum(spent) - preps[-1])  # the model and the cache's block moves
    overhead = sorted(t - f for t, f in zip(totals, forwards))
    gc.unfreeze()
    # NOTE: the p10 as well as the median: on a shared VM the median carries the neighbours'
    # interference (single steps vary 2x); the p10 is the host work on a quiet machine.
    p10 = overhead[len(overhead) // 10]
    return {"batch": batch, "context": context, "sampling": sampling, "step_ms": statistics.median(totals) * 1e3,
            "forward_ms": statistics.median(forwards) * 1e3,
            "prepare_ms": statistics.median(preps) * 1e3, "overhead_ms": statistics.median(overhead) * 1e3,
            "overhead_us_per_seq": statistics.median(overhead) * 1e6 / batch, "overhead_p10_ms": p10 * 1e3,
            "overhead_p10_us_per_seq": p10 * 1e6 / batch}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--context", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--sampling", nargs="+", default=["top_p", "greedy"], choices=["top_p", "greedy"])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--evict-mb", type=int, default=0, help="MiB written after every forward pass (see above)")
    args = ap.parse_args()
    print("| sampling | context | batch | step (ms) | forward (ms) | host overhead (ms) | of which input prep (ms) "
          "| per sequence (us) | overhead p10 (ms) | p10 per sequence (us) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for sampling in args.sampling:
        for context in args.context:
            for batch in args.batch:
                r = measure(batch, context, args.steps, sampling, evict_mb=args.evict_mb)
                print(f"| {sampling} | {context} | {batch} | {r['step_ms']:.2f} | {r['forward_ms']:.2f} | "
                      f"{r['overhead_ms']:.2f} | {r['prepare_ms']:.2f} | {r['overhead_us_per_seq']:.0f} | "
                      f"{r['overhead_p10_ms']:.2f} | {r['overhead_p10_us_per_seq']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
