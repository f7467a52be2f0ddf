"""Flags, the YAML config and their precedence."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.loop.engine_args import CPU_CHUNKED_BUDGET, GPU_CHUNKED_BUDGET
from server.cli import parse_args

REPO = Path(__file__).resolve().parents[2]


def test_defaults_serve_the_default_model_on_loopback_8000(monkeypatch):
    monkeypatch.delenv("PAGED_SERVE_API_KEY", raising=False)
    cli = parse_args([])
    assert (cli.settings.host, cli.settings.port, cli.settings.api_key) == ("127.0.0.1", 8000, None)
    assert cli.engine_args.model is None and cli.engine_args.block_size == 16


def test_vllm_flags_reach_engine_args():
    cli = parse_args(["some/model", "--max-model-len", "1024", "--block-size", "8", "--max-num-seqs", "4",
                      "--max-num-batched-tokens", "4096", "--kv-cache-memory", "2GiB", "--swap-space", "2",
                      "--gpu-memory-utilization", "0.5", "--served-model-name", "m", "--seed", "7",
                      "--no-enable-prefix-caching", "--preemption-mode", "recompute"])
    a = cli.engine_args
    assert (a.model, a.max_model_len, a.block_size, a.max_num_seqs, a.max_num_batched_tokens) == (
        "some/model", 1024, 8, 4, 4096)
    assert (a.kv_cache_memory, a.swap_space, a.gpu_memory_utilization, a.served_model_name, a.seed) == (
        "2GiB", 2.0, 0.5, "m", 7)
    assert a.enable_prefix_caching is False and a.preemption_mode == "recompute"


def test_server_flags(monkeypatch, tmp_path):
    monkeypatch.setenv("PAGED_SERVE_API_KEY", "from-env")
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages }}")
    cli = parse_args(["--allowed-origins", '["http://a", "http://b"]', "--chat-template", str(template),
                      "--max-logprobs", "5", "--metrics-public", "--max-queued-requests", "10",
                      "--max-request-body-bytes", "1MiB"])
    s = cli.settings
    assert s.api_key == "from-env" and s.allowed_origins == ("http://a", "http://b")
    assert s.chat_template == "{{ messages }}" and s.max_logprobs == 5 and s.metrics_public
    assert s.max_queued_requests == 10 and s.max_request_body_bytes == 1024**2
    assert parse_args(["--api-key", "flag"]).settings.api_key == "flag"
    assert s.metrics_compat is None
    assert parse_args(["--metrics-compat", "vllm"]).settings.metrics_compat == "vllm"


def test_yaml_config_and_flag_precedence(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("port: 9001\nmax-model-len: 512\nblock_size: 32\napi-key: k\n")
    cli = parse_args(["--config", str(config), "--port", "9002"])
    assert cli.settings.port == 9002 and cli.settings.api_key == "k"
    assert cli.engine_args.max_model_len == 512 and cli.engine_args.block_size == 32


def test_shipped_config_parses():
    cli = parse_args(["--config", str(REPO / "configs/server.yaml")])
    assert cli.settings.port == 8000


def test_unknown_yaml_key_is_an_error(tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_text("prot: 1\n")
    with pytest.raises(SystemExit):
        parse_args(["--config", str(config)])
    assert "unknown setting 'prot'" in capsys.readouterr().err


def test_chunked_prefill_is_on_by_default_and_the_flag_turns_it_off():
    default = parse_args(["--max-model-len", "2048"]).engine_args
    assert default.enable_chunked_prefill is True
    config = default.create_engine_config()
    # the device's step budget (engine/core/config.py), below max_model_len
    budget = GPU_CHUNKED_BUDGET if config.device.type == "cuda" else CPU_CHUNKED_BUDGET
    assert (config.scheduler.enable_chunked_prefill, config.scheduler.max_num_batched_tokens) == (True, budget)
    off = parse_args(["--max-model-len", "2048", "--no-enable-chunked-prefill"]).engine_args
    assert off.enable_chunked_prefill is False
    assert off.create_engine_config().scheduler.max_num_batched_tokens == 2048  # a whole prompt per step
    flags = ["--max-model-len", "2048", "--max-num-batched-tokens", "64"]
    with pytest.raises(ValueError, match="must be at least max_model_len"):
        parse_args([*flags, "--no-enable-chunked-prefill"]).engine_args.create_engine_config()
    sched = parse_args(flags).engine_args.create_engine_config().scheduler
    assert (sched.enable_chunked_prefill, sched.max_num_batched_tokens, sched.max_model_len) == (True, 64, 2048)
    # never below max_num_seqs: every running sequence decodes each step
    many = parse_args(["--max-model-len", "2048", "--max-num-seqs", "300"]).engine_args
    assert many.create_engine_config().scheduler.max_num_batched_tokens == 300


def test_fused_ops_are_on_by_default_and_the_flag_turns_them_off():
    assert parse_args([]).engine_args.fused_ops is True
    off = parse_args(["--no-fused-ops"]).engine_args
    assert off.fused_ops is False
    assert off.create_engine_config().model.fused_ops is False


def test_step_time_targets_default_on_a_cpu_and_the_flags_set_or_turn_them_off():
    config = parse_args([]).engine_args.create_engine_config()
    on_cpu = config.device.type == "cpu"  # NOTE: off on a GPU (not measured there)
    assert (config.scheduler.target_itl_ms, config.scheduler.target_ttft_ms) == ((200.0, 1000.0) if on_cpu else (None, None))
    sched = parse_args(["--device", "cpu", "--target-itl-ms", "150", "--target-ttft-ms", "0"]).engine_args.create_engine_config().scheduler
    assert (sched.target_itl_ms, sched.target_ttft_ms) == (150.0, None)
    for off in (["--target-itl-ms", "0"], ["--no-enable-chunked-prefill"]):
        sched = parse_args(off).engine_args.create_engine_config().scheduler
        assert (sched.target_itl_ms, sched.target_ttft_ms) == (None, None)
    for bad in ("-1", "nan", "inf"):
        with pytest.raises(ValueError, match="target_itl_ms"):
            parse_args(["--target-itl-ms", bad]).engine_args.create_engine_config()


def test_scheduling_policy_flag_reaches_the_scheduler_and_bad_values_are_refused():
    assert parse_args([]).engine_args.create_engine_config().scheduler.scheduling_policy == "shortest-prompt"
    sched = parse_args(["--scheduling-policy", "fcfs"]).engine_args.create_engine_config().scheduler
    assert sched.scheduling_policy == "fcfs"
    with pytest.raises(SystemExit):
        parse_args(["--scheduling-policy", "random"])
    from engine.loop.engine_args import EngineArgs
    with pytest.raises(ValueError, match="scheduling_policy"):
        EngineArgs(model="tiny-4kv", load_format="dummy", scheduling_policy="lifo").create_engine_config()
