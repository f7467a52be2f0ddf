"""quant_matmul micro-benchmark: products over GGUF blocks kept as stored, against fp32 and the
libraries torch ships, on the linear layers of SmolLM2-135M (the default model: Q4_1, its Q8_0
embedding as the tied LM head), SmolLM2-1.7B (Q4_K_M: q4_k, q6_k) and SmolLM2-360M (its Q4_K_M file
holds q5_0 where 960-wide rows are not whole K-quant blocks; q5_1 in a Q5_K_M file).

Decode (M = 1, --decode): weight bytes read per second, as a share of a plain `sum()` over 512
MiB measured in the same rounds (the machine's read rate right then; a shared VM moves 20%
from minute to minute), and the time against fp32 `ops.linear_panels` and `F.linear` on the
same shape. Every candidate's calls rotate over copies of its weight, >= 256 MiB in all, so
they read from DRAM as a model's layers do, not from L3 (32 MiB on the Zen 4 / 5 EPYCs).

Prefill (M = 16, 64, 256, --prefill): GFLOP/s against the same fp32 baselines and bf16
`F.linear` (oneDNN; dtype auto's choice on AVX512-BF16 CPUs).

Libraries (--libs): torch's own weight-only int8 (`_weight_int8pack_mm`, per-channel scales),
int4 (`_weight_int4pack_mm_for_cpu`, groups of 32, bf16), int8 x int8 (`_int_mm`, which
also needs the activations quantized and the int32 result scaled, not counted here) and oneDNN's
int8 linear (`onednn.qlinear_pointwise`: u8 activations with one scale and zero point, s8
weights with per-channel scales, fp32 out; the activations' quantization not counted) on the
1.7B shapes, with the same rotation. None of them holds GGUF's per-block scales.

Each shape's rounds interleave every candidate (and sum()); figures are medians over rounds of
each round's median. Which kernel path ran (avx512_vnni, avx_vnni, avx2, portable) is printed.

    python benchmarks/kernels/bench_quant_matmul.py [--decode] [--prefill] [--libs] [--rounds 5]
"""

from __future__ import annotations

import argparse
import itertools
import logging
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from anywhere in the repo

from cuda_ext import ops  # noqa: E402

POOL_BYTES = 256 * 2**20


@dataclass(frozen=True)
class Shape:
    name: str
    n: int
    k: int
    qtype: str


SHAPES = [
    Shape("135M qkv: q", 576, 576, "q4_1"), Shape("135M k / v", 192, 576, "q4_1"),
    Shape("135M gate / up", 1536, 576, "q4_1"), Shape("135M down", 576, 1536, "q4_1"),
    Shape("135M LM head", 49152, 576, "q8_0"),
    Shape("1.7B o", 2048, 2048, "q4_k"), Shape("1.7B qkv", 6144, 2048, "q4_k"),
    Shape("1.7B gate|up", 16384, 2048, "q4_k"), Shape("1.7B down", 2048, 8192, "q6_k"),
    Shape("1.7B down (q4_k)", 2048, 8192, "q4_k"), Shape("1.7B qkv (q8_0)", 6144, 2048, "q8_0"),
    Shape("1.7B qkv (q4_0)", 6144, 2048, "q4_0"),
    Shape("360M gate|up", 5120, 960, "q5_0"), Shape("360M qkv", 1600, 960, "q5_0"),
    Shape("360M gate|up (q5_1)", 5120, 960, "q5_1"), Shape("360M gate|up (q8_0)", 5120, 960, "q8_0"),
    Shape("1.7B qkv (q5_0)", 6144, 2048, "q5_0"),
]


