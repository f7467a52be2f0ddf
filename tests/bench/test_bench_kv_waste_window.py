"""benchmarks/kv_waste.py `window`: sliding-window blocks given back vs kept, on the real block
manager and scheduler, at a small Gemma-3-like shape (so that it runs in a second)."""

import json

from benchmarks import kv_waste
from benchmarks.kv_waste_window import WindowShape, run_window_comparison

SHAPE = WindowShape(layers=12, window=32, pattern=6, kv_heads=1, head_size=16, dtype_bytes=2)


def test_freeing_holds_fewer_bytes_per_sequence_and_fits_more():
    # 256-token context, blocks of 8: keep holds 12 layers x 32 blocks; free 2 full layers x 32
    # blocks plus 10 windowed layers x 4 blocks (positions 224.. hold all the next query sees:
    # 225..256) in groups of 2 layers.
    pool = 12 * 32 * 8 * 2 * 16 * 2 * 6  # six sequences' worth, kept
    report = run_window_comparison(SHAPE, 256, pool, block_size=8, num_requests=12, decode=16, budget=64)
    keep, free = report["runs"]
    assert (keep["groups"], keep["slots"], free["groups"], free["slots"]) == (1, 12, 6, 2)
    layer_block = 2 * 8 * 16 * 2  # K and V of one layer's block
    assert keep["bytes_per_seq"] == 12 * 32 * layer_block
    assert free["bytes_per_seq"] == (2 * 32 + 10 * 4) * layer_block
    assert keep["seqs_fit"] == 6 and free["seqs_fit"] > 2 * keep["seqs_fit"]
    assert free["run_peak_running"] > keep["run_peak_running"]
    assert report["bytes_saved"] > 0.6


def test_command_line(tmp_path, capsys):
    out = tmp_path / "w.json"
    assert kv_waste.main(["window", "--layers", "12", "--window", "32", "--head-size", "16", "--context", "256",
                          "--pool-gib", "0.001", "--block-size", "8", "--num-requests", "8", "--decode", "8",
                          "--budget", "64", "--json", str(out)]) == 0
    assert "free vs keep" in capsys.readouterr().out
    assert [r["mode"] for r in json.loads(out.read_text())["runs"]] == ["keep", "free"]
