"""What benchmarks/serve.py measures: one request's result, the percentiles and throughputs over a
run (as vLLM's benchmark_serving defines them; see benchmarks/serve.py), and the report table."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

PERCENTILES = (50, 90, 99)


@dataclass
class Prompt:
    text: str
    num_tokens: int  # as counted by the server, or estimated from words


@dataclass
class RequestResult:
    """One request's outcome; times are seconds from time.perf_counter()."""

    ok: bool
    prompt_tokens: int
    start: float = 0.0  # when the request was sent
    chunk_times: list[float] = field(default_factory=list)  # arrival of each non-empty chunk
    output_tokens: int = 0  # usage.completion_tokens if reported, else number of chunks
    error: str = ""

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.start

    @property
    def latency(self) -> float:
        return self.chunk_times[-1] - self.start


# ---------------------------------------------------------------------------------------------
# Metrics
# ---------------------------------------------------------------------------------------------

def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation, as numpy's default."""
    if not values:
        return math.nan
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarize_ms(values_s: list[float]) -> dict[str, float | None]:
    """Mean and percentiles of durations given in seconds, in milliseconds (None if empty)."""
    ms = [1000 * v for v in values_s]
    if not ms:
        return {"mean": None, **{f"p{q}": None for q in PERCENTILES}}
    return {"mean": statistics.fmean(ms), **{f"p{q}": percentile(ms, q) for q in PERCENTILES}}


def compute_metrics(results: list[RequestResult], duration_s: float) -> dict:
    """Aggregate per-request results of one run that took `duration_s` seconds of wall time.

    A request counts as completed when it succeeded and streamed at least one chunk.
    """
    done = [r for r in results if r.ok and r.chunk_times]
    ttfts = [r.ttft for r in done]
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    itls = [b - a for r in done for a, b in zip(r.chunk_times, r.chunk_times[1:])]
    out_tokens = sum(r.output_tokens for r in done)
    in_tokens = sum(r.prompt_tokens for r in done)
    errors = [r.error for r in results if not (r.ok and r.chunk_times)]
    per_s = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: None)
    return {
        "num_requests": len(results),
        "completed": len(done),
        "failed": len(errors),
        "errors": sorted(set(errors))[:5],
        "duration_s": duration_s,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": per_s(len(done)),
        "output_throughput": per_s(out_tokens),
        "total_token_throughput": per_s(in_tokens + out_tokens),
        "ttft_ms": summarize_ms(ttfts),
        "tpot_ms": summarize_ms(tpots),
        "itl_ms": summarize_ms(itls),
        "e2e_ms": summarize_ms([r.latency for r in done]),
    }


# ---------------------------------------------------------------------------------------------
# Talking to the server
# ---------------------------------------------------------------------------------------------


def format_table(report: dict) -> str:
    cols = (("rate", 6), ("ok", 10), ("req/s", 8), ("out tok/s", 11), ("TTFT p50", 10),
            ("TTFT p99", 10), ("TPOT p50", 10), ("ITL p50", 9), ("ITL p99", 9), ("E2E p50", 10),
            ("E2E p99", 10))
    lines = [f"{report['label']}: {report['num_prompts']} prompts "
             f"(mean {report['prompt_tokens']['mean']:.0f} tokens, {report['token_counting']}), "
             f"max_tokens {report['max_tokens']}, ignore_eos {report['ignore_eos_sent']}; "
             "latencies in ms",
             "".join(f"{name:>{w}}" for name, w in cols)]

    def num(x: float | None, digits: int = 1) -> str:
        return "-" if x is None else f"{x:.{digits}f}"

    for p in report["points"]:
        rate = p["request_rate"]
        row = (rate if rate == "inf" else f"{rate:g}", f"{p['completed']}/{p['num_requests']}",
               num(p["request_throughput"], 2), num(p["output_throughput"]),
               num(p["ttft_ms"]["p50"]), num(p["ttft_ms"]["p99"]), num(p["tpot_ms"]["p50"]),
               num(p["itl_ms"]["p50"]), num(p["itl_ms"]["p99"]), num(p["e2e_ms"]["p50"]),
               num(p["e2e_ms"]["p99"]))
        lines.append("".join(f"{v:>{w}}" for v, (_, w) in zip(row, cols)))
        for err in p["errors"]:
            lines.append(f"    error: {err}")
    return "\n".join(lines)
