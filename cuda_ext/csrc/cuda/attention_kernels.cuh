// CUDA paged attention kernels (decode): one query token per sequence against its cached K/V,
// read through the sequence's block table. Plain CUDA C++, no torch headers (see kernels.h);
// attention.cu launches them. Kept in a header of their own so that tests/kernels/cuda_sim
// can run these exact kernels on the CPU (a thread per CUDA thread) where no GPU is present.
//
// One thread block computes, for one (sequence, partition), up to GROUP query heads that share
// one KV head (GQA): each K/V row is read from memory once for all of them, instead of once
// per query head (which would make L2 bandwidth, not HBM, the limit). The context is cut into
// partitions of kPartitionSize tokens:
//   * one partition (context <= kPartitionSize): a single pass writes `out` directly;
//   * more: pass 1 writes each partition's normalised output with its max logit and exp-sum,
//     pass 2 (paged_attention_reduce_kernel) rescales and sums them (vLLM's "v2" idea). This
//     keeps long contexts spread over many SMs and shared memory bounded.
// Inside a block, LANES threads share one K/V row (16 bytes each), so a warp reads whole
// 128/256-byte rows with vector loads and ROWS rows are in flight at once. With GQA the
// GROUP heads' dot products of a row are reduced and scattered over its LANES threads (each
// ends with one head's logit): GROUP - 1 + log2(LANES / GROUP) shuffles, not GROUP * log2(LANES),
// which on an H200 made a 4-head block instruction-bound at half the K/V read rate.
//
// Tuning knobs (compile-time; benchmarks/kernels/tune_paged_attention.py builds variants):
// K/V rows each thread loads before computing on them, per GROUP, and the blocks per SM that
// __launch_bounds__ asks ptxas to fit (it caps the registers). The defaults are the H200's
// fastest (2026-12-04, bf16, block 16, medians of 3 x 30 launches): GROUP 4 at 8 blocks (64
// registers, a few bytes spilled) read 2.72 TB/s at 64 x 4096 (32q/8kv, head 128) where
// 4 blocks (112 registers) read 2.35 and the all-reduce kernel before it 1.77; GROUP 8 with 4
// rows at 4 blocks 1.82 TB/s (64q/8kv) where 2 rows unbounded read 1.24; GROUP 1 4.2 TB/s.

#pragma once

#include "errors.cuh"
#include "kernels.h"

#include <cfloat>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace paged_serve::cuda::attention_kernels {

constexpr int kWarpSize = 32;
constexpr int kNumThreads = 128;
constexpr int kNumWarps = kNumThreads / kWarpSize;
#ifndef PAGED_SERVE_ATTN_UNROLL_1
#define PAGED_SERVE_ATTN_UNROLL_1 4
#endif
#ifndef PAGED_SERVE_ATTN_UNROLL_4
#define PAGED_SERVE_ATTN_UNROLL_4 4
#endif
#ifndef PAGED_SERVE_ATTN_UNROLL_8
#define PAGED_SERVE_ATTN_UNROLL_8 4
#endif
#ifndef PAGED_SERVE_ATTN_MIN_BLOCKS_1
#define PAGED_SERVE_ATTN_MIN_BLOCKS_1 1
#endif
#ifndef PAGED_SERVE_ATTN_MIN_BLOCKS_4
#define PAGED_SERVE_ATTN_MIN_BLOCKS_4 8
#endif
#ifndef PAGED_SERVE_ATTN_MIN_BLOCKS_8
#define PAGED_SERVE_ATTN_MIN_BLOCKS_8 4
#endif

// K/V rows each thread loads before it computes on them, and blocks per SM, per GROUP.
template <int GROUP>
constexpr int kUnrollFor =
    GROUP >= 8 ? PAGED_SERVE_ATTN_UNROLL_8 : GROUP >= 4 ? PAGED_SERVE_ATTN_UNROLL_4 : PAGED_SERVE_ATTN_UNROLL_1;
template <int GROUP>
constexpr int kMinBlocksFor = GROUP >= 8   ? PAGED_SERVE_ATTN_MIN_BLOCKS_8
                              : GROUP >= 4 ? PAGED_SERVE_ATTN_MIN_BLOCKS_4
                                           : PAGED_SERVE_ATTN_MIN_BLOCKS_1;

