"""Prefix-cache hits and TTFT behind a router: cache-aware routing against round robin.

For each routing policy, starts N fresh paged-serve replicas on loopback and the SGLang model
gateway (`sglang-router`, an existing router; install it in a virtualenv of its own and pass
--router-cmd) in front of them with that policy, then runs a multi-turn chat workload through
the router: C conversations of T turns, each turn resending the whole conversation so far (the
history, the model's answers included) plus a new user message. Conversations run concurrently
(at most --concurrency at once); the turns of one conversation run one after the other.

Reported per policy:
- prefix-cache hit rate: prompt tokens found in the replicas' prefix caches over prompt tokens
  looked up, from the difference of each replica's /metrics counters
  (paged_serve:prefix_cache_hits_total / _queries_total) before and after the workload;
- TTFT p50 / p90 (client side: request sent to the first content token), over every turn and
  over turns 2.. (the ones a cache can serve);
- the workload's bound: the hit rate if every turn found its whole history (the previous turn's
  prompt and answer) cached, from the responses' usage: what a perfect router would get;
- how many requests each replica served.

Cache-aware routing sends a conversation's next turn to the replica that holds its history, so
that replica's prefix cache serves it; round robin spreads the turns over the replicas, so most
turns land where the history is not cached. Replicas are started fresh for each policy so that
neither run sees the other's cached prefixes.

    python -m benchmarks.router_prefix --router-cmd /path/to/venv/bin/sglang-router \\
        --replicas 3 --conversations 64 --turns 4 --json results.json \\
        -- --max-model-len 4096 --kv-cache-memory 512MiB
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.server_proc import split_server_flags, start_server, wait_healthy
from benchmarks.serve_metrics import percentile
from benchmarks.workload import TextSource

POLICIES = ("cache_aware", "round_robin")
DEFAULT_REPLICA_FLAGS = ["--max-model-len", "4096", "--kv-cache-memory", "512MiB", "--seed", "0"]
SYSTEM = "You are a helpful assistant. Answer briefly."
COUNTERS = ("paged_serve:prefix_cache_hits_total", "paged_serve:prefix_cache_queries_total",
            "paged_serve:e2e_request_latency_seconds_count")


@dataclass
class Turn:
    conversation: int
    turn: int
    ttft: float | None = None  # seconds to the first content token
    prompt_tokens: int = 0
    cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens
    completion_tokens: int = 0
    error: str | None = None


@dataclass
class PolicyResult:
    policy: str
    hit_rate: float
    prefix_cache_hits: int
    prefix_cache_queries: int
    ttft_ms: dict
    ttft_ms_later_turns: dict
    requests_per_replica: list[int]
    client_cached_fraction: float  # the same hit rate as the responses' usage reports it
    client_cached_fraction_later_turns: float  # the same over turns 2.. only
    # What a router that always finds the history would get: `history_bound`.
    bound: float
    failed: int
    wall_s: float
    errors: list[str] = field(default_factory=list)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(url: str) -> dict[str, float]:
    """COUNTERS of one replica's /metrics, summed over label sets."""
    text = httpx.get(url + "/metrics", timeout=30).text
    totals = dict.fromkeys(COUNTERS, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in totals:
                totals[sample.name] += sample.value
    return totals


def start_router(cmd: list[str], policy: str, workers: list[str], model: str, log_path: Path,
                 timeout: float = 120.0) -> tuple[subprocess.Popen, str]:
    """The router on a free loopback port with `policy`, once it lists `model` (its workers
    registered). Returns (process, base url)."""
    port = free_port()
    args = [*cmd, "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
            "--worker-urls", *workers, "--log-level", "warn"]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(proc, url, timeout, what=f"router ({shlex.join(args)}; log {log_path})")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        listed = httpx.get(url + "/v1/models", timeout=5)
        if listed.status_code == 200 and any(m["id"] == model for m in listed.json().get("data", [])):
            return proc, url
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"the router never listed {model}: see {log_path}")


def conversation_texts(source: TextSource, conversation: int, turns: int, first_words: int,
                       turn_words: int, seed: int) -> list[str]:
    """The user messages of one conversation: a long first one, then shorter follow-ups, each
    cut from its own place in the corpus."""
    rng = random.Random(seed * 1_000_003 + conversation)
    offset = rng.randrange(len(source.words))
    texts = [source.text(offset, first_words)]
    for turn in range(1, turns):
        texts.append(source.text(offset + first_words + turn * turn_words, turn_words))
    return texts


