"""paged_attention micro-benchmark: the compiled kernel against its baselines.

CPU (default): batch 32 x context 1024, SmolLM2 shape (9 query / 3 KV heads, head size 64),
block 16, fp32; compiled CPU kernel vs the pure-torch reference that gathers K/V through the
block table. Target: >= 3x.

CUDA (--device cuda): batch 64 x context 4096, bf16, head size 128, 32 query / 8 KV heads,
block 16; K/V bandwidth of the CUDA kernel (target >= 3.6 TB/s on an H200, 75% of peak) and
its speed against torch SDPA over the same K/V laid out contiguously (target: not slower).

CPU read rate (--bandwidth): K/V bytes per second at head sizes 32, 64 and 128 (the shapes of
the performance issue), fp32 and bf16, as a share of a plain `sum()` over 512 MiB measured in the
same rounds (the machine's read rate right then: on a shared VM it moves 20% from minute to
minute). Each shape's calls rotate over copies of its caches, 256 MiB in all, so that they read
from DRAM as a model's layers do, not from L3. Rounds interleave every shape and the sum(); the
figures are medians over rounds.

    python benchmarks/kernels/bench_paged_attention.py [--device cpu|cuda] [--iters N] [--sweep]
    python benchmarks/kernels/bench_paged_attention.py --bandwidth [--rounds 5]
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

from cuda_ext import ops, reference  # noqa: E402


@dataclass(frozen=True)
class Shape:
    batch: int
    context_len: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    block_size: int
    dtype: torch.dtype

    def kv_bytes(self) -> int:
        """Bytes of K and V one call must read."""
        per = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * self.batch * self.context_len * self.num_kv_heads * self.head_size * per


CPU_SHAPE = Shape(32, 1024, 9, 3, 64, 16, torch.float32)
BANDWIDTH_SHAPES = [Shape(b, ctx, h, kv, d, 16, dtype) for dtype in (torch.float32, torch.bfloat16)
                    for b, ctx, h, kv, d in ((64, 512, 8, 4, 32), (32, 1024, 9, 3, 64), (16, 1024, 32, 8, 128))]
CUDA_SHAPE = Shape(64, 4096, 32, 8, 128, 16, torch.bfloat16)


def make_inputs(shape: Shape, device: str, seed: int = 0):
    """Caches whose blocks are handed out in a random order (non-contiguous block tables),
    drawn on `device` (a CPU generator would take seconds for a GPU-sized pool)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    blocks_per_seq = -(-shape.context_len // shape.block_size)
    num_blocks = shape.batch * blocks_per_seq
    cache_shape = (num_blocks, shape.num_kv_heads, shape.block_size, shape.head_size)
    key_cache = torch.randn(cache_shape, generator=gen, device=device).to(shape.dtype)
    value_cache = torch.randn(cache_shape, generator=gen, device=device).to(shape.dtype)
    tables = torch.randperm(num_blocks, generator=gen, device=device).view(shape.batch, blocks_per_seq).to(torch.int32)
    lens = torch.full((shape.batch,), shape.context_len, dtype=torch.int32, device=device)
    query = torch.randn(shape.batch, shape.num_heads, shape.head_size, generator=gen, device=device).to(shape.dtype)
    return query, key_cache, value_cache, tables, lens


def median_ms(fn, iters: int, warmup: int = 3, cuda: bool = False) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def batched_gather_attention(out, query, key_cache, value_cache, tables, lens, scale, context_len):
    """A stronger pure-torch baseline than the reference: one gather and two batched matmuls for
    the whole batch (works only because every sequence here has the same length)."""
    batch, num_heads, head_size = query.shape
    num_kv_heads = key_cache.shape[1]

    def gather(cache):  # [batch, blocks, kv, block_size, head] -> [batch, kv, ctx, head]
        blocks = cache[tables.long()].permute(0, 2, 1, 3, 4)
        return blocks.reshape(batch, num_kv_heads, -1, head_size)[:, :, :context_len]

    q = query.float().view(batch, num_kv_heads, num_heads // num_kv_heads, head_size)
    probs = torch.softmax(q @ gather(key_cache).float().transpose(-1, -2) * scale, dim=-1)
    out.copy_((probs @ gather(value_cache).float()).view(batch, num_heads, head_size))


def bench_cpu(iters: int) -> bool:
    s = CPU_SHAPE
    query, key_cache, value_cache, tables, lens = make_inputs(s, "cpu")
    scale = s.head_size**-0.5
    out, expected = torch.empty_like(query), torch.empty_like(query)
    args = (query, key_cache, value_cache, tables, lens, scale, s.context_len)
    compiled_ms = median_ms(lambda: ops.paged_attention(out, *args), iters)
    reference_ms = median_ms(lambda: reference.paged_attention(expected, *args), iters)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
    batched_ms = median_ms(lambda: batched_gather_attention(expected, *args), iters)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
    ratio = reference_ms / compiled_ms
    print(f"CPU paged_attention  batch {s.batch} x ctx {s.context_len}, {s.num_heads}q/{s.num_kv_heads}kv heads, "
          f"head {s.head_size}, block {s.block_size}, fp32, {torch.get_num_threads()} threads")
    print(f"  compiled ({ops.backend()}): {compiled_ms:8.2f} ms median  ({s.kv_bytes() / compiled_ms / 1e6:.1f} GB/s K/V)")
    print(f"  reference (pure torch):   {reference_ms:8.2f} ms median")
    print(f"  batched torch gather:     {batched_ms:8.2f} ms median  (for information: "
          f"{batched_ms / compiled_ms:.1f}x the compiled time)")
    print(f"  speed-up: {ratio:.1f}x  (target >= 3x: {'PASS' if ratio >= 3 else 'FAIL'})")
    return ratio >= 3


def read_rates(shapes: list[Shape], rounds: int, iters: int, sum_mib: int = 512, pool_mib: int = 256) -> list[dict]:
    """Per shape: median ms, GB/s and % of sum()'s rate over `rounds` interleaved rounds.

    NOTE: each shape's caches are copied until the copies hold `pool_mib` MiB, and successive
    calls read successive copies, as a model's layers do. One copy of a small shape (bf16 head
    32: 17 MB) fits a server CPU's L3 (32 MiB on the Zen 4 EPYC), and calls on it alone read it
    from there: up to 124% of sum()'s DRAM rate."""
    big = torch.randn(sum_mib * 2**18)
    inputs = []
    for s in shapes:
        query, key_cache, value_cache, tables, lens = make_inputs(s, "cpu")
        copies = max(1, -(-pool_mib * 2**20 // s.kv_bytes()))
        caches = [(key_cache, value_cache)] + [(key_cache.clone(), value_cache.clone()) for _ in range(copies - 1)]
        calls = itertools.cycle([(torch.empty_like(query), query, k, v, tables, lens, s.head_size**-0.5, s.context_len)
                                 for k, v in caches])
        inputs.append(calls)
    ms: list[list[float]] = [[] for _ in shapes]
    shares: list[list[float]] = [[] for _ in shapes]
    for _ in range(rounds):
        sum_rate = big.numel() * 4 / median_ms(big.sum, max(3, iters // 3)) / 1e6  # GB/s
        for i, (s, calls) in enumerate(zip(shapes, inputs)):
            t = median_ms(lambda: ops.paged_attention(*next(calls)), iters)
            ms[i].append(t)
            shares[i].append(100 * s.kv_bytes() / t / 1e6 / sum_rate)
    return [{"shape": s, "ms": statistics.median(m), "gbps": s.kv_bytes() / statistics.median(m) / 1e6,
             "pct_of_sum": statistics.median(p)} for s, m, p in zip(shapes, ms, shares)]


def bench_bandwidth(rounds: int, iters: int) -> bool:
    print(f"CPU paged_attention read rate, {torch.get_num_threads()} threads, random block tables, block 16, "
          f"calls rotating over 256 MiB of caches ({rounds} rounds, medians)")
    rows = read_rates(BANDWIDTH_SHAPES, rounds, iters)
    for r in rows:
        s = r["shape"]
        print(f"  head {s.head_size:3d} ({s.num_heads}/{s.num_kv_heads} heads, b{s.batch} x {s.context_len}) "
              f"{str(s.dtype).removeprefix('torch.'):8s} {r['ms']:7.2f} ms {r['gbps']:6.1f} GB/s "
              f"{r['pct_of_sum']:5.0f}% of sum()")
    return all(r["pct_of_sum"] >= 70 for r in rows)


def bench_cuda(iters: int) -> bool:
    s = CUDA_SHAPE
    query, key_cache, value_cache, tables, lens = make_inputs(s, "cuda")
    scale = s.head_size**-0.5
    out = torch.empty_like(query)
    paged_ms = median_ms(
        lambda: ops.paged_attention(out, query, key_cache, value_cache, tables, lens, scale, s.context_len),
        iters, cuda=True)
    # The same K/V, contiguous per sequence: [batch, kv_heads, ctx, head].
    k = torch.stack([reference.gather_cached_kv(key_cache, value_cache, tables[i], s.context_len)[0]
                     for i in range(s.batch)]).transpose(1, 2).contiguous()
    v = torch.stack([reference.gather_cached_kv(key_cache, value_cache, tables[i], s.context_len)[1]
                     for i in range(s.batch)]).transpose(1, 2).contiguous()
    q = query.unsqueeze(2)  # [batch, heads, 1, head]
    sdpa_ms = median_ms(lambda: F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True),
                        iters, cuda=True)
    expected = F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True).squeeze(2)
    torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)
    tbps = s.kv_bytes() / paged_ms / 1e9
    ratio = sdpa_ms / paged_ms
    print(f"CUDA paged_attention  batch {s.batch} x ctx {s.context_len}, {s.num_heads}q/{s.num_kv_heads}kv heads, "
          f"head {s.head_size}, block {s.block_size}, bf16, {torch.cuda.get_device_name()}")
    print(f"  paged kernel: {paged_ms:8.3f} ms median  {tbps:.2f} TB/s K/V (target >= 3.6: {'PASS' if tbps >= 3.6 else 'FAIL'})")
    print(f"  torch SDPA over contiguous K/V: {sdpa_ms:8.3f} ms median  ({s.kv_bytes() / sdpa_ms / 1e9:.2f} TB/s)")
    print(f"  SDPA time / paged time: {ratio:.2f}  (target >= 1: {'PASS' if ratio >= 1 else 'FAIL'})")
    return tbps >= 3.6 and ratio >= 1


# Other decode shapes on a GPU, for information: (batch, context, heads, KV heads, head size, dtype).
CUDA_SWEEP = [Shape(b, ctx, h, kv, d, 16, dt) for b, ctx, h, kv, d, dt in (
    (64, 4096, 32, 8, 128, torch.float16), (256, 1024, 32, 8, 128, torch.bfloat16),
    (256, 512, 32, 8, 128, torch.bfloat16), (16, 16384, 32, 8, 128, torch.bfloat16),
    (64, 4096, 32, 32, 128, torch.bfloat16), (64, 4096, 9, 3, 64, torch.bfloat16),
    (256, 1024, 8, 4, 64, torch.bfloat16), (64, 4096, 32, 8, 128, torch.float32))]


def sweep_cuda(iters: int) -> None:
    """K/V read rate of the CUDA kernel at CUDA_SWEEP's shapes (median of `iters` launches)."""
    print("CUDA paged_attention at other shapes (block 16, random tables; median ms, K/V TB/s):")
    for s in CUDA_SWEEP:
        query, key_cache, value_cache, tables, lens = make_inputs(s, "cuda")
        out = torch.empty_like(query)
        ms = median_ms(lambda: ops.paged_attention(out, query, key_cache, value_cache, tables, lens,
                                                   s.head_size**-0.5, s.context_len), iters, cuda=True)
        print(f"  b{s.batch:<4d} x {s.context_len:<6d} {s.num_heads:2d}q/{s.num_kv_heads:2d}kv head {s.head_size:3d} "
              f"{str(s.dtype).removeprefix('torch.'):9s} {ms:8.3f} ms  {s.kv_bytes() / ms / 1e9:5.2f} TB/s")
        del query, key_cache, value_cache, tables, lens, out
        torch.cuda.empty_cache()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--iters", type=int, default=None, help="timed runs (default 15 CPU, 50 CUDA)")
    parser.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    parser.add_argument("--bandwidth", action="store_true", help="CPU read rate at heads 32/64/128 (see above)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds for --bandwidth")
    parser.add_argument("--sweep", action="store_true", help="with --device cuda: other decode shapes too")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.device == "cuda":
        if not torch.cuda.is_available():
            print("no CUDA device", file=sys.stderr)
            return 2
        ok = bench_cuda(args.iters or 50)
        if args.sweep:
            sweep_cuda(args.iters or 50)
    elif args.bandwidth:
        ok = bench_bandwidth(args.rounds, args.iters or 15)
    else:
        ok = bench_cpu(args.iters or 15)
    return 0 if ok or not args.check else 1


if __name__ == "__main__":
    sys.exit(main())