template <typename T> __device__ __forceinline__ float to_float(T x);
template <> __device__ __forceinline__ float to_float(float x) { return x; }
template <> __device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
template <> __device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float(float x) { return x; }
template <> __device__ __forceinline__ __half from_float(float x) { return __float2half(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float(float x) { return __float2bfloat16(x); }

// Unpack 16 bytes holding 16 / sizeof(T) elements of T into fp32.
template <typename T> __device__ __forceinline__ void unpack(const uint4& raw, float* f);
template <> __device__ __forceinline__ void unpack<float>(const uint4& raw, float* f) {
  f[0] = __uint_as_float(raw.x); f[1] = __uint_as_float(raw.y);
  f[2] = __uint_as_float(raw.z); f[3] = __uint_as_float(raw.w);
}
template <> __device__ __forceinline__ void unpack<__half>(const uint4& raw, float* f) {
  const __half2* h = reinterpret_cast<const __half2*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) { const float2 p = __half22float2(h[i]); f[2 * i] = p.x; f[2 * i + 1] = p.y; }
}
template <> __device__ __forceinline__ void unpack<__nv_bfloat16>(const uint4& raw, float* f) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) { const float2 p = __bfloat1622float2(h[i]); f[2 * i] = p.x; f[2 * i + 1] = p.y; }
}

// Sum over groups of WIDTH consecutive lanes (WIDTH a power of two <= 32); every lane of the
// warp must call it.
template <int WIDTH>
__device__ __forceinline__ float group_sum(float v) {
#pragma unroll
  for (int mask = WIDTH / 2; mask > 0; mask >>= 1) v += __shfl_xor_sync(0xffffffffu, v, mask);
  return v;
}

// Sums each of v[0..GROUP) over groups of LANES consecutive lanes and scatters the sums: lane
// `lane` (of its group) returns the sum of v[lane / (LANES / GROUP)]. Each halving step sends
// the half of the values a lane gives away and keeps the other half, so it takes GROUP - 1 +
// log2(LANES / GROUP) shuffles. GROUP <= LANES, both powers of two; every lane must call it.
template <int LANES, int GROUP>
__device__ __forceinline__ float group_sum_scatter(float (&v)[GROUP], int lane) {
  static_assert(GROUP <= LANES && (GROUP & (GROUP - 1)) == 0, "GROUP: a power of two <= LANES");
#pragma unroll
  for (int width = GROUP, mask = LANES / 2; width > 1; width /= 2, mask /= 2) {
    const bool upper = (lane & mask) != 0;  // keeps v[width / 2, width), gives away the rest
#pragma unroll
    for (int i = 0; i < width / 2; ++i) {
      const float give = upper ? v[i] : v[i + width / 2];
      const float keep = upper ? v[i + width / 2] : v[i];
      v[i] = keep + __shfl_xor_sync(0xffffffffu, give, mask);
    }
  }
  return group_sum<LANES / GROUP>(v[0]);
}

struct MaxOp { __device__ float operator()(float a, float b) const { return fmaxf(a, b); } };
struct SumOp { __device__ float operator()(float a, float b) const { return a + b; } };

// Reduce GROUP values per thread over the whole block; every thread gets the results.
// scratch: [GROUP][kNumWarps] floats of shared memory. Contains two __syncthreads().
template <int GROUP, typename Op>
__device__ void block_reduce(float (&v)[GROUP], float (*scratch)[kNumWarps], Op op) {
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
#pragma unroll
  for (int g = 0; g < GROUP; ++g) {
#pragma unroll
    for (int mask = kWarpSize / 2; mask > 0; mask >>= 1) v[g] = op(v[g], __shfl_xor_sync(0xffffffffu, v[g], mask));
    if (lane == 0) scratch[g][warp] = v[g];
  }
  __syncthreads();
#pragma unroll
  for (int g = 0; g < GROUP; ++g) {
    v[g] = scratch[g][0];
#pragma unroll
    for (int w = 1; w < kNumWarps; ++w) v[g] = op(v[g], scratch[g][w]);
  }
  __syncthreads();  // scratch may be reused right after
}

// The context length a kernel may use for sequence `seq`: context_lens[seq] clamped to the
// caller's max_context_len, what the launch covers (num_partitions * kPartitionSize tokens)
// and what its block table row holds; a length outside that is reported (kBadContextLen)
// instead of read past the table.
__device__ __forceinline__ int guarded_context_len(const int* context_lens, int seq, int num_partitions,
                                                   const AttentionShape& shape, int* error_flag) {
  const int len = context_lens[seq];
  const int64_t limit = min(min(static_cast<int64_t>(num_partitions) * kPartitionSize,
                                static_cast<int64_t>(shape.max_context_len)),
                            static_cast<int64_t>(shape.max_blocks_per_seq) * shape.block_size);
  if (len < 0 || len > limit) {
    if (threadIdx.x == 0) report_error(error_flag, kBadContextLen);
    return len < 0 ? 0 : static_cast<int>(limit);
  }
  return len;
}

