"""Pipeline parallelism: decode tokens/s at 16 streams and each rank's peak memory, at several
pipeline sizes and micro-batch counts, one engine after another.

    python -m benchmarks.pp_bench              # default model: P=1 (compiled stack off, on), P=2 (1, 2 micro-batches)
    python -m benchmarks.pp_bench --runs 1:1 2:1 2:2 3:3 --out results.json
    python -m benchmarks.pp_bench --model smollm2-1.7b --load-format dummy --dtype bfloat16 --runs 1:1 2:1

Each run is `P:M` (M micro-batches per step). The same prompts (foundation-test text) run to
exactly --max-tokens each (EOS ignored), all admitted at once; with dummy weights (no
tokenizer) the prompts are token ids. Reported: decode tokens/s (decode
steps' tokens over their time), the mean decode step, each rank's CPU time per decode step
(what other jobs on a shared machine disturb least), whether the greedy tokens equal the first
run's, and per rank its peak resident memory (VmHWM) and its memory at the end (VmRSS), read from
/proc before shutdown. Every run is a fresh process (rank 0), so each peak is that run's own.

On one CPU all ranks share the cores (each gets cores / ranks intra-op threads): a pipeline
only adds the sends and the idle bubbles there, and its stages run the decoder layer by layer
in Python (the compiled decoder stack is off under pipeline parallelism). It pays where one
device cannot hold the model, each stage on its own GPU or machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def _mem_kib(pid: int | str = "self") -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("VmHWM:", "VmRSS:")):
                key, value = line.split(":")
                out[key] = int(value.split()[0])
    return out


def _cpu_s(pid: int | str = "self") -> float:
    """The process's CPU time (user + system, all its threads), seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_one(spec: str, args) -> dict:
    from engine.core.sampling_params import SamplingParams
    from engine.loop.llm import LLM
    from tests.engine.prompts import prompt_of_length

    pp, micro, *how = spec.split(":")
    pp, micro = int(pp), int(micro)

    llm = LLM(args.model, pipeline_parallel_size=pp, pipeline_micro_batches=micro, max_model_len=args.max_model_len,
              kv_cache_memory=args.kv_cache_memory, swap_space=0.05, enable_prefix_caching=False,
              max_num_seqs=args.streams, load_format=args.load_format, dtype=args.dtype)
    engine = llm.engine
    if how == ["py"]:
        engine.executor.runner.model.model.compiled_stack = None  # the decoder layer by layer, as a stage runs it
    try:
        if engine.tokenizer is None:  # dummy weights
            prompts = [[(37 * i + j) % 1000 + 3 for j in range(args.prompt_len)] for i in range(args.streams)]
        else:
            prompts = [prompt_of_length(engine.tokenizer, args.prompt_len, 37 * i) for i in range(args.streams)]
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
        for i, p in enumerate(prompts):
            engine.add_request(f"bench-{i}", p, params)
        decode, tokens, started = [], {}, set()
        pids = {0: "self"} | {r: p.pid for r, p in getattr(engine.executor, "_procs", {}).items()}
        cpu0 = None
        while engine.has_unfinished_requests():
            # NOTE: a decode step: every stream has its first token (its prompt is in the cache)
            prefill = len(started) < len(prompts)
            if not prefill and cpu0 is None:
                cpu0 = {r: _cpu_s(pid) for r, pid in pids.items()}
            t = time.perf_counter()
            outs = engine.step()
            took = time.perf_counter() - t
            if not prefill:
                decode.append(took)
            for o in outs:
                if o.outputs[0].token_ids:
                    started.add(o.request_id)
                if o.finished:
                    tokens[o.request_id] = o.outputs[0].token_ids
        cpu = {r: _cpu_s(pid) - cpu0[r] for r, pid in pids.items()}
        ranks = {0: _mem_kib()} | {r: _mem_kib(p.pid) for r, p in getattr(engine.executor, "_procs", {}).items()}
    finally:
        engine.shutdown()
    return {
        "run": spec, "pp": pp, "micro_batches": micro,
        "decode_step_ms_mean": round(1000 * statistics.fmean(decode), 2),
        "decode_tokens_per_s": round(args.streams / statistics.fmean(decode), 1),
        # NOTE: CPU time is what a shared machine's other jobs disturb least: per decode step, per rank
        "decode_cpu_ms_per_step": {r: round(1000 * c / len(decode), 2) for r, c in cpu.items()},
        "peak_rss_mib": {r: round(m["VmHWM"] / 1024) for r, m in ranks.items()},
        "end_rss_mib": {r: round(m["VmRSS"] / 1024) for r, m in ranks.items()},
        "tokens": [tokens[f"bench-{i}"] for i in range(len(prompts))],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", nargs="+", default=["1:1:py", "1:1", "2:1", "2:2"],
                   help="P:M pairs; 1:1:py runs one process without the compiled decoder stack")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a run in a fresh process
    p.add_argument("--model", default=None, help="with --load-format dummy: a config under configs/models/")
    p.add_argument("--load-format", default="auto", help="dummy: random weights of --model's config")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=256)
    p.add_argument("--kv-cache-memory", default="128MiB", help="per rank")
    p.add_argument("--repeat", type=int, default=1,
                   help="run the list this many times, interleaved; report each run's best (a shared machine's noise)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.one:
        print("RESULT " + json.dumps(run_one(args.one, args)), flush=True)
        return 0
    best: dict[str, dict] = {}
    forwarded, skip = [], False
    for a in (argv if argv is not None else sys.argv[1:]):
        skip = a in ("--runs", "--repeat", "--out") or (skip and not a.startswith("--"))
        if not skip:
            forwarded.append(a)
    for _ in range(args.repeat):
        for run in args.runs:
            # NOTE: each run in a fresh process, so that rank 0's peak memory is its own
            cmd = [sys.executable, "-m", "benchmarks.pp_bench", "--one", run] + forwarded
            done = subprocess.run(cmd, capture_output=True, text=True, check=True)
            r = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[7:])
            print(json.dumps({k: v for k, v in r.items() if k != "tokens"}), flush=True)
            seen = best.get(run, {}).get("all_tokens_per_s", [])
            if not seen or r["decode_tokens_per_s"] > max(seen):
                best[run] = r
            best[run]["all_tokens_per_s"] = seen + [r["decode_tokens_per_s"]]
    results = [best[run] for run in args.runs]
    for r in results:
        r["same_tokens_as_first"] = r["tokens"] == results[0]["tokens"]
    base = results[0]["decode_tokens_per_s"]
    print(f"\n{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}; {args.streams} streams x "
          f"{args.prompt_len} prompt tokens -> {args.max_tokens}")
    print(f"{'run':>6} {'decode tok/s':>13} {'vs first':>9} {'step ms':>8} {'CPU ms/step per rank':>22}"
          "  peak RSS MiB per rank (end)")
    for r in results:
        mem = ", ".join(f"r{k}: {v} ({r['end_rss_mib'][k]})" for k, v in r["peak_rss_mib"].items())
        cpu = " + ".join(str(v) for v in r["decode_cpu_ms_per_step"].values())
        print(f"{r['run']:>6} {r['decode_tokens_per_s']:>13} "
              f"{r['decode_tokens_per_s'] / base:>9.2f} {r['decode_step_ms_mean']:>8} {cpu:>22}  {mem}"
              + ("" if r["same_tokens_as_first"] else "  TOKENS DIFFER")
              + (f"  (all: {r['all_tokens_per_s']})" if args.repeat > 1 else ""))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "cpu_count": os.cpu_count(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
                       "load_average_1m_at_end": round(os.getloadavg()[0], 2), "results": [{k: v for k, v in r.items() if k != "tokens"} for r in results]},
                      f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