async def chat_turn(client: httpx.AsyncClient, url: str, model: str, messages: list[dict],
                    max_tokens: int, record: Turn) -> str:
    """One streaming chat completion; fills `record` and returns the answer's text."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start, parts = time.perf_counter(), []
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                record.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:200]}"
                return ""
            async for line in resp.aiter_lines():
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data:"):])
                if chunk.get("error"):
                    record.error = str(chunk["error"])[:200]
                    return ""
                for choice in chunk.get("choices") or []:
                    text = (choice.get("delta") or {}).get("content")
                    if text:
                        if record.ttft is None:
                            record.ttft = time.perf_counter() - start
                        parts.append(text)
                usage = chunk.get("usage")
                if usage:
                    record.prompt_tokens = usage["prompt_tokens"]
                    record.completion_tokens = usage.get("completion_tokens", 0)
                    record.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"[:200]
    return "".join(parts)


async def run_workload(url: str, model: str, args: argparse.Namespace) -> list[Turn]:
    """Every conversation, at most args.concurrency at once; returns every turn's record."""
    source = TextSource.builtin(seed=args.seed)
    gate = asyncio.Semaphore(args.concurrency)
    records: list[Turn] = []

    async def conversation(client: httpx.AsyncClient, index: int) -> None:
        texts = conversation_texts(source, index, args.turns, args.first_words, args.turn_words, args.seed)
        messages = [{"role": "system", "content": SYSTEM}]
        async with gate:
            for turn, text in enumerate(texts):
                messages.append({"role": "user", "content": text})
                record = Turn(index, turn)
                records.append(record)
                answer = await chat_turn(client, url, model, messages, args.max_tokens, record)
                if record.error:
                    return
                messages.append({"role": "assistant", "content": answer})

    limits = httpx.Limits(max_connections=args.concurrency + 4)
    async with httpx.AsyncClient(timeout=args.request_timeout, limits=limits) as client:
        await asyncio.gather(*(conversation(client, i) for i in range(args.conversations)))
    return records