// GROUP: most query heads per thread block (1, 4 or 8); a KV head's group of
// num_heads / num_kv_heads query heads is split into ceil(group / GROUP) chunks.
// Grid: (num_kv_heads * chunks, num_seqs, num_partitions); block: kNumThreads threads.
template <typename T, int HEAD_SIZE, int GROUP>
__global__ void __launch_bounds__(kNumThreads, kMinBlocksFor<GROUP>) paged_attention_kernel(
    T* __restrict__ out,                  // [num_seqs, num_heads, head_size] (written when 1 partition)
    const T* __restrict__ query,          // [num_seqs, num_heads, head_size]
    const T* __restrict__ key_cache,      // [num_blocks, num_kv_heads, block_size, head_size]
    const T* __restrict__ value_cache,    // [num_blocks, num_kv_heads, block_size, head_size]
    const int* __restrict__ block_tables, // [num_seqs, max_blocks_per_seq]
    const int* __restrict__ context_lens, // [num_seqs]
    float* __restrict__ partial_out,      // [num_seqs, num_heads, num_partitions, head_size]
    float* __restrict__ partial_max,      // [num_seqs, num_heads, num_partitions]
    float* __restrict__ partial_sum,      // [num_seqs, num_heads, num_partitions]
    const AttentionShape shape, const float scale, int* error_flag) {
  constexpr int VEC = 16 / sizeof(T);          // elements per 16-byte load
  constexpr int LANES = HEAD_SIZE / VEC;       // threads sharing one K/V row
  constexpr int ROWS = kNumThreads / LANES;    // K/V rows in flight per step
  constexpr int UNROLL = kUnrollFor<GROUP>;
  constexpr int PER_HEAD = LANES / GROUP;      // lanes left holding one head's logit
  static_assert(LANES <= kWarpSize && (LANES & (LANES - 1)) == 0, "row must fit a warp");

  __shared__ float logits[GROUP][kPartitionSize];
  __shared__ float scratch[GROUP][kNumWarps];
  __shared__ float row_acc[ROWS][HEAD_SIZE];

  // Which query heads: [first_head, first_head + num_q), all reading KV head kv_head.
  const int group_size = shape.num_heads / shape.num_kv_heads;
  const int chunks = (group_size + GROUP - 1) / GROUP;
  const int kv_head = blockIdx.x / chunks;
  const int chunk_start = (blockIdx.x % chunks) * GROUP;
  const int first_head = kv_head * group_size + chunk_start;
  const int num_q = min(GROUP, group_size - chunk_start);
  const int seq = blockIdx.y, part = blockIdx.z, num_partitions = gridDim.z;
  auto out_row = [&](int g) {
    return out + seq * shape.out_stride_seq + static_cast<int64_t>(first_head + g) * shape.out_stride_head;
  };
  auto partial_index = [&](int g) {
    return (static_cast<int64_t>(seq) * shape.num_heads + first_head + g) * num_partitions + part;
  };

  const int context_len = guarded_context_len(context_lens, seq, num_partitions, shape, error_flag);
  if (context_len == 0) {  // nothing to attend to: zeros (the reduce kernel does it otherwise)
    if (num_partitions == 1)
      for (int i = threadIdx.x; i < num_q * HEAD_SIZE; i += kNumThreads) out_row(i / HEAD_SIZE)[i % HEAD_SIZE] = from_float<T>(0.f);
    return;
  }
  const int start = part * kPartitionSize;
  if (start >= context_len) return;  // this sequence is shorter than the longest one
  const int n = min(context_len - start, kPartitionSize);

  const int lane = threadIdx.x % LANES, row = threadIdx.x / LANES;
  const int* table = block_tables + static_cast<int64_t>(seq) * shape.max_blocks_per_seq;
  const int64_t lane_offset = static_cast<int64_t>(kv_head) * shape.cache_stride_head + lane * VEC;
  // The partition's block ids are checked once, here, so that the loops below need no check
  // (a check per K/V row costs registers, and ptxas spills). A bad id anywhere in it: report,
  // write a neutral result (zeros; in a split context, a partition of weight 0) and stop.
  __shared__ int bad_block;
  if (threadIdx.x == 0) bad_block = 0;
  __syncthreads();
  for (int b = start / shape.block_size + threadIdx.x; b <= (start + n - 1) / shape.block_size; b += kNumThreads) {
    if (table[b] < 0 || table[b] >= shape.num_blocks) bad_block = 1;
  }
  __syncthreads();
  if (bad_block) {  // the same for every thread of the block: an early return is safe
    if (threadIdx.x == 0) report_error(error_flag, kBadBlockId);
    for (int i = threadIdx.x; i < num_q * HEAD_SIZE; i += kNumThreads) {
      if (num_partitions == 1) {
        out_row(i / HEAD_SIZE)[i % HEAD_SIZE] = from_float<T>(0.f);
      } else {
        partial_out[partial_index(i / HEAD_SIZE) * HEAD_SIZE + i % HEAD_SIZE] = 0.f;
      }
    }
    if (num_partitions > 1 && static_cast<int>(threadIdx.x) < num_q) {
      partial_max[partial_index(threadIdx.x)] = -FLT_MAX;
      partial_sum[partial_index(threadIdx.x)] = 0.f;
    }
    return;
  }
  // Element offset (int64: pools may pass 2^31 elements), in either cache, of this lane's 16
  // bytes of partition token t.
  // NOTE: shifts for a power-of-two block size (the engine's): an integer division by a runtime
  // value is ~20 instructions, twice per row, and the GQA kernel is instruction-bound.
  auto row_offset = [&](int t) {
    const int pos = start + t;
    const int block = shape.block_shift >= 0 ? pos >> shape.block_shift : pos / shape.block_size;
    const int offset = pos - block * shape.block_size;
    return static_cast<int64_t>(table[block]) * shape.cache_stride_block +
           static_cast<int64_t>(offset) * shape.cache_stride_token + lane_offset;
  };

  float q[GROUP][VEC];  // this lane's slice of each query head, fp32, pre-scaled (0 past num_q)
#pragma unroll
  for (int g = 0; g < GROUP; ++g) {
    const T* q_row = query + seq * shape.q_stride_seq + static_cast<int64_t>(first_head + g) * shape.q_stride_head +
                     lane * VEC;
#pragma unroll
    for (int i = 0; i < VEC; ++i) q[g][i] = g < num_q ? to_float(q_row[i]) * scale : 0.f;
  }

  // Pass 1: logits[g][t] = q_g . k_t; this lane ends each row with head my_head's logit (heads
  // past num_q have q = 0 and are never stored). Trip counts are uniform across the block (the
  // shuffles inside need every lane).
  const int my_head = lane / PER_HEAD;
  float my_max = -FLT_MAX;
  for (int base = 0; base < n; base += ROWS * UNROLL) {
    uint4 raw[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int t = base + u * ROWS + row;
      raw[u] = t < n ? *reinterpret_cast<const uint4*>(key_cache + row_offset(t)) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int t = base + u * ROWS + row;
      float k[VEC];
      unpack<T>(raw[u], k);
      float s[GROUP];
#pragma unroll
      for (int g = 0; g < GROUP; ++g) {
        s[g] = 0.f;
#pragma unroll
        for (int i = 0; i < VEC; ++i) s[g] += q[g][i] * k[i];
      }
      const float logit = group_sum_scatter<LANES, GROUP>(s, lane);
      if (t < n && my_head < num_q) {
        my_max = fmaxf(my_max, logit);
        if (lane % PER_HEAD == 0) logits[my_head][t] = logit;
      }
    }
  }
  float max_logit[GROUP];
#pragma unroll
  for (int g = 0; g < GROUP; ++g) max_logit[g] = g == my_head ? my_max : -FLT_MAX;
  block_reduce<GROUP>(max_logit, scratch, MaxOp{});  // also publishes logits[][]

  float exp_sum[GROUP];
#pragma unroll
  for (int g = 0; g < GROUP; ++g) {
    exp_sum[g] = 0.f;
    if (g < num_q) {
      for (int t = threadIdx.x; t < n; t += kNumThreads) {
        const float e = expf(logits[g][t] - max_logit[g]);
        logits[g][t] = e;
        exp_sum[g] += e;
      }
    }
  }
  block_reduce<GROUP>(exp_sum, scratch, SumOp{});  // also publishes the exponentials

  // Pass 2: acc[g] = sum_t p[g][t] * v_t, each row of threads over its own tokens.
  float acc[GROUP][VEC] = {};
  for (int base = 0; base < n; base += ROWS * UNROLL) {
    uint4 raw[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int t = base + u * ROWS + row;
      raw[u] = t < n ? *reinterpret_cast<const uint4*>(value_cache + row_offset(t)) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int t = base + u * ROWS + row;
      if (t >= n) continue;
      float v[VEC];
      unpack<T>(raw[u], v);
#pragma unroll
      for (int g = 0; g < GROUP; ++g) {
        if (g < num_q) {
          const float p = logits[g][t];
#pragma unroll
          for (int i = 0; i < VEC; ++i) acc[g][i] += p * v[i];
        }
      }
    }
  }

  // Sum the rows' accumulators, one query head at a time through row_acc.
#pragma unroll
  for (int g = 0; g < GROUP; ++g) {
    if (g < num_q) {
#pragma unroll
      for (int i = 0; i < VEC; ++i) row_acc[row][lane * VEC + i] = acc[g][i];
      __syncthreads();
      for (int d = threadIdx.x; d < HEAD_SIZE; d += kNumThreads) {
        float o = 0.f;
#pragma unroll
        for (int r = 0; r < ROWS; ++r) o += row_acc[r][d];
        o /= exp_sum[g];  // normalised within this partition
        if (num_partitions == 1) {
          out_row(g)[d] = from_float<T>(o);
        } else {
          partial_out[partial_index(g) * HEAD_SIZE + d] = o;
        }
      }
      __syncthreads();  // row_acc is rewritten for the next head
      if (num_partitions > 1 && threadIdx.x == 0) {
        partial_max[partial_index(g)] = max_logit[g];
        partial_sum[partial_index(g)] = exp_sum[g];
      }
    }
  }
}

