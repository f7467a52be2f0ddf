"""Tensor parallelism: output tokens/s and per-step time at several tensor-parallel sizes.

    python -m benchmarks.tp_bench                        # default model, TP = 1 and 3, on the CPU
    python -m benchmarks.tp_bench --tp 1 2 4 --model llama-3-8b --load-format dummy --device cuda

The same prompts (token ids from the foundation tests' text) run to exactly --max-tokens each
(EOS ignored), batched, one engine per size, one after another in this process (rank 0 is this
process, the other ranks are its worker processes). Reported per size: load time, the prefill
step, decode step time (mean and median) and output tokens/s over the whole run.

On a CPU all ranks share the same cores: each rank gets cores / N intra-op threads (unless
OMP_NUM_THREADS is set), so tensor parallelism only adds communication there. It pays on
several GPUs, where each rank has its own device and memory bandwidth. A size needing more GPUs
than the machine has is skipped, and said so.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch


def make_prompts(n: int, prompt_len: int, vocab_size: int, tokenizer) -> list[list[int]]:
    if tokenizer is None:  # dummy weights: fixed pseudo-random ids
        g = torch.Generator().manual_seed(0)
        return [torch.randint(3, vocab_size, (prompt_len,), generator=g).tolist() for _ in range(n)]
    from tests.engine.prompts import prompt_of_length

    return [prompt_of_length(tokenizer, prompt_len, 37 * i) for i in range(n)]


def run_one(tp: int, args) -> dict:
    from engine.core.sampling_params import SamplingParams
    from engine.loop.llm import LLM

    t0 = time.perf_counter()
    llm = LLM(args.model, load_format=args.load_format, device=args.device, tensor_parallel_size=tp,
              max_model_len=args.max_model_len, kv_cache_memory=args.kv_cache_memory, swap_space=0.05,
              enable_prefix_caching=False)
    load_s = time.perf_counter() - t0
    engine = llm.engine
    try:
        prompts = make_prompts(args.num_prompts, args.prompt_len, engine.model_config.hf_config.vocab_size,
                               engine.tokenizer)
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
        for i, p in enumerate(prompts):
            engine.add_request(f"bench-{i}", p, params)
        steps: list[tuple[float, bool]] = []  # (seconds, whether a prompt was in the step)
        t_run = time.perf_counter()
        while engine.has_unfinished_requests():
            prefill = bool(engine.scheduler.waiting)  # NOTE: all requests fit: waiting ones start now
            t = time.perf_counter()
            engine.step()
            steps.append((time.perf_counter() - t, prefill))
        run_s = time.perf_counter() - t_run
    finally:
        engine.shutdown()
    decode = [s for s, is_prefill in steps if not is_prefill]
    prefill = [s for s, is_prefill in steps if is_prefill]
    out_tokens = args.num_prompts * args.max_tokens
    return {
        "tp": tp,
        "load_s": round(load_s, 2),
        "prefill_steps": len(prefill),
        "prefill_ms": round(1000 * sum(prefill), 1),
        "decode_steps": len(decode),
        "decode_step_ms_mean": round(1000 * statistics.fmean(decode), 2) if decode else None,
        "decode_step_ms_median": round(1000 * statistics.median(decode), 2) if decode else None,
        "output_tokens": out_tokens,
        "run_s": round(run_s, 2),
        "output_tokens_per_s": round(out_tokens / run_s, 1),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, nargs="+", default=[1, 3], help="tensor-parallel sizes to run")
    p.add_argument("--model", default=None, help="default: the default model; with --load-format dummy a configs/models name")
    p.add_argument("--load-format", default="auto", choices=("auto", "dummy"))
    p.add_argument("--device", default="cpu")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--kv-cache-memory", default="128MiB", help="per rank, on the CPU")
    p.add_argument("--out", default=None, help="also write the results as JSON here")
    args = p.parse_args(argv)

    results, skipped = [], []
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for tp in args.tp:
        if args.device.startswith("cuda") and tp > gpus:
            skipped.append(f"TP={tp}: needs {tp} GPUs, this machine has {gpus}")
            continue
        r = run_one(tp, args)
        results.append(r)
        print(json.dumps(r), flush=True)
    cores = os.cpu_count()
    threads = os.environ.get("OMP_NUM_THREADS", "cores / TP per rank")
    print(f"\n{args.device}, {cores} cores (1-minute load average {os.getloadavg()[0]:.1f}), "
          f"intra-op threads: {threads}; {args.num_prompts} prompts x "
          f"{args.prompt_len} tokens -> {args.max_tokens} tokens each")
    print(f"{'TP':>3} {'load s':>7} {'prefill ms':>11} {'decode step ms (mean/median)':>29} {'tokens/s':>9}")
    for r in results:
        print(f"{r['tp']:>3} {r['load_s']:>7} {r['prefill_ms']:>11} "
              f"{str(r['decode_step_ms_mean']) + ' / ' + str(r['decode_step_ms_median']):>29} "
              f"{r['output_tokens_per_s']:>9}")
    for s in skipped:
        print("skipped:", s)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "cpu_count": cores, "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
                       "load_average_1m_at_end": round(os.getloadavg()[0], 2), "results": results,
                       "skipped": skipped}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
