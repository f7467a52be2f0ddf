"""Plot serve.py results: throughput and latency against request rate, one line per JSON file.

    python -m benchmarks.plot_serve paged.json hf.json --out serve.png

Each file is one server's sweep (serve.py --request-rates ... --json); its `label` names the
line unless --labels gives names. Rates are placed evenly, "inf" last, so a sweep like
1,2,4,8,inf reads left to right.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

PANELS = (  # (title, y label, metric key, sub-key or None)
    ("Output throughput", "tokens/s", "output_throughput", None),
    ("Request throughput", "requests/s", "request_throughput", None),
    ("Time to first token (p50, p99 dashed)", "ms", "ttft_ms", "p50"),
    ("Time per output token (p50, p99 dashed)", "ms", "tpot_ms", "p50"),
    ("Inter-token latency (p50, p99 dashed)", "ms", "itl_ms", "p50"),
    ("End-to-end latency (p50, p99 dashed)", "ms", "e2e_ms", "p50"),
)


def rate_key(rate) -> float:
    return math.inf if rate == "inf" else float(rate)


def rate_label(rate) -> str:
    r = rate_key(rate)
    return "inf" if math.isinf(r) else f"{r:g}"


def value(x) -> float:
    return math.nan if x is None else x  # None: no data at this rate (e.g. all failed)


def load(paths: list[str], labels: list[str] | None) -> list[dict]:
    reports = [json.loads(Path(p).read_text()) for p in paths]
    if labels:
        if len(labels) != len(reports):
            raise SystemExit("--labels needs one name per JSON file")
        for report, label in zip(reports, labels):
            report["label"] = label
    return reports


def plot(reports: list[dict], path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = sorted({rate_key(p["request_rate"]) for r in reports for p in r["points"]})
    position = {rate: i for i, rate in enumerate(rates)}
    fig, axes = plt.subplots(2, 3, figsize=(14, 7.5))
    for ax, (title, ylabel, key, sub) in zip(axes.flat, PANELS):
        for i, report in enumerate(reports):
            color = f"C{i}"
            points = sorted(report["points"], key=lambda p: rate_key(p["request_rate"]))
            xs = [position[rate_key(p["request_rate"])] for p in points]
            if sub is None:
                ax.plot(xs, [value(p[key]) for p in points], "o-", color=color, label=report["label"])
            else:
                ax.plot(xs, [value(p[key][sub]) for p in points], "o-", color=color,
                        label=report["label"])
                ax.plot(xs, [value(p[key]["p99"]) for p in points], "x--", color=color, alpha=0.6)
        ax.set_title(title, fontsize=10)
        ax.set_ylabel(ylabel)
        ax.set_xlabel("request rate (req/s)")
        ax.set_xticks(range(len(rates)), [rate_label(r) for r in rates])
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    first = reports[0]
    fig.suptitle(f"{first['num_prompts']} prompts, max_tokens {first['max_tokens']}, "
                 f"context {first['max_model_len']}; ignore_eos sent: "
                 + ", ".join(f"{r['label']} {r['ignore_eos_sent']}" for r in reports))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", help="serve.py JSON reports")
    parser.add_argument("--labels", help="comma-separated line names, one per file")
    parser.add_argument("--out", required=True, metavar="PATH", help="PNG to write")
    args = parser.parse_args(argv)
    reports = load(args.results, args.labels.split(",") if args.labels else None)
    plot(reports, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
