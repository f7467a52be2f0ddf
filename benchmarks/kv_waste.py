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
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script: python benchmarks/kv_waste.py
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

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


# ---------------------------------------------------------------------------------------------
# Part (b): the real engine
# ---------------------------------------------------------------------------------------------

ENGINE_MAX_MODEL_LEN = 1024
ENGINE_NUM_REQUESTS = 64
ENGINE_MAX_TOKENS = 8
ENGINE_RESERVE_SEQS = 4  # the KV budget, in max_model_len-sized sequences


@dataclass
class EngineWasteResult:
    """What part (b) reports for one `kv_allocation` mode under one workload and KV budget.

    Waste sums over engine steps, each step sampled right after scheduling (the blocks the step
    runs with): "never written" counts slots held that the sequence will never fill (its final
    length is known: ignore_eos and a fixed max_tokens), as the simulation does; "not yet
    written" counts slots still empty once this step has written its tokens (what the engine's
    kv_internal_fragmentation gauge shows), so it also counts slots reserved for tokens that
    later steps will write.
    """

    kv_allocation: str  # "reserve" or "paged"
    num_kv_blocks: int  # the same budget for both modes
    block_size: int
    num_requests: int
    num_steps: int
    peak_running_seqs: int  # most sequences holding device blocks in one step
    mean_running_seqs: float  # averaged over steps
    time_avg_waste: float  # slots held but never written / slots held, over all steps
    time_avg_unwritten: float  # slots held but not yet written / slots held, over all steps
    peak_kv_usage: float  # most device blocks in use in one step / all device blocks
    num_preemptions: int
    wall_s: float
    request_throughput: float  # requests/s
    output_throughput: float  # output tokens/s
    total_token_throughput: float  # (prompt + output) tokens/s
    latency_ms: dict[str, dict[str, float]]  # ttft / tpot / e2e -> mean, p50, p90, p99


def engine_workload(lengths: list[int], max_tokens: int | None, vocab_size: int, seed: int,
                    output_fraction: float | None = None) -> list[tuple[list[int], int]]:
    """(prompt token ids, output tokens) per sequence, so that prompt + output == its length.

    Each sequence generates `max_tokens` tokens, or with `output_fraction` that share of its
    length (capped by `max_tokens` unless None); always at least one, and at least one prompt
    token stays. Random token ids (seeded): no tokenizer is needed, so dummy weights work too.
    """
    if max_tokens is None and output_fraction is None:
        raise ValueError("give max_tokens, output_fraction or both")
    rng = random.Random(seed)
    out = []
    for n in lengths:
        n_out = round(output_fraction * n) if output_fraction is not None else max_tokens
        if max_tokens is not None:
            n_out = min(n_out, max_tokens)
        n_out = max(1, min(n_out, n - 1))
        out.append(([rng.randrange(vocab_size) for _ in range(n - n_out)], n_out))
    return out


class _KVSampler:
    """Per-step KV accounting from the block manager's tables and the sequences' lengths."""

    def __init__(self, engine):
        self.engine = engine
        self.steps = self.held = self.never_written = self.unwritten = 0
        self.running: list[int] = []
        self.used_blocks: list[int] = []

    def sample(self) -> None:
        from engine.sequence import SequenceStatus

        bm = self.engine.block_manager
        running = 0
        for group in self.engine.scheduler.running:
            final = len(group.prompt_token_ids) + group.max_tokens - 1  # the last token is never fed back
            for seq in group.seqs_with_status(SequenceStatus.RUNNING):
                held = len(bm.tables.get(seq.seq_id, ())) * bm.block_size
                running += 1
                self.held += held
                self.never_written += held - min(held, final)
                self.unwritten += held - min(held, len(seq))  # this step writes up to len(seq)
        self.steps += 1
        self.running.append(running)
        self.used_blocks.append(bm.device.num_blocks - bm.device.num_free)


def _latency_summary(values_s: list[float]) -> dict[str, float]:
    from benchmarks.serve import percentile

    ms = [1000 * v for v in values_s]
    return {"mean": statistics.fmean(ms) if ms else math.nan,
            **{f"p{q}": percentile(ms, q) for q in (50, 90, 99)}}


