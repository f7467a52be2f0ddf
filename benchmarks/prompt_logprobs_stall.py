"""What one echo + logprobs request on a long prompt costs the other streams: a canary streams
completions back to back while one `/v1/completions` request with `"echo": true, "logprobs": 20,
"max_tokens": 1` and a prompt of N tokens runs; reported per N: the canary's longest silence
(and its normal gap), the request's time beside the canary, and the same request alone on the
quiet server. Default server flags (the default model) unless given after `--`.

    python -m benchmarks.prompt_logprobs_stall [--tokens 3000,6000] [--repo OLD_CHECKOUT] [-- flags]

`--repo` runs another checkout's server (an older commit, to compare in one script).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from benchmarks.abuse import MODEL, Canary, send
from benchmarks.server_proc import REPO, split_server_flags, start_server


def body(tokens: int) -> dict:
    """A prompt of `tokens` token ids (no tokenizer round trip), echoed with 20 logprobs each."""
    return {"model": MODEL, "prompt": [1000 + (7 * i) % 20_000 for i in range(tokens)], "echo": True, "logprobs": 20,
            "max_tokens": 1}


def measure(url: str, tokens: int) -> dict:
    """The request alone, then beside a canary."""
    t0 = time.monotonic()
    alone = send(url, "/v1/completions", body(tokens), timeout=1200)
    alone_s = time.monotonic() - t0
    assert alone.status_code == 200, alone.text[:300]
    canary = Canary(url)
    thread = canary.start()
    try:
        canary.wait_started()
        time.sleep(2.0)
        normal = canary.normal_gap()
        start = time.monotonic()
        resp = send(url, "/v1/completions", body(tokens), timeout=1200)
        end = time.monotonic()
        time.sleep(1.0)
        assert resp.status_code == 200, resp.text[:300]
        gap = canary.longest_gap(start, end)
    finally:
        canary.stop.set()
        thread.join(60)
    return {"prompt_tokens": tokens, "alone_s": round(alone_s, 2), "beside_canary_s": round(end - start, 2),
            "canary_longest_gap_s": round(gap, 2), "canary_normal_gap_s": round(normal, 3)}


def main() -> None:
    own, flags = split_server_flags(sys.argv[1:])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="3000,6000", help="prompt lengths, comma-separated")
    ap.add_argument("--repo", type=Path, default=REPO, help="the checkout whose server to run")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    args = ap.parse_args(own)
    env = {**os.environ, "PYTHONPATH": str(args.repo)}
    proc, url = start_server(flags, env=env, repo=args.repo)
    try:
        results = [measure(url, int(n)) for n in args.tokens.split(",")]
    finally:
        proc.terminate()
        proc.wait(60)
    for r in results:
        print(f"| {args.repo} | {r['prompt_tokens']} | {r['alone_s']} | {r['beside_canary_s']} | "
              f"{r['canary_longest_gap_s']} ({r['canary_normal_gap_s']}) |", flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
