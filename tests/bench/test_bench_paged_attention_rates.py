"""benchmarks/kernels/bench_paged_attention.py --bandwidth: its read-rate figures on a small
shape are consistent (GB/s from the bytes and the time; a share of sum()'s rate)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.kernels.bench_paged_attention import BANDWIDTH_SHAPES, Shape, read_rates


def test_read_rates_of_a_small_shape():
    shape = Shape(2, 64, 4, 2, 32, 16, torch.float32)
    (row,) = read_rates([shape], rounds=2, iters=2, sum_mib=8, pool_mib=1)
    assert row["shape"] is shape and row["ms"] > 0 and row["pct_of_sum"] > 0
    assert row["gbps"] == pytest.approx(shape.kv_bytes() / row["ms"] / 1e6)


def test_the_bandwidth_shapes_are_the_issues_three_head_sizes_in_two_dtypes():
    assert sorted({(s.head_size, s.dtype) for s in BANDWIDTH_SHAPES}, key=str) == sorted(
        {(d, t) for d in (32, 64, 128) for t in (torch.float32, torch.bfloat16)}, key=str)
