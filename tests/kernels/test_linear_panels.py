"""The CPU fp32 panel GEMM (cuda_ext/csrc/cpu/linear.cpp) against F.linear in float64: every
row-tile remainder (1-6 rows past a multiple of 6), partial last panels (out_features not a
multiple of 16), strided and 3-D inputs, a bias; rows are independent (a NaN row stays in its
row); bad arguments are refused; opcheck on the ops. The gate/up product with SiLU * up as its
epilogue (linear_panels_silu_mul) against the same reference, and float for float against
linear_panels followed by silu_and_mul."""

from __future__ import annotations

import pytest
import torch

from cuda_ext import ops
from engine.worker.models.linear_kernel import PanelWeight
from tests.kernels.kernel_cases import require_compiled

pytestmark = pytest.mark.skipif(
    not (ops.backend() != "reference" and ops.linear_panels_available()),
    reason="the panel kernel needs the compiled ops built for a CPU with AVX2 and FMA",
)


@pytest.fixture(scope="module", autouse=True)
def compiled() -> None:
    require_compiled()


def reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    y = x.double() @ w.double().T
    return (y if bias is None else y + bias.double()).float()


@pytest.mark.parametrize("rows", [0, 1, 2, 5, 6, 7, 12, 13, 16, 100])
@pytest.mark.parametrize(("out_features", "in_features"), [(1, 1), (15, 8), (16, 64), (17, 33), (960, 576),
                                                           (40, 1536)])
def test_matches_f_linear(rows, out_features, in_features):
    gen = torch.Generator().manual_seed(rows * 1000 + out_features)
    w = torch.randn(out_features, in_features, generator=gen)
    x = torch.randn(rows, in_features, generator=gen)
    packed = ops.linear_pack(w)
    assert packed.shape == (-(-out_features // 16), in_features, 16)
    got = ops.linear_panels(x, packed, out_features)
    assert got.shape == (rows, out_features)
    torch.testing.assert_close(got, reference(x, w), rtol=1e-5, atol=1e-4)


def test_strided_and_batched_inputs_and_a_bias():
    gen = torch.Generator().manual_seed(1)
    w, bias = torch.randn(33, 40, generator=gen), torch.randn(33, generator=gen)
    packed = ops.linear_pack(w)
    wide = torch.randn(9, 64, generator=gen)
    x = wide[:, 5:45]  # rows 64 floats apart
    assert x.stride() == (64, 1)
    torch.testing.assert_close(ops.linear_panels(x, packed, 33, bias), reference(x, w, bias), rtol=1e-5, atol=1e-4)
    x3 = torch.randn(2, 7, 40, generator=gen)
    got = ops.linear_panels(x3, packed, 33)
    assert got.shape == (2, 7, 33)
    torch.testing.assert_close(got, reference(x3.view(14, 40), w).view(2, 7, 33), rtol=1e-5, atol=1e-4)
    xt = torch.randn(40, 9, generator=gen).T  # last dim not contiguous: copied first
    torch.testing.assert_close(ops.linear_panels(xt, packed, 33), reference(xt, w), rtol=1e-5, atol=1e-4)


def test_rows_are_independent():
    """One request's NaN or huge activations never reach another row (rows share no sums)."""
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(50, 24, generator=gen)
    x = torch.randn(13, 24, generator=gen)
    x[3] = float("nan")
    x[8] = 3e38
    got = ops.linear_panels(x, ops.linear_pack(w), 50)
    assert got[3].isnan().all()
    others = [r for r in range(13) if r not in (3, 8)]
    torch.testing.assert_close(got[others], reference(x[others], w), rtol=1e-5, atol=1e-4)


def test_bad_arguments_are_refused():
    w = torch.randn(20, 8)
    packed = ops.linear_pack(w)
    with pytest.raises(RuntimeError, match="linear_pack: weight must be a 2-D float32"):
        ops.linear_pack(w.bfloat16())
    with pytest.raises(RuntimeError, match=r"x must be a float32 CPU \[rows, 8\]"):
        ops.linear_panels(torch.randn(3, 9), packed, 20)
    with pytest.raises(RuntimeError, match=r"x must be a float32 CPU \[rows, 8\]"):
        ops.linear_panels(torch.randn(3, 8).bfloat16(), packed, 20)
    with pytest.raises(RuntimeError, match="out_features 33 does not match 2 panels"):
        ops.linear_panels(torch.randn(3, 8), packed, 33)
    with pytest.raises(RuntimeError, match="packed must come from linear_pack"):
        ops.linear_panels(torch.randn(3, 8), w, 20)


def test_opcheck():
    lib = ops.compiled_library()
    w, x = torch.randn(20, 8), torch.randn(5, 8)
    torch.library.opcheck(lib.linear_pack.default, (w,))
    torch.library.opcheck(lib.linear_panels.default, (x, ops.linear_pack(w), 20))


def pair_pack(w: torch.Tensor) -> torch.Tensor:
    """[gate | up] packed with the halves' 16-row groups alternating (zero-padded per half), as
    the model packs it."""
    return PanelWeight.pack(w, silu_pairs=True).panels


@pytest.mark.parametrize("rows", [0, 1, 5, 6, 7, 13, 64])
@pytest.mark.parametrize(("half", "in_features"), [(1, 3), (16, 8), (37, 20), (1536 // 8, 576)])
def test_silu_mul_epilogue(rows, half, in_features):
    gen = torch.Generator().manual_seed(rows * 100 + half)
    w = torch.randn(2 * half, in_features, generator=gen) / in_features**0.5  # products of size ~1
    x = torch.randn(rows, in_features, generator=gen)
    got = ops.linear_panels_silu_mul(x, pair_pack(w), half)
    assert got.shape == (rows, half)
    g, u = (x.double() @ w.double().T).split(half, dim=-1)
    torch.testing.assert_close(got, (torch.nn.functional.silu(g) * u).float(), rtol=1e-5, atol=1e-4)
    # the same floats as the two-pass path (the same sums, then silu_and_mul's expression)
    separate = ops.silu_and_mul(ops.linear_panels(x, ops.linear_pack(w), 2 * half))
    assert torch.equal(got, separate)


def test_silu_mul_epilogue_refuses_bad_arguments():
    w = torch.randn(40, 8)
    packed = pair_pack(w)  # 2 pairs of panels
    with pytest.raises(RuntimeError, match="linear_panels_silu_mul: out_features 33 does not match 2 panels"):
        ops.linear_panels_silu_mul(torch.randn(3, 8), packed, 33)
    with pytest.raises(RuntimeError, match=r"packed must come from linear_pack \(of a \[gate \| up\] weight in pairs"):
        ops.linear_panels_silu_mul(torch.randn(3, 8), ops.linear_pack(torch.randn(48, 8)), 20)
    with pytest.raises(RuntimeError, match=r"x must be a float32 CPU \[rows, 8\]"):
        ops.linear_panels_silu_mul(torch.randn(3, 9), packed, 20)
    torch.library.opcheck(ops.compiled_library().linear_panels_silu_mul.default, (torch.randn(5, 8), packed, 20))
