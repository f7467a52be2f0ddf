"""One hostile request per class against a server while a canary stream runs: what each gets
(status, time) and the canary's longest silence. `--repo` runs another checkout's server (an
older commit, to compare); every case gets a fresh server, so that a wedged one cannot spoil
the next case.

    OMP_NUM_THREADS=1 python -m benchmarks.abuse [--repo /path/to/old/checkout] [--cases kv,top_p]

tests/server/test_abuse.py asserts the same properties (and reuses `Canary` from here).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from benchmarks.server_proc import REPO, start_server

MODEL = "SmolLM2-135M-Instruct"
# A pool of 34 blocks of 16 tokens (546 tokens) for a 512-token context: a few requests fill it.
FLAGS = ["--max-model-len", "512", "--kv-cache-memory", "24MiB", "--swap-space", "0.0625", "--max-num-seqs", "32",
         "--max-n", "64", "--max-best-of", "64", "--enable-chunked-prefill", "--max-num-batched-tokens", "128",
         "--seed", "0"]


@dataclass
class Canary:
    """Streams completions back to back on its own thread, recording when each chunk came."""

    url: str
    times: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self.run, daemon=True)
        thread.start()
        return thread

    def run(self) -> None:
        body = {"model": MODEL, "prompt": "Count: 1, 2, 3,", "max_tokens": 200, "ignore_eos": True, "stream": True,
                "temperature": 0}
        with httpx.Client(base_url=self.url, timeout=600) as client:
            while not self.stop.is_set():
                try:
                    with client.stream("POST", "/v1/completions", json=body) as resp:
                        if resp.status_code != 200:
                            self.errors.append(f"{resp.status_code} {resp.read()[:200]!r}")
                            time.sleep(0.1)
                            continue
                        for line in resp.iter_lines():
                            if line.startswith("data: {"):
                                self.times.append(time.monotonic())
                            if self.stop.is_set():
                                break
                except httpx.HTTPError as exc:
                    self.errors.append(repr(exc))

    def wait_started(self, chunks: int = 60, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while len(self.times) < chunks:
            if time.monotonic() > deadline or self.errors:
                raise RuntimeError(f"the canary did not start: {self.errors}")
            time.sleep(0.1)

    def longest_gap(self, start: float, end: float) -> float:
        """The longest silence between `start` and `end`, counting from `start` to the first
        chunk and from the last chunk to `end`."""
        marks = [start] + [t for t in self.times if start < t < end] + [end]
        return max(b - a for a, b in zip(marks, marks[1:]))

    def normal_gap(self) -> float:
        """The 90th percentile of the last 40 inter-chunk gaps."""
        gaps = sorted(b - a for a, b in zip(self.times[-40:], self.times[-39:]))
        return gaps[int(len(gaps) * 0.9)]


def health_poller(url: str, stop: threading.Event, seen: list) -> None:
    """GET /health every 0.2 s until `stop`, appending (status or error, seconds it took)."""
    with httpx.Client(base_url=url, timeout=10) as client:
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                status = client.get("/health").status_code
            except httpx.HTTPError as exc:
                status = type(exc).__name__
            seen.append((status, time.monotonic() - t0))
            time.sleep(0.2)


def send(url: str, path: str, body, timeout: float = 600) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(url + path, content=content, timeout=timeout, headers={"content-type": "application/json"})


def unread_stream(url: str, seconds: float = 8.0) -> None:
    """Ask for 16 streamed samples and read nothing for `seconds`, then hang up."""
    body = json.dumps({"model": MODEL, "prompt": "Once upon a time", "n": 16, "max_tokens": 120, "ignore_eos": True,
                       "stream": True}).encode()
    sock = socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    time.sleep(seconds)
    sock.close()


def echo_logprobs_body(prompt_tokens: int = 500) -> dict:
    """A prompt near FLAGS' 512-token context (token ids), echoed with 20 logprobs per prompt
    token: every prompt row scored. It used to be prefilled and scored in one step, past the
    token budget, with every other stream waiting for it."""
    return {"model": MODEL, "prompt": [1000 + (7 * i) % 20_000 for i in range(prompt_tokens)], "echo": True,
            "logprobs": 20, "max_tokens": 1}


def cases() -> dict[str, tuple[str, str, object]]:
    """name -> (class, path, body); the body None means the unread stream."""
    comp = {"model": MODEL, "prompt": "Hi", "max_tokens": 3}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    tool = {"type": "function", "function": {"parameters": {"type": "object"}}}
    long = {"model": MODEL, "prompt": echo_logprobs_body(480)["prompt"]}  # 480 of the 512-token context
    return {
        "n16_outgrows_pool": ("KV pressure", "/v1/completions",
                              {"model": MODEL, "prompt": "Hello", "n": 16, "max_tokens": 60, "ignore_eos": True}),
        "n33_over_max_num_seqs": ("KV pressure", "/v1/completions", {**comp, "n": 33}),
        "beams_wider_than_pool": ("KV pressure", "/v1/completions", {**comp, "n": 2, "best_of": 16,
                                                                     "use_beam_search": True, "temperature": 0,
                                                                     "max_tokens": 400}),
        "echo_logprobs_near_context_limit": ("sizes", "/v1/completions", echo_logprobs_body()),
        # NOTE: 2 beams of 128 prompt tokens: wider or longer beams outgrow FLAGS' 34-block pool (a 400)
        "beams_on_a_long_prompt": ("sizes", "/v1/completions", {**comp, "prompt": long["prompt"][:128], "n": 2,
                                                                "use_beam_search": True, "temperature": 0,
                                                                "max_tokens": 8}),
        "best_of_16_on_a_long_prompt": ("sizes", "/v1/completions", {**long, "n": 2, "best_of": 16, "max_tokens": 8}),
        "json_schema_on_a_long_prompt": ("sizes", "/v1/completions", {**long, "max_tokens": 16, "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {
                "a": {"type": "string"}, "b": {"type": "array", "items": {"type": "integer"}}}}}}}),
        "top_p_1e-300": ("numbers", "/v1/completions", {**comp, "top_p": 1e-300}),
        "temperature_1e308": ("numbers", "/v1/completions", {**comp, "temperature": 1e308}),
        "repetition_penalty_1e308": ("numbers", "/v1/completions", {**comp, "repetition_penalty": 1e308}),
        "length_penalty_1e308": ("numbers", "/v1/completions", {**comp, "n": 2, "use_beam_search": True,
                                                                "temperature": 0, "length_penalty": 1e308}),
        "seed_2**64": ("numbers", "/v1/chat/completions", {**chat, "seed": 2**64}),
        "40k_tools": ("sizes", "/v1/chat/completions", {**chat, "tools": [
            {**tool, "function": {**tool["function"], "name": f"tool_{i}"}} for i in range(40_000)]}),
        "3MB_prompt": ("sizes", "/v1/completions", {**comp, "prompt": "hello world " * 250_000}),
        "40k_stop_token_ids": ("sizes", "/v1/completions", {**comp, "max_tokens": 30,
                                                            "stop_token_ids": list(range(100, 40_100))}),
        "10k_char_stop_string": ("sizes", "/v1/completions", {**comp, "max_tokens": 30, "stop": ["ab" * 5000]}),
        "slow_regex": ("sizes", "/v1/completions", {**comp, "guided_regex": "(a{1000}){1000}"}),
        "deep_nesting": ("sizes", "/v1/completions", b'{"model": "' + MODEL.encode() + b'", "prompt": "Hi", "x": '
                         + b"[" * 100_000 + b"]" * 100_000 + b"}"),
        "unread_stream_n16": ("slow reader", "/v1/completions", None),
        "5MB_body": ("HTTP", "/v1/completions", {**comp, "prompt": "x" * (5 * 1024 * 1024)}),
        "no_model": ("HTTP", "/v1/completions", {"prompt": "Hi", "max_tokens": 2}),
    }


def run_case(url: str, canary: Canary, path: str, body, timeout: float) -> dict:
    stop, health = threading.Event(), []
    poller = threading.Thread(target=health_poller, args=(url, stop, health), daemon=True)
    payload = body if body is None or isinstance(body, bytes) else json.dumps(body).encode()
    normal = canary.normal_gap()
    start = time.monotonic()
    poller.start()
    status: object
    try:
        if payload is None:
            unread_stream(url)
            status = "-"
        else:
            status = send(url, path, payload, timeout=timeout).status_code
    except httpx.TimeoutException:
        status = f"no answer in {timeout:.0f} s"
    end = time.monotonic()
    time.sleep(1.0)
    stop.set()
    poller.join(15)
    bad_health = [h for h in health if h[0] != 200 or h[1] > 1.0]
    return {"status": status, "seconds": round(end - start, 2),
            "canary_gap_s": round(canary.longest_gap(start, end), 2), "canary_normal_gap_s": round(normal, 3),
            "health_bad": len(bad_health), "health_slowest_s": round(max((h[1] for h in health), default=0.0), 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repo", type=Path, default=REPO, help="the checkout whose server to run")
    ap.add_argument("--cases", default=None, help="comma-separated case names (default: all)")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for each hostile answer")
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = ap.parse_args()
    chosen = cases() if args.cases is None else {k: cases()[k] for k in args.cases.split(",")}
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONPATH": str(args.repo)}
    results = {}
    for name, (kind, path, body) in chosen.items():
        with open(os.devnull, "w") as quiet:
            proc, url = start_server(FLAGS, env=env, repo=args.repo, stdout=quiet)
            canary = Canary(url)
            try:
                canary.start()
                canary.wait_started()
                results[name] = {"class": kind, **run_case(url, canary, path, body, args.timeout)}
            finally:
                canary.stop.set()
                proc.kill()
                proc.wait()
        r = results[name]
        print(f"| {kind} | {name} | {r['status']} | {r['seconds']} | {r['canary_gap_s']} ({r['canary_normal_gap_s']}) "
              f"| {r['health_bad']} |", flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