def measure_engine(args, kv_allocation: str, lengths: list[int], max_tokens: int | None = ENGINE_MAX_TOKENS,
                   seed: int = 0, output_fraction: float | None = None) -> EngineWasteResult:
    """Run `lengths` (total tokens per sequence) through a fresh offline engine built from
    `args` (an EngineArgs) with `kv_allocation`, all requests arriving at once, greedy with
    ignore_eos so every sequence reaches exactly its length. Give the same `args` (in
    particular `num_gpu_blocks_override`) to both modes to compare them under the same KV memory.
    """
    from dataclasses import replace

    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    engine = LLMEngine.from_engine_args(replace(args, kv_allocation=kv_allocation))
    bm = engine.block_manager
    work = engine_workload(lengths, max_tokens, engine.model_config.hf_config.vocab_size, seed,
                           output_fraction)
    sampler = _KVSampler(engine)
    schedule = engine.scheduler.schedule

    def schedule_and_sample():
        # NOTE: sampled between scheduling and the forward pass, so each step is measured with
        # exactly the blocks it runs with (after step(), finished sequences are already freed).
        out = schedule()
        sampler.sample()
        return out

    engine.scheduler.schedule = schedule_and_sample
    t0 = time.monotonic()
    for i, (prompt, n_out) in enumerate(work):
        engine.add_request(f"kv-{i}", prompt, SamplingParams(temperature=0.0, ignore_eos=True,
                                                             max_tokens=n_out), arrival_time=t0)
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    wall = time.monotonic() - t0
    bm.check_integrity()
    assert bm.all_free(), "blocks leaked after every request finished"
    if len(finished) != len(work) or any(o.error for o in finished):
        raise RuntimeError(f"{kv_allocation}: {len(finished)}/{len(work)} requests finished cleanly")

    n_prompt = sum(len(p) for p, _ in work)
    n_output = sum(len(o.outputs[0].token_ids) for o in finished)
    metrics = [o.metrics for o in finished]
    tpots = [(m.e2e_latency - m.time_to_first_token) / (m.num_generation_tokens - 1)
             for m in metrics if m.num_generation_tokens > 1]
    return EngineWasteResult(
        kv_allocation=kv_allocation,
        num_kv_blocks=bm.device.num_blocks,
        block_size=bm.block_size,
        num_requests=len(work),
        num_steps=sampler.steps,
        peak_running_seqs=max(sampler.running),
        mean_running_seqs=statistics.fmean(sampler.running),
        time_avg_waste=sampler.never_written / sampler.held,
        time_avg_unwritten=sampler.unwritten / sampler.held,
        peak_kv_usage=max(sampler.used_blocks) / bm.device.num_blocks,
        num_preemptions=sum(engine.scheduler.num_preemptions.values()),
        wall_s=wall,
        request_throughput=len(work) / wall,
        output_throughput=n_output / wall,
        total_token_throughput=(n_prompt + n_output) / wall,
        latency_ms={"ttft": _latency_summary([m.time_to_first_token for m in metrics]),
                    "tpot": _latency_summary(tpots),
                    "e2e": _latency_summary([m.e2e_latency for m in metrics])},
    )


def run_engine_comparison(args, lengths: list[int], max_tokens: int | None, seed: int = 0,
                          output_fraction: float | None = None) -> dict:
    """Both modes on the same workload and the same EngineArgs (so the same KV blocks)."""
    results = [measure_engine(args, mode, lengths, max_tokens, seed, output_fraction)
               for mode in ("reserve", "paged")]
    return {"results": [asdict(r) for r in results]}


