"""Part (b) of the KV-waste study on the real engine, tiny: dummy weights of a 2-layer Llama,
a 256-token context, 24 skewed requests, the same 32 KV blocks for both modes."""

import json
import random

import pytest

from benchmarks import kv_waste
from benchmarks.workload import sample_lengths
from engine.loop.engine_args import EngineArgs

TINY_LLAMA = {
    "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
    "bos_token_id": 1, "eos_token_id": 2,
}
MAX_LEN, BLOCK, NUM_BLOCKS = 256, 16, 32  # 32 blocks = 2 max-length sequences


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory):
    path = tmp_path_factory.mktemp("models") / "tiny-llama.json"
    path.write_text(json.dumps(TINY_LLAMA))
    return str(path)


@pytest.fixture(scope="module")
def report(tiny_config):
    args = EngineArgs(model=tiny_config, load_format="dummy", device="cpu", max_model_len=MAX_LEN,
                      block_size=BLOCK, num_gpu_blocks_override=NUM_BLOCKS, max_num_seqs=256,
                      enable_prefix_caching=False, swap_space=0.01)
    lengths = sample_lengths(24, random.Random(0), MAX_LEN)
    return {r["kv_allocation"]: r for r in kv_waste.run_engine_comparison(args, lengths, 4)["results"]}


def test_same_budget_both_modes(report):
    assert report["reserve"]["num_kv_blocks"] == report["paged"]["num_kv_blocks"] == NUM_BLOCKS
    assert report["reserve"]["num_requests"] == report["paged"]["num_requests"] == 24


def test_paging_wastes_less_and_fits_more(report):
    reserve, paged = report["reserve"], report["paged"]
    assert paged["time_avg_waste"] < reserve["time_avg_waste"]
    assert paged["time_avg_unwritten"] < reserve["time_avg_unwritten"]
    assert paged["peak_running_seqs"] >= reserve["peak_running_seqs"]
    # reserve holds max_model_len per sequence: the budget fits exactly two
    assert reserve["peak_running_seqs"] == NUM_BLOCKS * BLOCK // MAX_LEN
    assert reserve["time_avg_waste"] > 0.5
    assert paged["peak_running_seqs"] > 2 * reserve["peak_running_seqs"]


def test_throughput_and_latency_are_reported(report):
    for r in report.values():
        assert r["request_throughput"] > 0 and r["output_throughput"] > 0
        for key in ("ttft", "e2e"):
            lat = r["latency_ms"][key]
            assert 0 < lat["p50"] <= lat["p99"]


def test_cli_writes_table_json_and_plot(tiny_config, tmp_path, capsys):
    out_json, out_png = tmp_path / "e.json", tmp_path / "e.png"
    rc = kv_waste.main(["engine", "--model", tiny_config, "--load-format", "dummy",
                        "--max-model-len", str(MAX_LEN), "--reserve-seqs", "2", "--num-requests", "8",
                        "--max-tokens", "2", "--swap-space", "0.01", "--json", str(out_json), "--plot", str(out_png)])
    assert rc == 0
    report = json.loads(out_json.read_text())
    assert [r["kv_allocation"] for r in report["results"]] == ["reserve", "paged"]
    assert report["params"]["num_kv_blocks"] == NUM_BLOCKS
    assert out_png.read_bytes().startswith(b"\x89PNG")
    assert "peak concurrent sequences" in capsys.readouterr().out


def test_workload_lengths_are_exact():
    lengths = [2, 9, 40, 200]
    fixed = kv_waste.engine_workload(lengths, 8, 512, seed=0)
    assert [len(p) + n for p, n in fixed] == lengths
    assert [n for _, n in fixed] == [1, 8, 8, 8]
    decode_heavy = kv_waste.engine_workload(lengths, None, 512, seed=0, output_fraction=0.75)
    assert [len(p) + n for p, n in decode_heavy] == lengths
    assert [n for _, n in decode_heavy] == [1, 7, 30, 150]
    assert kv_waste.engine_workload(lengths, 8, 512, seed=0) == fixed  # seeded
