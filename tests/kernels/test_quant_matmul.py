"""The quantized products over GGUF blocks (cuda_ext/csrc/cpu/quant_*.cpp) against the float64
reference (cuda_ext/reference.py: gguf's dequantized weights times the activations quantized
as the kernels quantize them): every type, row counts 1-64 (every row-tile remainder), N off
the 16-row panels, mixed-type segments, a bias, bf16 inputs, the SiLU * up product, embedding
rows; dequantize is gguf.quants.dequantize bit for bit; quantize_weight round-trips; bad
inputs are refused with a message. The same cases run on the AVX2 path (an x86-64-v3 build)
and the portable loops (an x86-64-v2 build), each in its own cached library."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from cuda_ext import build, ops, reference
from tests.kernels.kernel_cases import require_compiled

REPO = Path(__file__).resolve().parents[2]
LEGACY = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1")
K_TYPES = ("q4_k", "q5_k", "q6_k")
ROWS = (1, 2, 3, 5, 17, 64)


@pytest.fixture(scope="module", autouse=True)
def compiled() -> None:
    require_compiled()


def random_blocks(qtype: str, rows: int, k: int, seed: int) -> torch.Tensor:
    """ggml blocks [rows, row_bytes]: gguf's quantizer over random weights for the legacy
    types; random bytes with small positive fp16 scales for the K types (every quant, scale and
    min value appears)."""
    gen = np.random.default_rng(seed)
    block, nbytes = reference.quant_block(qtype)
    if qtype in LEGACY:
        w = gen.standard_normal((rows, k)).astype(np.float32)
        w[0, :block] = 0  # an all-zero block: d = 0
        return reference.quantize_ggml(torch.from_numpy(w), qtype)
    nb = k // block
    b = gen.integers(0, 256, size=(rows, nb, nbytes), dtype=np.uint8)

    def f16(lo: float, hi: float) -> np.ndarray:
        return gen.uniform(lo, hi, (rows, nb)).astype(np.float16).view(np.uint8).reshape(rows, nb, 2)

    if qtype == "q6_k":
        b[..., 208:210] = f16(5e-4, 2e-3)
    else:
        b[..., 0:2], b[..., 2:4] = f16(1e-3, 1e-2), f16(1e-3, 1e-2)
    return torch.from_numpy(b.reshape(rows, nb * nbytes))


def abs_bound(x: torch.Tensor, parts) -> torch.Tensor:
    """|A| |W|^T in float64 (A the quantized activations): the size of the sums, for the fp32
    accumulation's tolerance."""
    return torch.cat([_abs_product(x, p, q) for p, q in parts], dim=-1)


def _abs_product(x: torch.Tensor, data: torch.Tensor, qtype: str) -> torch.Tensor:
    block = 256 if qtype in K_TYPES else 32
    q, d = reference.quantize_activations(x.reshape(-1, x.shape[-1]), block, block == 32)
    a = (q.double().view(q.shape[0], -1, block) * d.double()[..., None]).view(q.shape)
    return a.abs() @ reference.dequantize_ggml(data, qtype).double().abs().T


def check_product(got: torch.Tensor, x: torch.Tensor, parts, bias=None) -> None:
    """Tight: the float64 reference with the same activation quantization, to fp32 summation
    (1e-5 of the sum of |terms|). Loose: the plain float64 product of x and gguf's weights, to
    the activations' int8 rounding (2% in norm)."""
    want = reference.quant_matmul_ggml(x, parts, bias)
    err = (got.double() - want).abs()
    bound = 1e-5 * abs_bound(x, parts) + 1e-6
    assert bool((err <= bound).all()), f"max error {err.max():.3g}, worst ratio {(err / bound).max():.3g}"
    w = torch.cat([reference.dequantize_ggml(p, q) for p, q in parts]).double()
    exact = x.double() @ w.T + (0 if bias is None else bias.double())
    assert (got.double() - exact).norm() <= 0.02 * exact.norm()


def run_case(qtype: str, rows: int, n: int, k: int) -> None:
    data = random_blocks(qtype, n, k, seed=rows * 7919 + n)
    packed = ops.quant_pack([(data, qtype)])
    assert ops.quant_info(packed) == (n, k, [(qtype, n)])
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    got = ops.quant_matmul(x, packed)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    check_product(got, x, [(data, qtype)])


SHAPES = {**{q: ((40, 64), (19, 96)) for q in LEGACY}, **{q: ((40, 256), (21, 512)) for q in K_TYPES}}


def run_all_cases() -> None:
    """Every type x row count x shape (also what the other ISA builds run)."""
    for qtype, shapes in SHAPES.items():
        for n, k in shapes:
            for rows in ROWS:
                run_case(qtype, rows, n, k)
    test_mixed_segments_bias_and_bf16()
    test_silu_mul()
    test_dequantize_and_embedding_are_gguf_floats("q6_k")