def format_engine_table(report: dict) -> str:
    p = report["params"]
    rows = {r["kv_allocation"]: r for r in report["results"]}
    lines = [
        f"KV waste on the engine: {p['model_name']} ({p['load_format']}), {p['num_requests']} requests "
        f"all at once, skewed lengths scaled to max_model_len {p['max_model_len']} (mean "
        f"{p['mean_length']:.0f} tokens, of which {p['mean_output_tokens']:.0f} generated: "
        f"{_output_rule(p)}), {p['num_kv_blocks']} KV blocks "
        f"of {p['block_size']} tokens (= {p['num_kv_blocks'] * p['block_size'] // p['max_model_len']} "
        f"max-length sequences), OMP/torch threads {p['torch_threads']}",
        f"{'measure':<34}{'reserve':>12}{'paged':>12}",
    ]

    def row(label, fmt, get):
        lines.append(f"{label:<34}" + "".join(f"{fmt(get(rows[m])):>12}" for m in ("reserve", "paged")))

    pct = lambda x: f"{100 * x:.1f}%"  # noqa: E731
    row("KV waste, never written (avg)", pct, lambda r: r["time_avg_waste"])
    row("KV waste, not yet written (avg)", pct, lambda r: r["time_avg_unwritten"])
    row("peak concurrent sequences", str, lambda r: r["peak_running_seqs"])
    row("mean concurrent sequences", lambda x: f"{x:.1f}", lambda r: r["mean_running_seqs"])
    row("peak KV blocks in use", pct, lambda r: r["peak_kv_usage"])
    row("engine steps", str, lambda r: r["num_steps"])
    row("preemptions", str, lambda r: r["num_preemptions"])
    row("wall time (s)", lambda x: f"{x:.1f}", lambda r: r["wall_s"])
    row("requests/s", lambda x: f"{x:.2f}", lambda r: r["request_throughput"])
    row("output tokens/s", lambda x: f"{x:.1f}", lambda r: r["output_throughput"])
    row("total tokens/s", lambda x: f"{x:.0f}", lambda r: r["total_token_throughput"])
    for key in ("ttft", "e2e"):
        for q in ("mean", "p50", "p90", "p99"):
            row(f"{key.upper()} {q} (ms)", lambda x: f"{x:.0f}", lambda r, k=key, q=q: r["latency_ms"][k][q])
    row("TPOT mean (ms)", lambda x: f"{x:.0f}", lambda r: r["latency_ms"]["tpot"]["mean"])
    return "\n".join(lines)


def _output_rule(p: dict) -> str:
    if p.get("output_fraction") is None:
        return f"max_tokens {p['max_tokens']}"
    cap = "" if p["max_tokens"] is None else f", at most {p['max_tokens']}"
    return f"{100 * p['output_fraction']:.0f}% of each length{cap}"


def plot_engine(report: dict, path: str | Path) -> None:
    """Bars, reserve vs paged: waste, peak concurrent sequences, and throughput."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = {r["kv_allocation"]: r for r in report["results"]}
    modes, colors = ("reserve", "paged"), ("#c0504d", "#4f81bd")
    fig, (ax_waste, ax_conc, ax_tput) = plt.subplots(1, 3, figsize=(12, 4))
    for ax, (ylabel, title, get, fmt) in (
        (ax_waste, ("KV slots held, never written (%)", "KV memory waste (avg over steps)",
                    lambda r: 100 * r["time_avg_waste"], "{:.1f}%")),
        (ax_tput, ("requests/s", "Request throughput", lambda r: r["request_throughput"], "{:.2f}")),
    ):
        values = [get(rows[m]) for m in modes]
        bars = ax.bar(modes, values, color=colors)
        ax.bar_label(bars, labels=[fmt.format(v) for v in values], padding=3)
        ax.set_ylim(0, 1.2 * max(values) if max(values) > 0 else 1)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
    # concurrency: peak (solid) and mean over steps (hatched) side by side for each mode
    x = range(len(modes))
    peak = [rows[m]["peak_running_seqs"] for m in modes]
    mean = [rows[m]["mean_running_seqs"] for m in modes]
    bars = ax_conc.bar([i - 0.2 for i in x], peak, 0.4, color=colors, label="peak")
    ax_conc.bar_label(bars, labels=[str(v) for v in peak], padding=3)
    bars = ax_conc.bar([i + 0.2 for i in x], mean, 0.4, color=colors, alpha=0.5, hatch="//", label="mean")
    ax_conc.bar_label(bars, labels=[f"{v:.1f}" for v in mean], padding=3)
    ax_conc.set_xticks(list(x), modes)
    ax_conc.set_ylim(0, 1.2 * max(peak))
    ax_conc.set_ylabel("sequences")
    ax_conc.set_title("Concurrent sequences (peak | mean)")
    p = report["params"]
    fig.suptitle(f"Engine, same KV memory ({p['num_kv_blocks']} blocks of {p['block_size']}): "
                 f"{p['num_requests']} skewed requests, max_model_len {p['max_model_len']}, "
                 f"{p['model_name']}")
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

    from engine.config import EngineArgs

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
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
        argv.insert(0, "simulate")  # simulate is the default subcommand
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