def median_s(fn, iters: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def rotation(first, nbytes: int):
    """An endless cycle over `first` and copies of it, >= POOL_BYTES in all."""
    copies = max(1, -(-POOL_BYTES // max(nbytes, 1)))
    return itertools.cycle([first] + [first.clone() for _ in range(copies - 1)])


def _data_bytes(qtype: str, rows: int, k: int) -> int:
    """Bytes of a packed segment's data (what a call reads; the header is not counted)."""
    from cuda_ext.reference import quant_block

    block, _ = quant_block(qtype)
    panel = {"q8_0": 544, "q4_0": 288, "q4_1": 320, "q5_0": 352, "q5_1": 384, "q4_k": 2368, "q5_k": 2880,
             "q6_k": 3360}[qtype]
    return -(-rows // 16) * (k // block) * panel


def weights(s: Shape, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randn(s.n, s.k, generator=torch.Generator().manual_seed(seed)) / s.k**0.5
    return w, ops.quantize_weight(w, s.qtype)


def bench_decode(shapes: list[Shape], rounds: int, iters: int) -> None:
    big = torch.randn(512 * 2**18)
    print(f"Decode, M = 1 ({torch.get_num_threads()} threads, kernels: {ops.quant_isa()}); weights rotating over "
          f">= 256 MiB per candidate; medians of {rounds} interleaved rounds")
    print(f"  {'shape':18s} {'type':5s} {'N x K':>13s} {'MB':>6s} {'quant ms':>9s} {'GB/s':>6s} {'% sum':>6s} "
          f"{'panels ms':>9s} {'x':>5s} {'F.lin ms':>9s} {'x':>5s}")
    for s in shapes:
        w, packed = weights(s)
        data = _data_bytes(s.qtype, s.n, s.k)
        x = torch.randn(1, s.k)
        quant = rotation(packed, packed.numel())
        panels = rotation(ops.linear_pack(w), 4 * s.n * s.k)
        dense = rotation(w, 4 * s.n * s.k)
        t_q, t_p, t_f, share = [], [], [], []
        for _ in range(rounds):
            rate = big.numel() * 4 / median_s(big.sum, 5)
            t_q.append(median_s(lambda: ops.quant_matmul(x, next(quant)), iters))
            t_p.append(median_s(lambda: ops.linear_panels(x, next(panels), s.n), iters))
            t_f.append(median_s(lambda: F.linear(x, next(dense)), iters))
            share.append(100 * data / t_q[-1] / rate)
        q, p, f = (statistics.median(t) for t in (t_q, t_p, t_f))
        print(f"  {s.name:18s} {s.qtype:5s} {s.n:6d} x {s.k:4d} {data / 1e6:6.2f} {q * 1e3:9.3f} {data / q / 1e9:6.1f} "
              f"{statistics.median(share):5.0f}% {p * 1e3:9.3f} {p / q:5.2f} {f * 1e3:9.3f} {f / q:5.2f}")
        del quant, panels, dense


def bench_prefill(shapes: list[Shape], rounds: int, iters: int) -> None:
    print(f"Prefill, GFLOP/s ({torch.get_num_threads()} threads, kernels: {ops.quant_isa()}); medians of {rounds} "
          f"interleaved rounds")
    print(f"  {'shape':18s} {'type':5s} {'M':>4s} {'quant':>7s} {'panels':>7s} {'F.lin fp32':>10s} {'F.lin bf16':>10s} "
          f"{'quant / panels':>14s}")
    for s in shapes:
        w, packed = weights(s)
        quant = rotation(packed, packed.numel())
        panels = rotation(ops.linear_pack(w), 4 * s.n * s.k)
        dense = rotation(w, 4 * s.n * s.k)
        dense16 = rotation(w.bfloat16(), 2 * s.n * s.k)
        for m in (16, 64, 256):
            x = torch.randn(m, s.k)
            x16 = x.bfloat16()
            res: list[list[float]] = [[], [], [], []]
            for _ in range(rounds):
                for i, fn in enumerate((lambda: ops.quant_matmul(x, next(quant)),
                                        lambda: ops.linear_panels(x, next(panels), s.n),
                                        lambda: F.linear(x, next(dense)), lambda: F.linear(x16, next(dense16)))):
                    res[i].append(2 * m * s.n * s.k / median_s(fn, iters) / 1e9)
            g = [statistics.median(r) for r in res]
            print(f"  {s.name:18s} {s.qtype:5s} {m:4d} {g[0]:7.0f} {g[1]:7.0f} {g[2]:10.0f} {g[3]:10.0f} "
                  f"{g[0] / g[1]:14.2f}")
        del quant, panels, dense, dense16


def int4_pack(w: torch.Tensor, group: int = 32):
    """torch's CPU int4 weight-only format (groups of `group`): packed weight, scales and zeros."""
    n, k = w.shape
    wg = w.view(n, k // group, group)
    lo, hi = wg.amin(-1), wg.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-8)
    q = torch.clamp(torch.round((wg - lo[..., None]) / scale[..., None]), 0, 15).to(torch.int32).view(n, k)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    scales_zeros = torch.stack([scale, lo + 8 * scale], dim=-1).transpose(0, 1).contiguous().bfloat16()
    return packed, scales_zeros


def int4_mm(x: torch.Tensor, weight: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, weight[0], 32, weight[1])


def bench_libs(shapes: list[Shape], rounds: int, iters: int) -> None:
    print(f"torch's quantized CPU paths against quant_matmul ({torch.get_num_threads()} threads), ms, medians of "
          f"{rounds} interleaved rounds; weights rotating over >= 256 MiB each")
    print(f"  {'shape':18s} {'M':>4s} {'quant_matmul':>12s} {'int8pack fp32':>13s} {'int8pack bf16':>13s} "
          f"{'int4pack bf16':>13s} {'_int_mm':>8s} {'onednn s8':>9s}")
    for s in shapes:
        w, packed = weights(s)
        scales = w.abs().amax(1) / 127
        w8 = torch.round(w / scales[:, None]).to(torch.int8)
        quant = rotation(packed, packed.numel())
        int8 = rotation(w8, s.n * s.k)
        int4 = itertools.cycle([int4_pack(w)] + [tuple(t.clone() for t in int4_pack(w))
                                                 for _ in range(max(0, POOL_BYTES // (s.n * s.k // 2) - 1))])
        int8_t = rotation(w8.t(), s.n * s.k)  # [K, N] column-major
        zeros = torch.zeros(s.n, dtype=torch.int64)
        for m in (1, 64, 256):
            onednn = rotation(torch.ops.onednn.qlinear_prepack(w8, [m, s.k]), s.n * s.k)
            xu8 = torch.randint(0, 256, (m, s.k), dtype=torch.uint8)
            x = torch.randn(m, s.k)
            x16 = x.bfloat16()
            a8 = torch.randint(-127, 128, (max(m, 17), s.k), dtype=torch.int8)  # _int_mm needs > 16 rows
            s16 = scales.bfloat16()
            fns = (lambda: ops.quant_matmul(x, next(quant)), lambda: torch._weight_int8pack_mm(x, next(int8), scales),
                   lambda: torch._weight_int8pack_mm(x16, next(int8), s16),
                   lambda: int4_mm(x16, next(int4)),
                   lambda: torch._int_mm(a8, next(int8_t)),
                   lambda: torch.ops.onednn.qlinear_pointwise(xu8, 0.05, 128, next(onednn), scales, zeros, None, 1.0, 0,
                                                              torch.float32, "none", [], ""))
            res: list[list[float]] = [[] for _ in fns]
            for _ in range(rounds):
                for i, fn in enumerate(fns):
                    res[i].append(median_s(fn, iters) * 1e3)
            t = [statistics.median(r) for r in res]
            print(f"  {s.name:18s} {m:4d} {t[0]:12.3f} {t[1]:13.3f} {t[2]:13.3f} {t[3]:13.3f} {t[4]:8.3f} {t[5]:9.3f}")
            del onednn
        del quant, int8, int4, int8_t


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--decode", action="store_true", help="M = 1 read rates (default when nothing is chosen)")
    parser.add_argument("--prefill", action="store_true", help="M = 16, 64, 256 GFLOP/s")
    parser.add_argument("--libs", action="store_true", help="torch's int8 / int4 paths on the 1.7B shapes")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--shapes", default="", help="comma-separated substrings of shape names to keep")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    shapes = [s for s in SHAPES if not args.shapes or any(p in s.name for p in args.shapes.split(","))]
    if not (args.decode or args.prefill or args.libs):
        args.decode = True
    if args.decode:
        bench_decode(shapes, args.rounds, args.iters)
    if args.prefill:
        bench_prefill([s for s in shapes if s.name.startswith("1.7B") and "(" not in s.name], args.rounds,
                      max(3, args.iters // 4))
    if args.libs:
        bench_libs([s for s in shapes if s.name in ("1.7B qkv", "1.7B down")], args.rounds, max(3, args.iters // 4))
    return 0


if __name__ == "__main__":
    sys.exit(main())