@pytest.mark.parametrize("qtype", LEGACY + K_TYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_product_matches_the_float64_reference(qtype, rows):
    for n, k in SHAPES[qtype]:
        run_case(qtype, rows, n, k)


def mixed_parts() -> list[tuple[torch.Tensor, str]]:
    """A merged product of three segments and both activation kinds (K = 512 suits them all)."""
    return [(random_blocks("q4_k", 20, 512, 1), "q4_k"), (random_blocks("q6_k", 13, 512, 2), "q6_k"),
            (random_blocks("q8_0", 7, 512, 3), "q8_0"), (random_blocks("q4_1", 16, 512, 4), "q4_1"),
            (random_blocks("q5_0", 9, 512, 11), "q5_0"), (random_blocks("q5_1", 3, 512, 12), "q5_1")]


def test_mixed_segments_bias_and_bf16():
    parts = mixed_parts()
    packed = ops.quant_pack(parts)
    assert ops.quant_info(packed) == (68, 512, [("q4_k", 20), ("q6_k", 13), ("q8_0", 7), ("q4_1", 16), ("q5_0", 9),
                                                ("q5_1", 3)])
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 3, 512, generator=gen)  # any leading shape
    bias = torch.randn(68, generator=gen)
    got = ops.quant_matmul(x, packed, bias)
    assert got.shape == (2, 3, 68)
    check_product(got.view(6, 68), x.view(6, 512), parts, bias)
    wide = torch.randn(5, 600, generator=gen)[:, 40:552]  # rows 600 floats apart
    check_product(ops.quant_matmul(wide, packed), wide, parts)
    xb = x.view(6, 512).bfloat16()
    got = ops.quant_matmul(xb, packed, bias.bfloat16())
    assert got.dtype == torch.bfloat16
    want = ops.quant_matmul(xb.float(), packed, bias.bfloat16().float())  # the same ints, fp32 out
    torch.testing.assert_close(got, want.bfloat16(), rtol=0, atol=0)
    assert ops.quant_matmul(torch.empty(0, 512), packed).shape == (0, 68)


def test_silu_mul():
    half = 40
    parts = [(random_blocks("q4_k", half, 256, 6), "q4_k"), (random_blocks("q6_k", half, 256, 7), "q6_k")]
    packed = ops.quant_pack(parts)
    for rows in (1, 5, 17):
        x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows))
        got = ops.quant_silu_mul(x, packed)
        assert got.shape == (rows, half)
        gate, up = ops.quant_matmul(x, packed).split(half, dim=-1)
        torch.testing.assert_close(got, torch.nn.functional.silu(gate) * up, rtol=1e-6, atol=1e-6)
        g, u = reference.quant_matmul_ggml(x, parts).split(half, dim=-1)
        torch.testing.assert_close(got.double(), torch.nn.functional.silu(g) * u, rtol=1e-4, atol=1e-4)
    xb = torch.randn(3, 256).bfloat16()
    assert ops.quant_silu_mul(xb, packed).dtype == torch.bfloat16


@pytest.mark.parametrize("qtype", LEGACY + K_TYPES)
def test_dequantize_and_embedding_are_gguf_floats(qtype):
    k = 512
    data = random_blocks(qtype, 37, k, 8)
    packed = ops.quant_pack([(data, qtype)])
    want = reference.dequantize_ggml(data, qtype)
    assert torch.equal(ops.quant_dequantize(packed), want)
    ids = torch.tensor([36, 0, 17, 17, 5])
    assert torch.equal(ops.quant_embedding(packed, ids), want[ids])
    with pytest.raises(RuntimeError, match="quant_embedding: id 37 .at 1. outside the weight's 37 rows"):
        ops.quant_embedding(packed, torch.tensor([3, 37]))


# Round trip error of quantize_weight on N(0, 1) weights, as a share of their RMS; measured
# (2048 x 2048): q8_0 0.0053, q4_0 0.086, q4_1 0.078, q5_0 0.043, q5_1 0.038 (ggml's quantizers),
# q4_k 0.074, q5_k 0.037, q6_k 0.019 (quant_quantize.cpp's fits).
ROUND_TRIP = {"q8_0": 0.006, "q4_0": 0.095, "q4_1": 0.085, "q5_0": 0.047, "q5_1": 0.042, "q4_k": 0.08, "q5_k": 0.041,
              "q6_k": 0.021}


@pytest.mark.parametrize("qtype", LEGACY + K_TYPES)
def test_quantize_weight_round_trips(qtype):
    w = torch.randn(48, 512, generator=torch.Generator().manual_seed(9))
    w[3] = 0  # all-zero rows quantize to zeros
    w[4, :256] *= 100  # one large block
    packed = ops.quantize_weight(w, qtype)
    back = ops.quant_dequantize(packed)
    assert back.shape == w.shape and bool((back[3] == 0).all())
    others = torch.cat([w[:4], w[5:]])
    rel = (torch.cat([back[:4], back[5:]]) - others).norm() / others.norm()
    assert rel < ROUND_TRIP[qtype], rel
    if qtype in LEGACY:  # ggml's reference quantizers, byte for byte
        assert torch.equal(ops.quantize_ggml(w, qtype), reference.quantize_ggml(w, qtype))