def history_bound(records: list[Turn], block_size: int = 16) -> float:
    """The hit rate if every turn found its whole history cached: per later turn, the previous
    turn's prompt and answer in whole blocks (below the new prompt's last token), per first turn
    what it found (the shared system prompt), over all prompt tokens. An upper bound: the
    re-rendered history may tokenize a little differently from the tokens the replica holds."""
    by_turn = {(r.conversation, r.turn): r for r in records}
    hits = total = 0
    for r in records:
        previous = by_turn.get((r.conversation, r.turn - 1))
        if r.turn == 0 or previous is None:
            hits += r.cached_tokens
        else:
            held = min(previous.prompt_tokens + previous.completion_tokens, r.prompt_tokens - 1)
            hits += max(held // block_size * block_size, r.cached_tokens)
        total += r.prompt_tokens
    return hits / total if total else 0.0


def replica_block_size(url: str) -> int:
    """The replica's KV block size, as it reports it to routers (/server_info's page_size)."""
    return int(httpx.get(url + "/server_info", timeout=30).json()["page_size"])


def summarize(values: list[float]) -> dict:
    ms = [1000 * v for v in values]
    return {"p50": percentile(ms, 50), "p90": percentile(ms, 90), "n": len(ms)}


def run_policy(policy: str, args: argparse.Namespace, replica_flags: list[str], workdir: Path) -> PolicyResult:
    """Fresh replicas, the router with `policy`, the workload, the counters' differences."""
    env = {**os.environ, "OMP_NUM_THREADS": str(args.replica_threads)}
    with ExitStack() as stack:
        with ThreadPoolExecutor(args.replicas) as pool:
            started = list(pool.map(lambda _: start_server(replica_flags, env, timeout=args.start_timeout),
                                    range(args.replicas)))
        for proc, _ in started:
            stack.callback(stop, proc)
        urls = [url for _, url in started]
        model = httpx.get(urls[0] + "/v1/models", timeout=30).json()["data"][0]["id"]
        block_size = replica_block_size(urls[0])
        router, router_url = start_router(shlex.split(args.router_cmd) + ["launch"] + shlex.split(args.router_args),
                                          policy, urls, model,
                                          workdir / f"router-{policy}.log")
        stack.callback(stop, router)
        before = [scrape(u) for u in urls]
        start = time.perf_counter()
        records = asyncio.run(run_workload(router_url, model, args))
        wall = time.perf_counter() - start
        after = [scrape(u) for u in urls]

    def delta(name: str) -> list[float]:
        return [a[name] - b[name] for a, b in zip(after, before)]

    hits = sum(delta("paged_serve:prefix_cache_hits_total"))
    queries = sum(delta("paged_serve:prefix_cache_queries_total"))
    ok = [r for r in records if r.error is None and r.ttft is not None]
    prompt = sum(r.prompt_tokens for r in ok)
    later = [r for r in ok if r.turn > 0]
    later_prompt = sum(r.prompt_tokens for r in later)
    return PolicyResult(
        policy=policy, hit_rate=hits / queries if queries else 0.0, prefix_cache_hits=int(hits),
        prefix_cache_queries=int(queries), ttft_ms=summarize([r.ttft for r in ok]),
        ttft_ms_later_turns=summarize([r.ttft for r in ok if r.turn > 0]),
        requests_per_replica=[int(n) for n in delta("paged_serve:e2e_request_latency_seconds_count")],
        client_cached_fraction=sum(r.cached_tokens for r in ok) / prompt if prompt else 0.0,
        client_cached_fraction_later_turns=(sum(r.cached_tokens for r in later) / later_prompt
                                            if later_prompt else 0.0),
        bound=history_bound(ok, block_size),
        failed=len(records) - len(ok) + (args.conversations * args.turns - len(records)),
        wall_s=wall, errors=sorted({r.error for r in records if r.error})[:5])


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def format_results(results: list[PolicyResult]) -> str:
    lines = [f"{'policy':<12} {'hit rate':>8} {'bound':>6} {'hits t2+':>8} {'TTFT p50':>9} {'TTFT p90':>9} {'p50 t2+':>8} "
             f"{'p90 t2+':>8} {'failed':>6}  requests per replica"]
    for r in results:
        lines.append(f"{r.policy:<12} {r.hit_rate:>8.1%} {r.bound:>6.1%} {r.client_cached_fraction_later_turns:>8.1%} "
                     f"{r.ttft_ms['p50']:>7.0f}ms {r.ttft_ms['p90']:>7.0f}ms "
                     f"{r.ttft_ms_later_turns['p50']:>6.0f}ms {r.ttft_ms_later_turns['p90']:>6.0f}ms "
                     f"{r.failed:>6}  {r.requests_per_replica}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="Flags after `--` go to every replica (default: "
                                       + " ".join(DEFAULT_REPLICA_FLAGS) + ").")
    p.add_argument("--router-cmd", default="sglang-router",
                   help="the sglang-router command (e.g. /opt/router-venv/bin/sglang-router)")
    p.add_argument("--policies", default=",".join(POLICIES), help="router policies to compare, in order")
    p.add_argument("--router-args", default="",
                   help="more flags for the router (e.g. '--balance-abs-threshold 1000' to keep cache-aware "
                        "routing from falling back to the shortest queue)")
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--replica-threads", type=int, default=1, help="OMP_NUM_THREADS of each replica")
    p.add_argument("--conversations", type=int, default=64)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=16, help="conversations in flight at once")
    p.add_argument("--first-words", type=int, default=200, help="words of a conversation's first message")
    p.add_argument("--turn-words", type=int, default=40, help="words of each later user message")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens of each answer")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--start-timeout", type=float, default=600.0, help="seconds a replica may take to load")
    p.add_argument("--workdir", default=None, help="where the router logs go (default: a temporary folder)")
    p.add_argument("--json", default=None, help="write the results here")
    return p


def main(argv: list[str] | None = None) -> int:
    own, replica_flags = split_server_flags(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(own)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="router-prefix-"))
    workdir.mkdir(parents=True, exist_ok=True)
    results = []
    for policy in policies:
        print(f"[{policy}] {args.replicas} replicas, {args.conversations} conversations x {args.turns} turns",
              file=sys.stderr, flush=True)
        results.append(run_policy(policy, args, replica_flags or DEFAULT_REPLICA_FLAGS, workdir))
    print(format_results(results))
    if args.json:
        report = {"args": vars(args), "replica_flags": replica_flags or DEFAULT_REPLICA_FLAGS,
                  "results": [asdict(r) for r in results]}
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 1 if any(r.failed for r in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
