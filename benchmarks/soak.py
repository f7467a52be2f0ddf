"""Soak test: many mixed requests from many concurrent clients, some of which walk away.

    python benchmarks/soak.py --start -- --max-model-len 1024 --kv-cache-memory 256MiB
    python benchmarks/soak.py --url http://127.0.0.1:8000 --pid 12345 --requests 500 --clients 64

Sends `--requests` requests from `--clients` concurrent clients, drawn (seeded) from a mix of
non-streaming completions, streaming completions with usage, n > 1 completions and chats
(streaming and not), and clients that disconnect at a random point (mid-stream after a few
chunks, or before a non-streaming answer arrives). Then checks:

1. every request that stayed connected got a 200 with a valid, complete body (JSON in OpenAI's
   shape with a finish_reason per choice and consistent usage; or an SSE stream of `data:`
   frames ending in `data: [DONE]`, every choice finished, usage when asked for);
2. the server is still healthy (GET /health 200, and one more request is served);
3. the KV pool is all free again (GET /kv/blocks: nothing used, shared or swapped);
4. the server's resident memory (VmRSS in /proc/<pid>/status) grew by less than
   `--rss-bound-mib` between a warm-up pass and the end.

Prints a JSON report (and writes it with `--json FILE`); exits 1 if any check fails.
`--start` launches `python -m server` (OMP_NUM_THREADS=1 unless set) on a free loopback port
with the flags after `--`; otherwise `--pid` is needed for the memory check.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

if __package__ in (None, ""):  # run as a script: python benchmarks/soak.py
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.server_proc import server_for, split_server_flags
from benchmarks.workload import SHORT_PROMPTS

PROMPTS = [*SHORT_PROMPTS, "The capital of France is"]
KINDS = ["completion", "completion_stream", "completion_n", "chat", "chat_stream_n",
         "disconnect_stream", "disconnect_full"]
# Relative frequency of each kind (disconnects: about 20% of requests).
WEIGHTS = [20, 20, 15, 15, 10, 12, 8]


@dataclass
class Spec:
    index: int
    kind: str
    path: str
    body: dict
    disconnect_after_chunks: int = -1  # streams: leave after this many data frames
    disconnect_after_s: float = -1.0  # non-streaming: leave after this long

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))


@dataclass
class Report:
    requests: int = 0
    clients: int = 0
    kinds: Counter = field(default_factory=Counter)
    completed: int = 0
    disconnected: int = 0
    finished_before_disconnect: int = 0
    failures: list = field(default_factory=list)
    completion_tokens: int = 0
    wall_s: float = 0.0
    rss_warm_mib: float = 0.0
    rss_end_mib: float = 0.0
    rss_peak_mib: float = 0.0
    rss_growth_mib: float = 0.0
    rss_bound_mib: float = 0.0
    pool_free_after_s: float = -1.0
    healthy_after: bool = False
    ok: bool = False

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d["kinds"] = dict(self.kinds)
        d["failures"] = self.failures[:20]
        d["num_failures"] = len(self.failures)
        return d


def make_specs(count: int, max_tokens: int, seed: int, model: str) -> list[Spec]:
    rng = random.Random(seed)
    specs = []
    for i in range(count):
        kind = rng.choices(KINDS, WEIGHTS)[0]
        prompt = rng.choice(PROMPTS)
        tokens = rng.randint(1, max_tokens)
        sampling = {"model": model, "max_tokens": tokens, "temperature": rng.choice([0, 0.7, 1.0]), "seed": i,
                    "ignore_eos": rng.random() < 0.5}
        messages = [{"role": "user", "content": prompt}]
        if kind == "completion":
            spec = Spec(i, kind, "/v1/completions", {"prompt": prompt, **sampling})
        elif kind == "completion_stream":
            spec = Spec(i, kind, "/v1/completions", {"prompt": prompt, **sampling, "stream": True,
                                                     "stream_options": {"include_usage": True}})
        elif kind == "completion_n":
            spec = Spec(i, kind, "/v1/completions", {"prompt": [prompt, rng.choice(PROMPTS)], **sampling,
                                                     "n": rng.randint(2, 3)})
        elif kind == "chat":
            spec = Spec(i, kind, "/v1/chat/completions", {"messages": messages, **sampling,
                                                          "n": rng.randint(1, 2)})
        elif kind == "chat_stream_n":
            spec = Spec(i, kind, "/v1/chat/completions", {"messages": messages, **sampling, "n": 2, "stream": True,
                                                          "stream_options": {"include_usage": True}})
        elif kind == "disconnect_stream":
            spec = Spec(i, kind, "/v1/completions", {"prompt": prompt, **sampling, "max_tokens": 4 * max_tokens,
                                                     "ignore_eos": True, "stream": True, "n": rng.randint(1, 2)},
                        disconnect_after_chunks=rng.randint(0, 4))
        else:
            spec = Spec(i, kind, "/v1/chat/completions", {"messages": messages, **sampling,
                                                          "max_tokens": 4 * max_tokens, "ignore_eos": True},
                        disconnect_after_s=rng.uniform(0.0, 1.5))
        specs.append(spec)
    return specs


# ----------------------------------------------------------------------------- validation
def _expected_choices(spec: Spec) -> int:
    prompts = spec.body.get("prompt")
    num_prompts = len(prompts) if isinstance(prompts, list) else 1
    return num_prompts * spec.body.get("n", 1)


def check_full(spec: Spec, body: dict) -> str | None:
    """None if `body` is a valid complete answer to `spec`, else what is wrong."""
    chat = spec.path.endswith("chat/completions")
    want = _expected_choices(spec)
    if body.get("object") != ("chat.completion" if chat else "text_completion"):
        return f"object {body.get('object')!r}"
    choices = body.get("choices") or []
    if sorted(c.get("index") for c in choices) != list(range(want)):
        return f"choice indexes {[c.get('index') for c in choices]} (want {want})"
    for c in choices:
        if c.get("finish_reason") not in ("stop", "length"):
            return f"finish_reason {c.get('finish_reason')!r}"
        text = c["message"]["content"] if chat else c.get("text")
        if not isinstance(text, str):
            return "no text"
    usage = body.get("usage") or {}
    if usage.get("total_tokens") != usage.get("prompt_tokens", -1) + usage.get("completion_tokens", -1):
        return f"usage {usage}"
    if not 0 <= usage["completion_tokens"] <= want * spec.body["max_tokens"]:
        return f"completion_tokens {usage['completion_tokens']}"
    return None


def check_stream(spec: Spec, text: str) -> tuple[str | None, int]:
    """(None or what is wrong, completion tokens) for a finished SSE body."""
    if not text.endswith("data: [DONE]\n\n"):
        return f"stream not terminated: {text[-120:]!r}", 0
    frames = text.split("\n\n")[:-2]
    finished: dict[int, str] = {}
    usage = None
    for frame in frames:
        if not frame.startswith("data: {"):
            return f"bad frame {frame[:80]!r}", 0
        event = json.loads(frame[6:])
        if "error" in event:
            return f"error event {event['error']}", 0
        if event.get("usage"):
            usage = event["usage"]
        for choice in event.get("choices", []):
            if choice.get("finish_reason"):
                finished[choice["index"]] = choice["finish_reason"]
    want = _expected_choices(spec)
    if sorted(finished) != list(range(want)):
        return f"finished choices {sorted(finished)} (want {want})", 0
    if spec.body.get("stream_options", {}).get("include_usage") and usage is None:
        return "no usage chunk", 0
    return None, (usage or {}).get("completion_tokens", 0)


# ------------------------------------------------------------------------------- clients
async def run_one(client: httpx.AsyncClient, spec: Spec, report: Report) -> None:
    try:
        if spec.disconnect_after_chunks >= 0:
            await _disconnecting_stream(client, spec, report)
        elif spec.disconnect_after_s >= 0:
            try:
                resp = await asyncio.wait_for(client.post(spec.path, json=spec.body), spec.disconnect_after_s)
            except asyncio.TimeoutError:
                report.disconnected += 1
                return
            report.finished_before_disconnect += 1
            problem = None if resp.status_code == 200 else f"status {resp.status_code}: {resp.text[:200]}"
            _record(report, spec, problem or check_full(spec, resp.json()), resp)
        elif spec.stream:
            async with client.stream("POST", spec.path, json=spec.body) as resp:
                text = (await resp.aread()).decode()
            if resp.status_code != 200:
                _record(report, spec, f"status {resp.status_code}: {text[:200]}")
                return
            problem, tokens = check_stream(spec, text)
            report.completion_tokens += tokens
            _record(report, spec, problem)
        else:
            resp = await client.post(spec.path, json=spec.body)
            problem = None if resp.status_code == 200 else f"status {resp.status_code}: {resp.text[:200]}"
            _record(report, spec, problem or check_full(spec, resp.json()), resp)
    except (httpx.HTTPError, ValueError) as exc:  # a transport error or a body that is not JSON
        _record(report, spec, f"{type(exc).__name__}: {exc}")


async def _disconnecting_stream(client: httpx.AsyncClient, spec: Spec, report: Report) -> None:
    async with client.stream("POST", spec.path, json=spec.body) as resp:
        if resp.status_code != 200:
            _record(report, spec, f"status {resp.status_code}")
            return
        frames = 0
        async for line in resp.aiter_lines():
            if line == "data: [DONE]":
                report.finished_before_disconnect += 1
                report.completed += 1
                return
            if line.startswith("data: "):
                frames += 1
                if frames > spec.disconnect_after_chunks:
                    break
    # NOTE: leaving the `async with` early closes the connection: the server sees a disconnect.
    report.disconnected += 1


def _record(report: Report, spec: Spec, problem: str | None, resp: httpx.Response | None = None) -> None:
    if problem is None:
        report.completed += 1
        if resp is not None:
            report.completion_tokens += resp.json()["usage"]["completion_tokens"]
    else:
        report.failures.append({"request": spec.index, "kind": spec.kind, "problem": problem})


async def run_clients(url: str, specs: list[Spec], clients: int, report: Report, timeout: float) -> None:
    queue: asyncio.Queue[Spec] = asyncio.Queue()
    for spec in specs:
        queue.put_nowait(spec)
    limits = httpx.Limits(max_connections=clients + 8, max_keepalive_connections=clients + 8)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client:
        async def worker() -> None:
            while not queue.empty():
                spec = queue.get_nowait()
                report.kinds[spec.kind] += 1
                await run_one(client, spec, report)

        await asyncio.gather(*[worker() for _ in range(clients)])


# ----------------------------------------------------------------------------- the checks
def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def pool_is_free(url: str) -> bool:
    m = httpx.get(url + "/kv/blocks", timeout=30).json()
    # block states: 0 free, 3 cached (free, holding a reusable prefix); 1 used, 2 shared
    return all(s in (0, 3) for s in m["blocks"]) and not any(m["ref_counts"]) and not any(m["cpu_blocks"])


async def sample_rss(pid: int | None, stop: asyncio.Event, report: Report) -> None:
    while pid is not None and not stop.is_set():
        report.rss_peak_mib = max(report.rss_peak_mib, rss_mib(pid))
        await asyncio.sleep(0.5)


async def soak_async(url: str, pid: int | None, specs: list[Spec], clients: int, report: Report,
                     timeout: float) -> None:
    stop = asyncio.Event()
    sampler = asyncio.ensure_future(sample_rss(pid, stop, report))
    t0 = time.perf_counter()
    try:
        await run_clients(url, specs, clients, report, timeout)
    finally:
        report.wall_s = time.perf_counter() - t0
        stop.set()
        await sampler


def run_soak(url: str, pid: int | None, *, requests: int = 500, clients: int = 64, max_tokens: int = 16,
             seed: int = 0, rss_bound_mib: float = 256.0, timeout: float = 600.0,
             pool_wait_s: float = 60.0) -> Report:
    """Run the soak against a server at `url` (process `pid`, for the memory check)."""
    report = Report(requests=requests, clients=clients, rss_bound_mib=rss_bound_mib)
    model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
    # Warm-up: one request of every kind per client slot (allocator pools, compiled paths), so
    # that the memory baseline is a warm server's.
    warm = make_specs(min(clients, 16) * 2, max_tokens, seed + 10**6, model)
    asyncio.run(run_clients(url, warm, min(clients, 16), Report(), timeout))
    _wait_pool_free(url, pool_wait_s)
    if pid is not None:
        report.rss_warm_mib = report.rss_peak_mib = rss_mib(pid)

    asyncio.run(soak_async(url, pid, make_specs(requests, max_tokens, seed, model), clients, report, timeout))

    t0 = time.monotonic()
    if _wait_pool_free(url, pool_wait_s):
        report.pool_free_after_s = time.monotonic() - t0
    else:
        report.failures.append({"check": "pool", "problem": httpx.get(url + "/kv/blocks").json()})
    health = httpx.get(url + "/health", timeout=30)
    again = httpx.post(url + "/v1/completions", json={"model": model, "prompt": "Hello", "max_tokens": 2}, timeout=120)
    report.healthy_after = health.status_code == 200 and again.status_code == 200
    if not report.healthy_after:
        report.failures.append({"check": "health", "problem": f"{health.status_code} {health.text[:200]}, "
                                                              f"{again.status_code} {again.text[:200]}"})
    if pid is not None:
        report.rss_end_mib = rss_mib(pid)
        report.rss_growth_mib = report.rss_end_mib - report.rss_warm_mib
        if report.rss_growth_mib >= rss_bound_mib:
            report.failures.append({"check": "rss", "problem": f"grew {report.rss_growth_mib:.1f} MiB"})
    accounted = report.completed + report.disconnected + len([f for f in report.failures if "request" in f])
    if accounted != requests:
        report.failures.append({"check": "count", "problem": f"{accounted} of {requests} requests accounted for"})
    report.ok = not report.failures
    return report


def _wait_pool_free(url: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not pool_is_free(url):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def main() -> int:
    argv, server_flags = split_server_flags(sys.argv[1:])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default=None, help="a running server (default: --start one)")
    p.add_argument("--pid", type=int, default=None, help="the running server's pid (for the memory check)")
    p.add_argument("--start", action="store_true", help="start `python -m server` with the flags after --")
    p.add_argument("--requests", type=int, default=500)
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=16, help="largest max_tokens of a request that stays")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rss-bound-mib", type=float, default=256.0,
                   help="fail if the server's RSS grew by this much or more after the warm-up")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")
    p.add_argument("--json", default=None, help="write the report here")
    args = p.parse_args(argv)

    env = {"OMP_NUM_THREADS": "1", **os.environ}
    with server_for(args.url, args.start, server_flags, env) as (url, proc):
        pid = proc.pid if proc is not None else args.pid
        if pid is None:
            print("no --pid: the memory check is skipped", file=sys.stderr)
        report = run_soak(url, pid, requests=args.requests, clients=args.clients, max_tokens=args.max_tokens,
                          seed=args.seed, rss_bound_mib=args.rss_bound_mib, timeout=args.timeout)
    out = json.dumps(report.as_dict(), indent=2)
    print(out)
    if args.json:
        Path(args.json).write_text(out)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
