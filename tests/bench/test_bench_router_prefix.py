"""benchmarks/router_prefix.py: its multi-turn workload against one real replica, and (opt-in,
`-m slow`, with sglang-router installed) the whole comparison at a tiny scale."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys

import pytest

from benchmarks import router_prefix
from benchmarks.server_proc import start_server
from benchmarks.workload import TextSource

FLAGS = ["--max-model-len", "1024", "--kv-cache-memory", "64MiB", "--seed", "0"]


def workload_args(**overrides) -> argparse.Namespace:
    args = router_prefix.build_parser().parse_args([])
    for key, value in {"conversations": 2, "turns": 3, "concurrency": 2, "first_words": 60,
                       "turn_words": 15, "max_tokens": 4, **overrides}.items():
        setattr(args, key, value)
    return args


def test_conversations_are_distinct_and_repeatable():
    source = TextSource.builtin(seed=0)
    a = router_prefix.conversation_texts(source, 0, 3, 60, 15, seed=0)
    assert a == router_prefix.conversation_texts(source, 0, 3, 60, 15, seed=0)
    assert a != router_prefix.conversation_texts(source, 1, 3, 60, 15, seed=0)
    assert [len(t.split()) for t in a] == [60, 15, 15]


def test_each_turn_resends_the_conversation_so_far():
    """On one replica: every later turn's prompt holds the previous one's (longer, and its
    blocks found in the prefix cache)."""
    proc, url = start_server(FLAGS, {**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        import httpx

        model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
        records = asyncio.run(router_prefix.run_workload(url, model, workload_args()))
        counters = router_prefix.scrape(url)
        block_size = router_prefix.replica_block_size(url)
    finally:
        proc.terminate()
        proc.wait(60)
    assert len(records) == 6 and not [r.error for r in records if r.error]
    for conversation in (0, 1):
        turns = sorted((r for r in records if r.conversation == conversation), key=lambda r: r.turn)
        assert [r.turn for r in turns] == [0, 1, 2]
        assert all(r.ttft is not None and r.ttft > 0 for r in turns)
        for previous, turn in zip(turns, turns[1:]):
            assert turn.prompt_tokens > previous.prompt_tokens + 15
            assert turn.cached_tokens >= previous.prompt_tokens // 16 * 16 - 16  # all but the last blocks
    assert counters["paged_serve:prefix_cache_hits_total"] >= sum(r.cached_tokens for r in records)
    assert block_size == 16  # the server's default (FLAGS set none)


def test_history_bound_counts_the_previous_turn_in_whole_blocks():
    """Turn 0 counts what it found; a later turn the previous prompt + answer in whole blocks,
    below its own last token, or what it found if more; over every prompt token."""
    Turn = router_prefix.Turn
    records = [Turn(0, 0, prompt_tokens=100, cached_tokens=16, completion_tokens=30),
               Turn(0, 1, prompt_tokens=180, cached_tokens=0, completion_tokens=30),   # 130 held -> 128
               Turn(0, 2, prompt_tokens=211, cached_tokens=0),                          # 210 held -> 208
               Turn(1, 0, prompt_tokens=40, cached_tokens=0, completion_tokens=100),
               Turn(1, 1, prompt_tokens=141, cached_tokens=0)]                          # min(140, 140) -> 128
    assert router_prefix.history_bound(records) == (16 + 128 + 208 + 0 + 128) / (100 + 180 + 211 + 40 + 141)
    assert router_prefix.history_bound(records, block_size=64) == (16 + 128 + 192 + 0 + 128) / 672


def router_command() -> str | None:
    return os.environ.get("PAGED_SERVE_ROUTER_CMD") or shutil.which("sglang-router")


@pytest.mark.slow
def test_cache_aware_beats_round_robin_at_a_tiny_scale(tmp_path):
    """Both policies end to end: 2 replicas, 6 conversations of 3 turns."""
    command = router_command()
    if command is None:
        pytest.skip("no sglang-router: install it in a venv of its own, set PAGED_SERVE_ROUTER_CMD")
    out = tmp_path / "report.json"
    rc = router_prefix.main(["--router-cmd", command, "--replicas", "2", "--conversations", "6",
                             "--turns", "3", "--concurrency", "6", "--max-tokens", "8", "--first-words", "60",
                             "--turn-words", "20", "--workdir", str(tmp_path), "--json", str(out), "--", *FLAGS])
    assert rc == 0
    results = {r["policy"]: r for r in json.loads(out.read_text())["results"]}
    aware, rr = results["cache_aware"], results["round_robin"]
    assert sum(aware["requests_per_replica"]) == sum(rr["requests_per_replica"]) == 18
    assert aware["hit_rate"] > rr["hit_rate"], (aware, rr)
    print(router_prefix.format_results([router_prefix.PolicyResult(**r) for r in results.values()]),
          file=sys.stderr)
