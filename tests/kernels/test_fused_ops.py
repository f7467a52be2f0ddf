"""The model's fused elementwise CPU ops (cuda_ext/csrc/cpu/fused.cpp: residual add + RMSNorm,
rotary embedding, SiLU x up) against their pure-torch references (cuda_ext/reference.py, what
the layers ran before): float32 to a few ulp, bf16 / fp16 to one rounding of the result; in
place where the contract says so and nowhere else; bad arguments refused, never read out of
bounds."""

from __future__ import annotations

import pytest
import torch

from cuda_ext import ops, reference
from tests.kernels.kernel_cases import require_compiled

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@pytest.fixture(scope="module", autouse=True)
def compiled() -> None:
    require_compiled()


def tol(dtype: torch.dtype) -> dict:
    # fp32: summation order and FMA contraction; reduced precision: one rounding of the result
    # (a float32 statistic a few ulp apart can round an output to the neighbouring value).
    return {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1e-2, atol=1e-2),
            torch.float16: dict(rtol=2e-3, atol=2e-3)}[dtype]


def assert_close(got, want, dtype):
    torch.testing.assert_close(got.float(), want.float(), **tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [0, 1, 16, 33, 257])
def test_rms_norm_matches_reference(dtype, rows):
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 576, generator=gen) * 3).to(dtype)
    w = torch.randn(576, generator=gen).to(dtype)
    got, got_res = ops.rms_norm(x, w, 1e-5)
    want, want_res = reference.rms_norm(x, w, 1e-5)
    assert_close(got, want, dtype)
    assert got_res is x and want_res is x  # the residual of a first layer is its input


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 16, 64, 300])
def test_fused_add_rms_norm_writes_the_sum_and_the_norm_in_place(dtype, rows):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 960, generator=gen).to(dtype)
    residual = (torch.randn(rows, 960, generator=gen) * 10).to(dtype)
    w = torch.randn(960, generator=gen).to(dtype)
    want, want_res = reference.rms_norm(x, w, 1e-6, residual)
    x_in, res_in = x.clone(), residual.clone()
    got, got_res = ops.rms_norm(x_in, w, 1e-6, res_in)
    assert got is x_in and got_res is res_in
    torch.testing.assert_close(got_res, want_res, rtol=0, atol=0)  # one rounded add, as torch's
    assert_close(got, want, dtype)


def test_bf16_sums_round_to_nearest_even_as_torch_does():
    """The residual sum is the kernels' bf16 narrowing seen bare (cuda_ext/csrc/cpu/dtype_cvt.h):
    ties to even both ways, overflow to inf, infinities and NaN carried, as torch rounds."""
    one, half_ulp, ulp = 1.0, 2.0**-8, 2.0**-7  # bf16 keeps 7 fraction bits
    big = torch.finfo(torch.bfloat16).max
    pairs = [(one, half_ulp), (one + ulp, half_ulp), (-one, -half_ulp), (-(one + ulp), -half_ulp),
             (one, half_ulp * 1.5), (one, -half_ulp / 2), (big, big), (-big, -big), (float("inf"), 1.0),
             (float("-inf"), -big), (float("inf"), float("-inf")), (float("nan"), 1.0), (0.0, -0.0),
             (-0.0, -0.0), (1e-40, 1e-40), (3.0, -3.0)]
    gen = torch.Generator().manual_seed(0)
    a = torch.tensor([p[0] for p in pairs] * 4, dtype=torch.float32)
    b = torch.tensor([p[1] for p in pairs] * 4, dtype=torch.float32)
    # NOTE: x and residual are bf16, so a half-ulp addend must itself be a bf16 value
    rand = torch.randn(2, 960 - a.numel(), generator=gen) * torch.logspace(-30, 30, 960 - a.numel())
    x = torch.cat([a, rand[0]]).to(torch.bfloat16)[None].repeat(3, 1)
    residual = torch.cat([b, rand[1]]).to(torch.bfloat16)[None].repeat(3, 1)
    want = (x.float() + residual.float()).to(torch.bfloat16)
    ops.rms_norm(x.clone(), torch.ones(960, dtype=torch.bfloat16), 1e-6, residual)
    torch.testing.assert_close(residual, want, rtol=0, atol=0, equal_nan=True)
    bits = residual.view(torch.int16)[0, :4].tolist()
    assert bits == [0x3F80, 0x3F82, -0x4080, -0x407E]  # 1.0 and 1 + 2 ulp: the even neighbours


def test_rms_norm_extremes():
    # all zeros (eps alone keeps it finite), huge and tiny rows, a NaN confined to its row
    x = torch.zeros(4, 64)
    x[1] = 1e30
    x[2] = 1e-30
    x[3, 5] = float("nan")
    w = torch.ones(64)
    got, _ = ops.rms_norm(x, w, 1e-5)
    want, _ = reference.rms_norm(x, w, 1e-5)
    torch.testing.assert_close(got[:3], want[:3], rtol=1e-5, atol=1e-5)
    assert got[3].isnan().all() and want[3].isnan().all()