def test_bad_inputs_are_refused():
    data = random_blocks("q4_k", 20, 256, 10)
    packed = ops.quant_pack([(data, "q4_k")])
    x = torch.randn(2, 256)
    with pytest.raises(ValueError, match="'q3_k' is not one of"):
        ops.quant_pack([(data, "q3_k")])
    with pytest.raises(RuntimeError, match="part 0 .q6_k. has 144 bytes per row, not a whole number of q6_k's 210"):
        ops.quant_pack([(data, "q6_k")])
    with pytest.raises(RuntimeError, match="part 1 .q8_0. holds rows of K = 512, part 0 of K = 256"):
        ops.quant_pack([(data, "q4_k"), (random_blocks("q8_0", 3, 512, 1), "q8_0")])
    with pytest.raises(RuntimeError, match="part 0 .q4_k. must be a 2-D uint8"):
        ops.quant_pack([(data.view(torch.int8), "q4_k")])
    with pytest.raises(RuntimeError, match="x must be a float32 or bfloat16"):
        ops.quant_matmul(x.double(), packed)
    with pytest.raises(RuntimeError, match="x has 255 columns, the packed weight K = 256"):
        ops.quant_matmul(torch.randn(2, 255), packed)
    with pytest.raises(RuntimeError, match="bias must be a 1-D CPU tensor of N = 20"):
        ops.quant_matmul(x, packed, torch.randn(21))
    with pytest.raises(RuntimeError, match="odd N = 21"):
        ops.quant_silu_mul(x, ops.quant_pack([(random_blocks("q4_k", 21, 256, 1), "q4_k")]))
    bad = packed.clone()
    bad[0] ^= 1
    with pytest.raises(RuntimeError, match="does not start with quant_pack's magic"):
        ops.quant_matmul(x, bad)
    with pytest.raises(ValueError, match="magic"):
        ops.quant_info(bad)
    with pytest.raises(RuntimeError, match="disagree with the tensor's"):
        ops.quant_matmul(x, packed[:-64].clone())
    bad = packed.clone()
    bad[8 * 9: 8 * 10] = torch.tensor([19], dtype=torch.int64).view(torch.uint8)  # segment rows 20 -> 19
    with pytest.raises(RuntimeError, match="packed segments cover 19 rows and 4864 bytes, the header says 20"):
        ops.quant_matmul(x, bad)
    bad = packed.clone()
    bad[8 * 8: 8 * 9] = torch.tensor([10], dtype=torch.int64).view(torch.uint8)  # a type id not served (q2_k)
    with pytest.raises(RuntimeError, match="ggml type id 10, not a served type"):
        ops.quant_dequantize(bad)
    with pytest.raises(RuntimeError, match="packed must be the contiguous 1-D uint8"):
        ops.quant_matmul(x, packed.view(-1, 64))
    with pytest.raises(RuntimeError, match="layout 1 .ggml rows, packed by the pure-torch reference"):
        ops.quant_matmul(x, reference.quant_pack([(data, "q4_k")]))


def test_reference_fallback_reads_its_own_packing():
    """Without the compiled library, ops falls back to these: the same header, ggml's rows."""
    parts = mixed_parts()
    packed = reference.quant_pack(parts)
    assert reference.quant_info(packed) == ops.quant_info(ops.quant_pack(parts))
    x = torch.randn(3, 512)
    torch.testing.assert_close(reference.quant_matmul(x, packed), ops.quant_matmul(x, ops.quant_pack(parts)),
                               rtol=1e-5, atol=1e-4)
    assert torch.equal(reference.quant_dequantize(packed), ops.quant_dequantize(ops.quant_pack(parts)))


ISA_RUN = """
import sys, torch
sys.path.insert(0, {repo!r})
from cuda_ext import build, ops
from tests.kernels import test_quant_matmul as t
assert ops.backend() == "cpu"
print(ops.quant_isa())
t.run_all_cases()
print(build.load("cpu"))
"""


@pytest.mark.parametrize(("arch", "isa"), [
    pytest.param("x86-64-v3", "avx2", marks=pytest.mark.skipif(
        not {"avx2", "fma", "f16c", "avx512_vnni"} <= (build._cpuinfo_flags() or set()),
        reason="the native build already is the AVX2 path (or this CPU cannot run it)")),
    pytest.param("portable", "portable", marks=pytest.mark.skipif(
        build.PORTABLE_MARCH.get(__import__("platform").machine().lower()) != "x86-64-v2", reason="x86-64 only")),
])
def test_other_instruction_sets(arch, isa, portable_ext_cache):
    """The native build of an AVX-512 VNNI CPU runs the VNNI kernels; the AVX2 path and the
    portable loops run the same cases in builds for x86-64-v3 and x86-64-v2 (cached; the
    portable one in the session's portable cache, which test_ops_backend may have filled)."""
    env = {**os.environ, build.CPU_ARCH_ENV: arch, "PAGED_SERVE_OPS": "compiled"}
    if arch == "portable":
        env["PAGED_SERVE_EXT_CACHE"] = str(portable_ext_cache)
    result = subprocess.run([sys.executable, "-c", ISA_RUN.format(repo=str(REPO))], env=env, capture_output=True,
                            text=True, timeout=900, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    assert lines[0] == isa and lines[-1].endswith(build.source_hash("cpu", arch))
