"""GET /health latency under load, and output tokens/s at several concurrency levels.

    python benchmarks/health_latency.py --start -- --max-model-len 2048 --kv-cache-memory 512MiB
    python benchmarks/health_latency.py --url http://127.0.0.1:8000

Two measurements against one server:
1. Health under load: `--streams` (64) streaming completions run at once while a separate
   thread polls GET /health every `--health-interval` seconds; reports p50 / p99 / max.
2. Throughput: for each concurrency in `--concurrency` (1 8 32 64), that many clients each
   send streaming completions back to back (ignore_eos, `--max-tokens` each) for `--duration`
   seconds; reports output tokens/s (completion tokens from the usage chunk / wall time).
The health poller runs in its own process (a thread would share the load generator's GIL).

`--start` launches `python -m server` on a free loopback port with the flags after `--`.
Results print as a table and, with `--json FILE`, as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import sys
import time
from pathlib import Path

import httpx

if __package__ in (None, ""):  # run as a script: python benchmarks/health_latency.py
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.server_proc import server_for, split_server_flags
from benchmarks.workload import SHORT_PROMPTS

PROMPTS = SHORT_PROMPTS


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    k = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]


def served_model(url: str) -> str:
    return httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]


async def one_stream(client: httpx.AsyncClient, model: str, i: int, max_tokens: int) -> int:
    body = {"model": model, "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "temperature": 0.8, "seed": i,
            "stream_options": {"include_usage": True}}
    tokens = 0
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
    return tokens


def poll_health(url: str, stop, interval: float, conn) -> None:
    """Runs in its own process, so the load generator's own work does not inflate the figures."""
    out = []
    with httpx.Client(base_url=url, timeout=30) as client:
        while not stop.is_set():
            t0 = time.perf_counter()
            resp = client.get("/health")
            out.append(time.perf_counter() - t0)
            assert resp.status_code == 200, resp.text
            time.sleep(interval)
    conn.send(out)


async def health_under_load(url: str, model: str, streams: int, max_tokens: int, interval: float) -> dict:
    stop = multiprocessing.Event()
    receiver, sender = multiprocessing.Pipe(duplex=False)
    poller = multiprocessing.Process(target=poll_health, args=(url, stop, interval, sender), daemon=True)
    limits = httpx.Limits(max_connections=streams + 4, max_keepalive_connections=streams + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        poller.start()
        t0 = time.perf_counter()
        tokens = await asyncio.gather(*[one_stream(client, model, i, max_tokens) for i in range(streams)])
        wall = time.perf_counter() - t0
    stop.set()
    latencies = receiver.recv()
    poller.join()
    return {"streams": streams, "samples": len(latencies), "p50_ms": 1000 * percentile(latencies, 50),
            "p99_ms": 1000 * percentile(latencies, 99), "max_ms": 1000 * max(latencies, default=float("nan")),
            "output_tokens": sum(tokens), "wall_s": wall}


async def throughput(url: str, model: str, concurrency: int, max_tokens: int, duration: float) -> dict:
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        deadline = time.perf_counter() + duration
        counts = [0] * concurrency

        async def worker(w: int) -> int:
            total, i = 0, w
            while time.perf_counter() < deadline:
                total += await one_stream(client, model, i, max_tokens)
                counts[w] += 1
                i += concurrency
            return total

        t0 = time.perf_counter()
        totals = await asyncio.gather(*[worker(w) for w in range(concurrency)])
        wall = time.perf_counter() - t0
    return {"concurrency": concurrency, "requests": sum(counts), "output_tokens": sum(totals),
            "wall_s": wall, "output_tokens_per_s": sum(totals) / wall}


def main() -> None:
    argv, server_flags = split_server_flags(sys.argv[1:])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default=None, help="a running server (default: --start one)")
    p.add_argument("--start", action="store_true", help="start `python -m server` with the flags after --")
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--health-interval", type=float, default=0.05)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--duration", type=float, default=20.0, help="seconds per concurrency level")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)

    with server_for(args.url, args.start, server_flags) as (url, _):
        model = served_model(url)
        health = asyncio.run(health_under_load(url, model, args.streams, args.max_tokens, args.health_interval))
        print(f"GET /health while {health['streams']} streams run: p50 {health['p50_ms']:.1f} ms, "
              f"p99 {health['p99_ms']:.1f} ms, max {health['max_ms']:.1f} ms ({health['samples']} samples; "
              f"{health['output_tokens']} tokens in {health['wall_s']:.1f} s)", flush=True)
        levels = []
        for c in args.concurrency:
            r = asyncio.run(throughput(url, model, c, args.max_tokens, args.duration))
            levels.append(r)
            print(f"concurrency {c:3d}: {r['output_tokens_per_s']:8.1f} output tokens/s "
                  f"({r['requests']} requests, {r['output_tokens']} tokens, {r['wall_s']:.1f} s)", flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps({"health": health, "throughput": levels}, indent=2))


if __name__ == "__main__":
    main()
