"""Part (b) of benchmarks/kv_waste.py: KV waste on the real engine.

One workload (skewed lengths scaled to max_model_len, prompts of random token ids, greedy with
ignore_eos so each sequence reaches exactly its length, all requests at once) runs through a
fresh offline engine twice under the same number of KV blocks: `kv_allocation="reserve"`
(max_model_len tokens of blocks per sequence at admission, the pre-paging baseline) and
`"paged"` (blocks on demand). `python -m benchmarks.kv_waste engine` is the command line.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

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
        from engine.core.sequence import SequenceStatus

        bm = self.engine.block_manager
        running = 0
        for group in self.engine.scheduler.running:
            final = len(group.prompt_token_ids) + group.params.max_tokens - 1  # the last token is never fed back
            for seq in group.seqs_with_status(SequenceStatus.RUNNING):
                held = bm.num_slots(seq)
                running += 1
                self.held += held
                self.never_written += held - min(held, final)
                self.unwritten += held - min(held, len(seq))  # this step writes up to len(seq)
        self.steps += 1
        self.running.append(running)
        usage = bm.usage()
        self.used_blocks.append(usage.num_device_blocks - usage.num_free_device_blocks)


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

    from engine.core.sampling_params import SamplingParams
    from engine.loop.llm_engine import LLMEngine

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
        num_kv_blocks=bm.usage().num_device_blocks,
        block_size=bm.block_size,
        num_requests=len(work),
        num_steps=sampler.steps,
        peak_running_seqs=max(sampler.running),
        mean_running_seqs=statistics.fmean(sampler.running),
        time_avg_waste=sampler.never_written / sampler.held,
        time_avg_unwritten=sampler.unwritten / sampler.held,
        peak_kv_usage=max(sampler.used_blocks) / bm.usage().num_device_blocks,
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


