"""Tune the CUDA paged_attention kernel: build variants of cuda_ext/csrc/cuda/attention.cu with
different compile-time knobs (the PAGED_SERVE_ATTN_* macros in attention_kernels.cuh: rows in
flight per thread, blocks per SM asked of ptxas) and, optionally, an older copy of the sources,
then time them on the same inputs in interleaved rounds and check each against a pure-torch
result. Needs a CUDA GPU, torch with CUDA and nvcc; no torch extension is built (each variant is
a small shared library called through ctypes), so variants build in parallel in seconds.

    python benchmarks/kernels/tune_paged_attention.py                  # the default variants
    python benchmarks/kernels/tune_paged_attention.py --baseline DIR   # plus DIR's attention.cu
    python benchmarks/kernels/tune_paged_attention.py --variant u8=PAGED_SERVE_ATTN_UNROLL_4=8

Prints, per shape, each variant's median time and K/V read rate, and the registers ptxas gave
each kernel instantiation. Use it to choose the defaults in attention_kernels.cuh; the kernel
benchmark (bench_paged_attention.py --device cuda) then measures the built extension.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import ctypes
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from anywhere in the repo

from benchmarks.kernels.bench_paged_attention import (  # noqa: E402
    Shape,
    batched_gather_attention,
    make_inputs,
    median_ms,
)
from cuda_ext import build  # noqa: E402

CUDA_DIR = build.CSRC / "cuda"
DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
TOLERANCE = {torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 2e-2}

SHAPES = [Shape(b, ctx, h, kv, d, 16, dt) for b, ctx, h, kv, d, dt in (
    (64, 4096, 32, 8, 128, torch.bfloat16), (256, 1024, 32, 8, 128, torch.bfloat16),
    (256, 512, 32, 8, 128, torch.bfloat16), (64, 4096, 64, 8, 128, torch.bfloat16),
    (64, 4096, 32, 32, 128, torch.bfloat16), (64, 4096, 9, 3, 64, torch.bfloat16),
    (256, 1024, 8, 4, 64, torch.bfloat16), (64, 4096, 32, 8, 128, torch.float32))]

# Around the defaults in attention_kernels.cuh (GROUP 4: 4 rows, 8 blocks per SM; GROUP 8: 4
# rows, 4 blocks; GROUP 1: 4 rows, unbounded).
VARIANTS = {
    "default": [],
    "mb4=1": ["PAGED_SERVE_ATTN_MIN_BLOCKS_4=1"],
    "mb4=6": ["PAGED_SERVE_ATTN_MIN_BLOCKS_4=6"],
    "u4=2": ["PAGED_SERVE_ATTN_UNROLL_4=2"],
    "u8=2,mb8=1": ["PAGED_SERVE_ATTN_UNROLL_8=2", "PAGED_SERVE_ATTN_MIN_BLOCKS_8=1"],
    "u1=8": ["PAGED_SERVE_ATTN_UNROLL_1=8"],
}

# A C entry point over cuda::paged_attention (the kernels' own host launcher), so that the
# library needs no torch headers. NOTE: fields are set by name, since older sources' shape
# lacks the newer ones (PS_NEW_SHAPE says whether these sources have them).
WRAPPER = r"""
#include "kernels.h"
using namespace paged_serve::cuda;
extern "C" int ps_paged_attention(void* out, const void* query, const void* key_cache, const void* value_cache,
                                  const int* tables, const int* lens, float* po, float* pm, float* ps, const int* d,
                                  const long long* s, float scale, int max_context_len, int dtype, int* error_flag) {
  AttentionShape shape{};
  shape.num_seqs = d[0]; shape.num_heads = d[1]; shape.num_kv_heads = d[2]; shape.head_size = d[3];
  shape.block_size = d[4]; shape.max_blocks_per_seq = d[5]; shape.num_blocks = d[6];
  shape.q_stride_seq = s[0]; shape.q_stride_head = s[1]; shape.out_stride_seq = s[2]; shape.out_stride_head = s[3];
  shape.cache_stride_block = s[4]; shape.cache_stride_head = s[5]; shape.cache_stride_token = s[6];
#ifdef PS_NEW_SHAPE
  shape.max_context_len = max_context_len;
  shape.block_shift = attention_block_shift(d[4]);
#endif
  return static_cast<int>(paged_attention(out, query, key_cache, value_cache, tables, lens, po, pm, ps, shape, scale,
                                          max_context_len, static_cast<DType>(dtype), error_flag, nullptr));
}
"""


def compile_variant(name: str, src: Path, defines: list[str], work: Path, arch: str) -> tuple[str, Path, str]:
    """nvcc attention.cu of `src` + the wrapper into a shared library; returns (name, path, ptxas log)."""
    out = work / re.sub(r"[^A-Za-z0-9_.-]", "_", name)
    out.mkdir(parents=True, exist_ok=True)
    (out / "wrapper.cu").write_text(WRAPPER)
    new_shape = "block_shift" in (src / "kernels.h").read_text()
    cmd = [os.environ.get("NVCC", "nvcc"), "-std=c++17", "-O3", "-lineinfo", "-shared", "-Xcompiler", "-fPIC",
           "-Xptxas", "-v", "-gencode", f"arch=compute_{arch},code=sm_{arch}", "-D__CUDA_NO_HALF_OPERATORS__",
           "-D__CUDA_NO_HALF_CONVERSIONS__", "-D__CUDA_NO_BFLOAT16_CONVERSIONS__", "-D__CUDA_NO_HALF2_OPERATORS__",
           *(["-DPS_NEW_SHAPE"] if new_shape else []), *(f"-D{d}" for d in defines), f"-I{src}",
           str(src / "attention.cu"), str(out / "wrapper.cu"), "-o", str(out / "lib.so")]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{name}: nvcc failed:\n{done.stderr[-3000:]}")
    return name, out / "lib.so", done.stderr


def registers(ptxas_log: str) -> dict[str, str]:
    """'<dtype,head,group>' -> registers (and spill stores) of each paged_attention_kernel instantiation."""
    demangle = shutil.which("c++filt")
    regs, current, spill = {}, None, 0
    for line in ptxas_log.splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            current = m[1]
            if demangle:
                current = subprocess.run([demangle, current], capture_output=True, text=True).stdout.strip()
        m = re.search(r"(\d+) bytes spill stores", line)
        if m:
            spill = int(m[1])
        m = re.search(r"Used (\d+) registers", line)
        if m and current and "paged_attention_kernel" in current:
            key = re.search(r"<(.*)>", current)
            name = (key[1] if key else current).replace("__nv_bfloat16", "bf16").replace("__half", "f16")
            regs[name] = f"{m[1]}" + (f" (spills {spill} B)" if spill else "")
    return regs


class Variant:
    def __init__(self, name: str, lib_path: Path):
        self.name = name
        self.lib = ctypes.CDLL(str(lib_path))
        self.lib.ps_paged_attention.restype = ctypes.c_int

    def __call__(self, out, query, key_cache, value_cache, tables, lens, scale, max_len, partials, error):
        dims = (ctypes.c_int * 7)(query.shape[0], query.shape[1], key_cache.shape[1], query.shape[2],
                                  key_cache.shape[2], tables.shape[1], key_cache.shape[0])
        strides = (ctypes.c_longlong * 7)(query.stride(0), query.stride(1), out.stride(0), out.stride(1),
                                          key_cache.stride(0), key_cache.stride(1), key_cache.stride(2))
        p = ctypes.c_void_p
        po, pm, ps = (p(t.data_ptr()) if t is not None else p(0) for t in partials)
        rc = self.lib.ps_paged_attention(p(out.data_ptr()), p(query.data_ptr()), p(key_cache.data_ptr()),
                                         p(value_cache.data_ptr()), p(tables.data_ptr()), p(lens.data_ptr()), po, pm,
                                         ps, dims, strides, ctypes.c_float(scale), max_len, DTYPE_CODES[query.dtype],
                                         p(error.data_ptr()))
        if rc != 0:
            raise RuntimeError(f"{self.name}: launch failed with cudaError {rc}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", type=Path, help="a directory with other attention.cu sources, timed as 'baseline'")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=MACRO=VALUE[,MACRO=VALUE]",
                    help="replace the default variants (repeatable); NAME= alone: no defines")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    major, minor = torch.cuda.get_device_capability()
    variants = dict(VARIANTS)
    if args.variant:
        variants = {}
        for spec in args.variant:
            name, _, defines = spec.partition("=")
            variants[name] = [d for d in defines.split(",") if d]
    jobs = [(name, CUDA_DIR, defines) for name, defines in variants.items()]
    if args.baseline:
        jobs.insert(0, ("baseline", args.baseline, []))
    work = Path(tempfile.mkdtemp(prefix="tune-attn-"))
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 4) as pool:
        built = list(pool.map(lambda j: compile_variant(*j, work, f"{major}{minor}"), jobs))
    kernels = []
    print(f"{torch.cuda.get_device_name()}; registers per paged_attention_kernel<dtype, head, heads per block>:")
    for name, lib_path, log in built:
        kernels.append(Variant(name, lib_path))
        regs = registers(log)
        print(f"  {name:12s} " + ", ".join(f"{k}: {v}" for k, v in sorted(regs.items()) if "float," not in k))
    error = torch.zeros(1, dtype=torch.int32, device="cuda")
    for s in SHAPES:
        query, key_cache, value_cache, tables, lens = make_inputs(s, "cuda")
        scale = s.head_size**-0.5
        expected = torch.empty_like(query)
        batched_gather_attention(expected, query, key_cache, value_cache, tables, lens, scale, s.context_len)
        parts = -(-s.context_len // 512) if s.context_len > 512 else 1
        partials = (None, None, None) if parts == 1 else (
            torch.empty(s.batch, s.num_heads, parts, s.head_size, device="cuda"),
            torch.empty(s.batch, s.num_heads, parts, device="cuda"),
            torch.empty(s.batch, s.num_heads, parts, device="cuda"))
        outs = {k.name: torch.empty_like(query) for k in kernels}
        calls = {k.name: (lambda k=k: k(outs[k.name], query, key_cache, value_cache, tables, lens, scale,
                                        s.context_len, partials, error)) for k in kernels}
        ms: dict[str, list[float]] = {k.name: [] for k in kernels}
        for name, call in calls.items():
            call()
            torch.cuda.synchronize()
            bad = (outs[name].float() - expected.float()).abs().max().item()
            if not bad <= TOLERANCE[s.dtype] or error.item():
                print(f"  {name}: WRONG (max abs error {bad:.3g}, error flag {error.item()})")
                ms.pop(name)
        for _ in range(args.rounds):  # interleaved, so drift hits every variant alike
            for name in ms:
                ms[name].append(median_ms(calls[name], args.iters, warmup=1, cuda=True))
        print(f"b{s.batch} x {s.context_len}, {s.num_heads}q/{s.num_kv_heads}kv, head {s.head_size}, "
              f"{str(s.dtype).removeprefix('torch.')} ({s.kv_bytes() / 1e9:.2f} GB of K/V):")
        best = min(statistics.median(v) for v in ms.values())
        for name, v in ms.items():
            t = statistics.median(v)
            print(f"  {name:12s} {t:8.3f} ms  {s.kv_bytes() / t / 1e9:5.2f} TB/s{'  *' if t == best else ''}")
        del query, key_cache, value_cache, tables, lens, expected, outs, partials
        torch.cuda.empty_cache()
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
