"""serve.py end to end against the SSE stub on loopback: tests the load generator itself."""

import json

import httpx
import pytest

from benchmarks import serve
from stub_server import StubState, count_tokens, run_stub

BASE_ARGS = ["--model", "stub", "--num-prompts", "12", "--max-tokens", "4",
             "--max-model-len", "512", "--seed", "3"]


def run(base_url, tmp_path, *extra):
    out = tmp_path / "report.json"
    rc = serve.main(["--base-url", base_url, *BASE_ARGS, "--json", str(out), *extra])
    return rc, json.loads(out.read_text())


def test_sweep_with_server_tokenizer_and_concurrency_limit(tmp_path, capsys):
    state = StubState()
    with run_stub(state) as url:
        rc, report = run(url + "/v1", tmp_path, "--request-rates", "200,inf",
                         "--concurrency", "3", "--ignore-eos")
    assert rc == 0
    assert report["token_counting"] == "server /tokenize"
    assert report["ignore_eos_sent"] is True
    assert [p["request_rate"] for p in report["points"]] == [200.0, "inf"]
    for p in report["points"]:
        assert (p["completed"], p["failed"], p["total_output_tokens"]) == (12, 0, 48)
        assert p["ttft_ms"]["p50"] >= 20  # the stub waits 20 ms before the first chunk
        # NOTE: no lower bound on gaps: on a loaded machine chunks can arrive together
        assert p["tpot_ms"]["p50"] is not None and p["itl_ms"]["p99"] >= p["itl_ms"]["p50"] >= 0
        assert p["e2e_ms"]["p99"] >= p["e2e_ms"]["p50"] >= p["ttft_ms"]["p50"]
        assert p["request_throughput"] > 0 and p["output_throughput"] > 0
    assert state.peak_in_flight <= 3
    streamed = [b for b in state.bodies if b.get("stream")]
    assert len(streamed) == 24
    assert all(b["ignore_eos"] and b["max_tokens"] == 4 for b in streamed)
    # prompt + max_tokens fits the context; the same prompts at both rates
    assert all(count_tokens(b["prompt"]) <= 512 - 4 for b in streamed)
    assert sorted(b["prompt"] for b in streamed[:12]) == sorted(b["prompt"] for b in streamed[12:])
    assert "out tok/s" in capsys.readouterr().out


def test_prompt_lengths_follow_the_tokenizer(tmp_path):
    state = StubState(ttft_s=0.0, token_s=0.0)
    with run_stub(state) as url:
        _, report = run(url, tmp_path, "--num-prompts", "40")
    # the server counts tokens; re-cut prompts land close to their skewed targets
    assert report["prompt_tokens"]["max"] <= 508
    assert report["prompt_tokens"]["min"] >= 1
    assert 50 < report["prompt_tokens"]["mean"] < 250  # skewed: mean ~ 0.16 of the context


def test_server_rejecting_ignore_eos_and_without_tokenize(tmp_path, capsys):
    state = StubState(tokenize=False, accept_ignore_eos=False, ttft_s=0.0, token_s=0.001)
    with run_stub(state) as url:
        rc, report = run(url, tmp_path, "--ignore-eos", "--extra-body", '{"top_k": 1}')
    assert rc == 0
    assert all(b["top_k"] == 1 for b in state.bodies)  # the warm-up too
    assert report["ignore_eos_requested"] is True and report["ignore_eos_sent"] is False
    # calibrated from the usage of one completion of the 400-word sample
    assert report["token_counting"].endswith("tokens/word (from usage)")
    assert report["token_counting"] != "estimated, 1.3 tokens/word (from usage)"
    assert report["points"][0]["completed"] == 12
    assert "rejected ignore_eos" in capsys.readouterr().err
    # input totals are the server's usage counts, not our estimates
    streamed = [b for b in state.bodies if b.get("stream")]
    assert report["points"][0]["total_input_tokens"] == sum(count_tokens(b["prompt"]) for b in streamed)


def test_no_tokenize_and_no_usage_assumes_a_ratio(tmp_path):
    state = StubState(tokenize=False, usage=False, ttft_s=0.0, token_s=0.0)
    with run_stub(state) as url:
        rc, report = run(url, tmp_path, "--tokens-per-word", "1.5")
    assert rc == 0
    assert report["token_counting"] == "estimated, 1.5 tokens/word (assumed)"


def test_unreachable_server_fails_before_the_run(tmp_path):
    with run_stub(StubState()) as url:
        pass  # stopped: nothing listens on the port any more
    with pytest.raises(httpx.ConnectError):
        run(url, tmp_path)


def test_plot_two_servers(tmp_path):
    from benchmarks import plot_serve

    paths = []
    for name, delay in (("fast", 0.001), ("slow", 0.004)):
        with run_stub(StubState(ttft_s=delay, token_s=delay)) as url:
            rc, _ = run(url, tmp_path, "--request-rates", "100,inf", "--label", name)
        assert rc == 0
        paths.append(str(tmp_path / f"{name}.json"))
        (tmp_path / "report.json").rename(paths[-1])
    out = tmp_path / "serve.png"
    assert plot_serve.main([*paths, "--out", str(out)]) == 0
    assert out.read_bytes().startswith(b"\x89PNG")
