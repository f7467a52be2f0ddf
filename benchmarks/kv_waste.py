"""How much KV-cache memory does contiguous reservation waste, and how much does paging?

Part (a), `simulate` (the default subcommand): the seed article's back-of-envelope, seeded.
1,000 sequences with skewed lengths (benchmarks/workload.py) against two ways of holding their
KV cache:
  - reserve: every sequence gets a contiguous region for the maximum length (4,096 tokens);
  - paged:   every sequence gets ceil(len / 16) blocks of 16 tokens, so only its tail block
             can be partly empty.
Waste is 1 - (token slots used / token slots held); "concurrency gain" is held(reserve) /
held(paged): how many times more sequences fit in the same memory when paging.

    python -m benchmarks.kv_waste simulate --seeds 20 --json out.json --plot out.png

Part (b), `engine`: the same question on the real engine. One workload (skewed lengths scaled
to --max-model-len, prompts of random token ids, greedy with ignore_eos so each sequence reaches
exactly its length, all requests at once) runs through a fresh offline engine twice under the
same number of KV blocks: `kv_allocation="reserve"` (max_model_len tokens of blocks per
sequence at admission, the pre-paging baseline) and `"paged"` (blocks on demand). It reports
peak and mean concurrent sequences, the waste measured from the block tables each step, and
throughput and latency from the requests' metrics.

    OMP_NUM_THREADS=1 python -m benchmarks.kv_waste engine --max-model-len 512 --reserve-seqs 4 \\
        --num-requests 64 --max-tokens 0 --output-fraction 0.75 --json out.json --plot out.png

(`--output-fraction 0.75`: each sequence generates 75% of its length, a decode-heavy run;
the default is 8 output tokens each.) docs/why_paging.md has the measured results.

Part (c), `window`: sliding-window layers' blocks given back vs every layer's kept, on a
Gemma-3-shaped model at 8k context (benchmarks/kv_waste_window.py; docs/using.md, Models):

    python -m benchmarks.kv_waste window --layers 26 --window 512 --context 8192 --pool-gib 2
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script: python benchmarks/kv_waste.py
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# Part (b), the real engine: benchmarks/kv_waste_engine.py (re-exported for the command line).
from benchmarks.kv_waste_engine import (
    ENGINE_MAX_MODEL_LEN, ENGINE_MAX_TOKENS, ENGINE_NUM_REQUESTS, ENGINE_RESERVE_SEQS, engine_workload,
    format_engine_table, plot_engine, run_engine_comparison,
)
from benchmarks.kv_waste_window import WindowShape, format_window_table, run_window_comparison
from benchmarks.workload import sample_lengths

NUM_SEQUENCES = 1000
MAX_LEN = 4096
BLOCK_SIZE = 16


@dataclass(frozen=True)
class SimResult:
    """One simulated run. Token counts are totals over all sequences."""

    seed: int
    num_sequences: int
    used_tokens: int  # tokens the sequences actually hold
    reserved_tokens: int  # slots held by contiguous max-length reservation
    paged_tokens: int  # slots held by block paging (whole blocks)
    reserve_waste: float  # 1 - used / reserved
    paged_waste: float  # 1 - used / paged
    concurrency_gain: float  # reserved / paged: times more sequences in the same memory


def simulate(seed: int, num_sequences: int = NUM_SEQUENCES, max_len: int = MAX_LEN,
             block_size: int = BLOCK_SIZE) -> SimResult:
    """Simulate one set of sequences; the same arguments always give the same result."""
    lengths = sample_lengths(num_sequences, random.Random(seed), max_len)
    used = sum(lengths)
    reserved = num_sequences * max_len
    paged = sum(math.ceil(n / block_size) * block_size for n in lengths)
    return SimResult(seed=seed, num_sequences=num_sequences, used_tokens=used,
                     reserved_tokens=reserved, paged_tokens=paged,
                     reserve_waste=1 - used / reserved, paged_waste=1 - used / paged,
                     concurrency_gain=reserved / paged)


def spread(values: list[float]) -> dict[str, float]:
    """Mean, sample standard deviation, min and max of `values`."""
    return {"mean": statistics.fmean(values),
            "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values), "max": max(values)}


def simulate_many(seeds: list[int], **kwargs) -> dict:
    """Run `simulate` for every seed; return the runs and the spread of each measure."""
    runs = [simulate(s, **kwargs) for s in seeds]
    summary = {key: spread([getattr(r, key) for r in runs])
               for key in ("reserve_waste", "paged_waste", "concurrency_gain")}
    return {"runs": [asdict(r) for r in runs], "summary": summary}


def format_table(report: dict) -> str:
    s = report["summary"]
    params = report["params"]
    lines = [
        f"KV waste: {params['num_sequences']} sequences, max length {params['max_len']}, "
        f"blocks of {params['block_size']}, seeds {params['seeds'][0]}..{params['seeds'][-1]} "
        f"({len(params['seeds'])} runs)",
        f"{'measure':<28}{'mean':>10}{'std':>10}{'min':>10}{'max':>10}",
    ]
    for key, label, pct in (("reserve_waste", "reserve (contiguous) waste", True),
                            ("paged_waste", "paged (tail block) waste", True),
                            ("concurrency_gain", "sequences fit, paged/reserve", False)):
        v = s[key]
        fmt = (lambda x: f"{100 * x:.2f}%") if pct else (lambda x: f"{x:.2f}x")
        lines.append(f"{label:<28}" + "".join(f"{fmt(v[k]):>10}" for k in ("mean", "std", "min", "max")))
    return "\n".join(lines)


def plot(report: dict, path: str | Path) -> None:
    """Bar plot: waste (left) and relative concurrency (right), reserve vs paged, +/- 1 std."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = report["summary"]
    colors = ("#c0504d", "#4f81bd")
    fig, (ax_waste, ax_conc) = plt.subplots(1, 2, figsize=(9, 4))
    waste = [100 * s["reserve_waste"]["mean"], 100 * s["paged_waste"]["mean"]]
    waste_err = [100 * s["reserve_waste"]["std"], 100 * s["paged_waste"]["std"]]
    bars = ax_waste.bar(["reserve", "paged"], waste, yerr=waste_err, color=colors, capsize=4)
    ax_waste.bar_label(bars, labels=[f"{w:.1f}%" for w in waste], padding=8)
    ax_waste.set_ylabel("KV slots held but unused (%)")
    ax_waste.set_ylim(0, 100)
    ax_waste.set_title("KV memory waste")
    gain = s["concurrency_gain"]
    bars = ax_conc.bar(["reserve", "paged"], [1.0, gain["mean"]], yerr=[0.0, gain["std"]],
                       color=colors, capsize=4)
    ax_conc.bar_label(bars, labels=["1.0x", f"{gain['mean']:.1f}x"], padding=8)
    ax_conc.set_ylim(0, 1.2 * (gain["mean"] + gain["std"]))
    ax_conc.set_ylabel("sequences that fit (relative to reserve)")
    ax_conc.set_title("Concurrency in the same memory")
    p = report["params"]
    fig.suptitle(f"{p['num_sequences']} skewed sequences, max len {p['max_len']}, "
                 f"block {p['block_size']}, {len(p['seeds'])} seeds (error bars: 1 std)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def cmd_simulate(args: argparse.Namespace) -> int:
    seeds = list(range(args.seed, args.seed + args.seeds))
    report = simulate_many(seeds, num_sequences=args.num_sequences, max_len=args.max_len,
                           block_size=args.block_size)
    report["params"] = {"num_sequences": args.num_sequences, "max_len": args.max_len,
                        "block_size": args.block_size, "seeds": seeds}
    print(format_table(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    if args.plot:
        plot(report, args.plot)
        print(f"wrote {args.plot}")
    return 0


def cmd_engine(args: argparse.Namespace) -> int:
    import torch

    from engine.loop.engine_args import EngineArgs

    block_blocks = -(-args.max_model_len // args.block_size)
    num_blocks = args.num_kv_blocks or args.reserve_seqs * block_blocks
    engine_args = EngineArgs(model=args.model, load_format=args.load_format, device="cpu",
                             max_model_len=args.max_model_len, block_size=args.block_size,
                             num_gpu_blocks_override=num_blocks, max_num_seqs=args.max_num_seqs,
                             enable_prefix_caching=False, swap_space=args.swap_space, seed=args.seed)
    lengths = sample_lengths(args.num_requests, random.Random(args.seed), args.max_model_len)
    load_start = os.getloadavg()
    max_tokens = None if args.max_tokens == 0 else args.max_tokens
    report = run_engine_comparison(engine_args, lengths, max_tokens, args.seed, args.output_fraction)
    outputs = [n for _, n in engine_workload(lengths, max_tokens, 2, args.seed, args.output_fraction)]
    model_config = engine_args.create_engine_config().model
    report["params"] = {
        "model": args.model, "model_name": model_config.served_model_name, "load_format": args.load_format,
        "max_model_len": args.max_model_len, "block_size": args.block_size, "num_kv_blocks": num_blocks,
        "num_requests": args.num_requests, "max_tokens": max_tokens,
        "output_fraction": args.output_fraction, "mean_output_tokens": statistics.fmean(outputs),
        "seed": args.seed,
        "max_num_seqs": args.max_num_seqs, "swap_space_gib": args.swap_space, "mean_length": statistics.fmean(lengths),
        "lengths": lengths, "torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
        "loadavg_start": load_start, "loadavg_end": os.getloadavg(),
    }
    print(format_engine_table(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    if args.plot:
        plot_engine(report, args.plot)
        print(f"wrote {args.plot}")
    return 0


def cmd_window(args: argparse.Namespace) -> int:
    shape = WindowShape(args.layers, args.window, args.pattern, args.kv_heads, args.head_size, args.dtype_bytes)
    report = run_window_comparison(shape, args.context, int(args.pool_gib * 2**30), args.block_size,
                                   args.num_requests, args.decode, args.budget)
    print(format_window_table(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command")
    sim = sub.add_parser("simulate", help="part (a): the seeded simulation (default)")
    sim.add_argument("--num-sequences", type=int, default=NUM_SEQUENCES)
    sim.add_argument("--max-len", type=int, default=MAX_LEN)
    sim.add_argument("--block-size", type=int, default=BLOCK_SIZE)
    sim.add_argument("--seed", type=int, default=0, help="first seed")
    sim.add_argument("--seeds", type=int, default=20, help="number of seeds (runs)")
    sim.add_argument("--json", metavar="PATH", help="write runs and summary as JSON")
    sim.add_argument("--plot", metavar="PATH", help="write a PNG bar plot")
    sim.set_defaults(func=cmd_simulate)
    eng = sub.add_parser("engine", help="part (b): the real engine, reserve vs paged")
    eng.add_argument("--model", default=None,
                     help="default: the default model; with --load-format dummy a configs/models name")
    eng.add_argument("--load-format", default="auto", choices=("auto", "dummy"))
    eng.add_argument("--max-model-len", type=int, default=ENGINE_MAX_MODEL_LEN)
    eng.add_argument("--block-size", type=int, default=BLOCK_SIZE)
    eng.add_argument("--reserve-seqs", type=int, default=ENGINE_RESERVE_SEQS,
                     help="KV budget: blocks for this many max_model_len sequences")
    eng.add_argument("--num-kv-blocks", type=int, help="KV budget in blocks (overrides --reserve-seqs)")
    eng.add_argument("--num-requests", type=int, default=ENGINE_NUM_REQUESTS)
    eng.add_argument("--max-tokens", type=int, default=ENGINE_MAX_TOKENS,
                     help="output tokens per sequence (a cap with --output-fraction; 0: no cap)")
    eng.add_argument("--output-fraction", type=float,
                     help="each sequence generates this share of its length (decode-heavy runs)")
    eng.add_argument("--max-num-seqs", type=int, default=256,
                     help="high, so that KV memory, not this cap, limits concurrency")
    eng.add_argument("--swap-space", type=float, default=0.25,
                     help="GiB of CPU swap for paged preemption (allocated at start-up)")
    eng.add_argument("--seed", type=int, default=0)
    eng.add_argument("--json", metavar="PATH")
    eng.add_argument("--plot", metavar="PATH")
    eng.set_defaults(func=cmd_engine)
    win = sub.add_parser("window", help="part (c): sliding-window blocks given back vs kept (Gemma-3 shape)")
    default = WindowShape()
    win.add_argument("--layers", type=int, default=default.layers)
    win.add_argument("--window", type=int, default=default.window)
    win.add_argument("--pattern", type=int, default=default.pattern, help="one full layer in this many")
    win.add_argument("--kv-heads", type=int, default=default.kv_heads)
    win.add_argument("--head-size", type=int, default=default.head_size)
    win.add_argument("--dtype-bytes", type=int, default=default.dtype_bytes)
    win.add_argument("--context", type=int, default=8192)
    win.add_argument("--pool-gib", type=float, default=2.0, help="KV pool bytes, the same for both modes")
    win.add_argument("--block-size", type=int, default=BLOCK_SIZE)
    win.add_argument("--num-requests", type=int, default=64, help="the scheduler run's requests")
    win.add_argument("--decode", type=int, default=1024, help="their output tokens (prompt: context - decode)")
    win.add_argument("--budget", type=int, default=2048, help="the scheduler run's max_num_batched_tokens")
    win.add_argument("--json", metavar="PATH")
    win.set_defaults(func=cmd_window)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
        argv.insert(0, "simulate")  # simulate is the default subcommand
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