def qkv_views(qkv: torch.Tensor, heads: int, kv_heads: int, d: int):
    T = qkv.shape[0]
    q = qkv[:, : heads * d].view(T, heads, d)
    k = qkv[:, heads * d : (heads + kv_heads) * d].view(T, kv_heads, d)
    return q, k


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("table_dtype", ["float32", "same"])
@pytest.mark.parametrize("tokens,heads,kv_heads,d", [(1, 9, 3, 64), (16, 8, 4, 32), (70, 4, 2, 128), (0, 2, 1, 8)])
def test_rotary_matches_reference_in_place_on_qkv_views(dtype, table_dtype, tokens, heads, kv_heads, d):
    gen = torch.Generator().manual_seed(tokens * 7 + d)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=gen).to(dtype)
    cos, sin = torch.randn(100, d, generator=gen), torch.randn(100, d, generator=gen)
    if table_dtype == "same":
        cos, sin = cos.to(dtype), sin.to(dtype)
    positions = torch.randint(0, 100, (tokens,), generator=gen)
    want, got = qkv.clone(), qkv.clone()
    reference.rotary_embedding(positions, *qkv_views(want, heads, kv_heads, d), cos, sin)
    ops.rotary_embedding(positions, *qkv_views(got, heads, kv_heads, d), cos, sin)
    assert_close(got, want, dtype)
    v = slice((heads + kv_heads) * d, None)
    assert torch.equal(got[:, v], qkv[:, v])  # v untouched


def test_rotary_refuses_a_position_outside_its_table():
    q, k = torch.zeros(2, 2, 8), torch.zeros(2, 1, 8)
    cos = sin = torch.zeros(10, 8)
    for bad in (10, -1):
        with pytest.raises(RuntimeError, match="outside"):
            ops.rotary_embedding(torch.tensor([0, bad]), q, k, cos, sin)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [0, 1, 16, 100])
def test_silu_and_mul_matches_reference(dtype, rows):
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 2 * 1536, generator=gen) * 4).to(dtype)
    assert_close(ops.silu_and_mul(x), reference.silu_and_mul(x), dtype)


def test_silu_and_mul_extremes():
    gate = torch.tensor([[-1e4, -100.0, -88.0, -20.0, 0.0, 20.0, 88.0, 100.0, 1e4]])
    x = torch.cat([gate, torch.full_like(gate, 3.0)], dim=1)
    got, want = ops.silu_and_mul(x), reference.silu_and_mul(x)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-30)
    assert got.isfinite().all()


def test_bad_arguments_are_refused():
    lib = torch.ops.paged_serve
    x = torch.zeros(4, 8)
    with pytest.raises(RuntimeError, match="weight"):
        lib.rms_norm(torch.empty_like(x), x, torch.ones(7), 1e-5)
    with pytest.raises(RuntimeError, match="weight"):
        lib.rms_norm(torch.empty_like(x), x, torch.ones(8, dtype=torch.float64), 1e-5)
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        x64 = torch.zeros(4, 8, dtype=torch.float64)
        lib.rms_norm(torch.empty_like(x64), x64, torch.ones(8, dtype=torch.float64), 1e-5)
    with pytest.raises(RuntimeError, match="shape"):
        lib.fused_add_rms_norm(x, torch.zeros(3, 8), torch.ones(8), 1e-5)
    with pytest.raises(RuntimeError, match="contiguous"):
        lib.rms_norm(torch.empty(8, 4).t(), torch.zeros(8, 4).t(), torch.ones(8), 1e-5)
    with pytest.raises(RuntimeError, match="out"):
        lib.silu_and_mul(torch.empty(4, 3), x)
    with pytest.raises(RuntimeError, match="even"):
        lib.rotary_embedding(torch.tensor([0]), torch.zeros(1, 1, 7), torch.zeros(1, 1, 7), torch.zeros(4, 7),
                             torch.zeros(4, 7))
    with pytest.raises(RuntimeError, match="query"):
        lib.rotary_embedding(torch.tensor([0, 1]), torch.zeros(1, 1, 8), torch.zeros(2, 1, 8), torch.zeros(4, 8),
                             torch.zeros(4, 8))


def test_wrappers_take_the_torch_path_where_the_kernel_does_not_apply():
    # a 3-D input, float64, or compiled=False: the reference's result, inputs untouched
    x3 = torch.randn(2, 3, 8)
    got, _ = ops.rms_norm(x3, torch.ones(8), 1e-5)
    torch.testing.assert_close(got, reference.rms_norm(x3, torch.ones(8), 1e-5)[0])
    x64, r64 = torch.randn(4, 8, dtype=torch.float64), torch.randn(4, 8, dtype=torch.float64)
    before = x64.clone()
    ops.rms_norm(x64, torch.ones(8, dtype=torch.float64), 1e-5, r64)
    assert torch.equal(x64, before)
    x, r = torch.randn(4, 8), torch.randn(4, 8)
    before = x.clone()
    out, _ = ops.rms_norm(x, torch.ones(8), 1e-5, r, compiled=False)
    assert torch.equal(x, before) and out is not x


def test_opcheck():
    lib = torch.ops.paged_serve
    x, r, w = torch.randn(5, 16), torch.randn(5, 16), torch.randn(16)
    torch.library.opcheck(lib.rms_norm.default, (torch.empty_like(x), x, w, 1e-5))
    torch.library.opcheck(lib.fused_add_rms_norm.default, (x.clone(), r.clone(), w, 1e-5))
    torch.library.opcheck(lib.silu_and_mul.default, (torch.empty(5, 8), x))
    q, k = torch.randn(5, 2, 16), torch.randn(5, 1, 16)
    torch.library.opcheck(lib.rotary_embedding.default,
                          (torch.arange(5), q, k, torch.randn(8, 16), torch.randn(8, 16)))