// Merges the partitions of paged_attention_kernel: out = sum_p w_p * o_p / sum_p w_p with
// w_p = exp_sum_p * exp(max_p - max), o_p each partition's normalised output.
// Grid: (num_heads, num_seqs); block: kNumThreads threads.
template <typename T, int HEAD_SIZE>
__global__ void __launch_bounds__(kNumThreads) paged_attention_reduce_kernel(
    T* __restrict__ out,                      // [num_seqs, num_heads, head_size]
    const float* __restrict__ partial_out,    // [num_seqs, num_heads, num_partitions, head_size]
    const float* __restrict__ partial_max,    // [num_seqs, num_heads, num_partitions]
    const float* __restrict__ partial_sum,    // [num_seqs, num_heads, num_partitions]
    const int* __restrict__ context_lens,     // [num_seqs]
    const AttentionShape shape, const int num_partitions, int* error_flag) {
  __shared__ float weights[kMaxPartitions];
  __shared__ float scratch[1][kNumWarps];

  const int head = blockIdx.x, seq = blockIdx.y;
  const int64_t out_offset = seq * shape.out_stride_seq + static_cast<int64_t>(head) * shape.out_stride_head;
  const int context_len = guarded_context_len(context_lens, seq, num_partitions, shape, error_flag);
  if (context_len == 0) {
    for (int d = threadIdx.x; d < HEAD_SIZE; d += kNumThreads) out[out_offset + d] = from_float<T>(0.f);
    return;
  }
  const int used = min((context_len + kPartitionSize - 1) / kPartitionSize, num_partitions);
  const int64_t first = (static_cast<int64_t>(seq) * shape.num_heads + head) * num_partitions;

  float max_logit[1] = {-FLT_MAX};
  for (int p = threadIdx.x; p < used; p += kNumThreads) max_logit[0] = fmaxf(max_logit[0], partial_max[first + p]);
  block_reduce<1>(max_logit, scratch, MaxOp{});

  float total[1] = {0.f};
  for (int p = threadIdx.x; p < used; p += kNumThreads) {
    const float w = partial_sum[first + p] * expf(partial_max[first + p] - max_logit[0]);
    weights[p] = w;
    total[0] += w;
  }
  block_reduce<1>(total, scratch, SumOp{});  // also publishes weights[]

  for (int d = threadIdx.x; d < HEAD_SIZE; d += kNumThreads) {
    float o = 0.f;
    for (int p = 0; p < used; ++p) o += weights[p] * partial_out[(first + p) * HEAD_SIZE + d];
    out[out_offset + d] = from_float<T>(o / total[0]);
  }
}

}  // namespace paged_serve::cuda::attention_kernels
