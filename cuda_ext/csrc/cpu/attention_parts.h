// The pieces of the CPU paged attention kernel (attention.cpp) that its portable loops and its
// AVX2 path (attention_avx2.h) share: the call's arguments, K/V rows as fp32, prefetches, the
// softmax's exps, and the portable dot / axpy loops.
#pragma once

#include "exp_poly.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define PAGED_SERVE_ATTENTION_AVX2 1
#else
#define PAGED_SERVE_ATTENTION_AVX2 0
#endif

namespace paged_serve::cpu::attention {

struct AttentionArgs {
  int num_heads, num_kv_heads, head_size, block_size, max_blocks_per_seq;
  int64_t q_stride_seq, q_stride_head, out_stride_seq, out_stride_head;
  int64_t cache_stride_block, cache_stride_head, cache_stride_token;
  float scale;
  int block_shift;  // log2(block_size) when it is a power of two, else -1 (see block_of)
  // A sliding window of `window` keys (0: none): the query, at position context_len - 1, sees
  // the keys at positions [context_len - window, context_len) only (see first_visible).
  int window = 0;
  // Logit soft-capping (0: none): a scaled logit s becomes softcap * tanh(s / softcap) before
  // the softmax (see cap_logits).
  float softcap = 0.f;
};

// The first position a sequence's query sees: context_len - window with a window, else 0. The
// keys it sees are then the contiguous positions [first, context_len), so every path runs its
// loops unchanged over context_len - first tokens counted from `first` (exact, no masking).
inline int first_visible(const AttentionArgs& a, int context_len) {
  return a.window > 0 ? std::max(0, context_len - a.window) : 0;
}

// The call's soft-cap (if any) on n scaled logits, in place (soft_cap: exp_poly.h, vectorised).
inline void cap_logits(const AttentionArgs& a, float* l, int n) {
  if (a.softcap <= 0.f) return;
  const float cap = a.softcap;
#pragma omp simd
  for (int t = 0; t < n; ++t) l[t] = soft_cap(l[t], cap);
}

// (block, offset) of token t: a shift and a mask for power-of-two block sizes (the ones used),
// a division otherwise. NOTE: a 32-bit division is ~10+ cycles of latency on x86; the vector
// paths find 4 rows per token (two passes, each with its prefetch), at short rows a visible part
// of a row's time.
inline int block_of(const AttentionArgs& a, int t) { return a.block_shift >= 0 ? t >> a.block_shift : t / a.block_size; }
inline int offset_in_block(const AttentionArgs& a, int t) {
  return a.block_shift >= 0 ? t & (a.block_size - 1) : t % a.block_size;
}

// The query heads one task computes: the `group` heads from `first_head` on (one KV head's), of
// sequence `seq`, with rows of D elements. What every path of the kernel reads and writes.
template <typename T>
struct HeadGroup {
  const AttentionArgs& a;
  int seq, first_head, group, D;
  HeadGroup(const AttentionArgs& args, int seq_, int kv_head, int head_size)
      : a(args), seq(seq_), first_head(kv_head * (args.num_heads / args.num_kv_heads)),
        group(args.num_heads / args.num_kv_heads), D(head_size) {}
  const T* query_row(const T* query, int g) const {
    return query + seq * a.q_stride_seq + (first_head + g) * a.q_stride_head;
  }
  T* out_row(T* out, int g) const { return out + seq * a.out_stride_seq + (first_head + g) * a.out_stride_head; }
  // A context of length 0 has nothing to attend to: its output is defined as zeros.
  void zero_outputs(T* out) const {
    for (int g = 0; g < group; ++g) std::fill(out_row(out, g), out_row(out, g) + D, T(0.f));
  }
  // q[g * D + i] = query row g, element i, in fp32, times the scale.
  void scaled_queries(const T* query, float* q) const {
    for (int g = 0; g < group; ++g) {
      const T* src = query_row(query, g);
      for (int i = 0; i < D; ++i) q[g * D + i] = static_cast<float>(src[i]) * a.scale;
    }
  }
  // Output row g, element i = acc[g * D + at(i)] * inv_sum[g] (`at`: where a path keeps element i).
  template <typename At>
  void write_outputs(T* out, const float* acc, const float* inv_sum, At at) const {
    for (int g = 0; g < group; ++g) {
      T* dst = out_row(out, g);
      for (int i = 0; i < D; ++i) dst[i] = static_cast<T>(acc[g * D + at(i)] * inv_sum[g]);
    }
  }
  void write_outputs(T* out, const float* acc, const float* inv_sum) const {
    write_outputs(out, acc, inv_sum, [](int i) { return i; });
  }
};

// Copy `n` elements of a K/V row to fp32 (a no-op view for fp32 caches).
template <typename T, int N>
inline const float* row_as_float(const T* src, float* buf, int n) {
  if constexpr (std::is_same_v<T, float>) {
    return src;
  } else {
    const int len = N > 0 ? N : n;
#pragma omp simd
    for (int i = 0; i < len; ++i) buf[i] = static_cast<float>(src[i]);
    return buf;
  }
}

// Ask for the row kPrefetchTokens tokens ahead of the one read. NOTE: blocks sit at random
// places in the pool, and one block of one head (e.g. 16 x 64 fp32 = 4 KB) is about a page, so
// the hardware prefetcher starts cold at every block; without this the kernel waits on memory
// latency, not bandwidth (batch 32 x 1024, head 64, 2 threads: 3.85 ms without, 1.74 with).
// 16-128 tokens ahead measured the same.
constexpr int kPrefetchTokens = 32;

// NOTE: GCC 12 left none of the attention kernel's __builtin_prefetch calls in the object code at -O1
// and above (they are there at -O0; a small test file keeps them, so the cause is not known);
// a volatile asm cannot be dropped. The builtin elsewhere than x86.
// NOTE: into L2 (prefetcht1), not L1: 32 rows ahead is more lines than L1 keeps in flight
// (head 128: 256 lines); on the 2-core AVX2 EPYC (bench_paged_attention.py --bandwidth, four
// runs with t0, five with t1) the fp32 read rate went from 50-64% of sum()'s to 70-84% at heads
// 32 and 64, and from 45-53% to 60-70% at head 128 (bf16: 23-29% -> 31-38%). prefetcht2
// measured the same as t1; 16 or 64 rows ahead, no better.
inline void prefetch_line(const char* p) {
#if defined(__x86_64__) || defined(__i386__)
  asm volatile("prefetcht1 %0" : : "m"(*p));
#else
  __builtin_prefetch(p, 0, 2);
#endif
}

template <typename T>
inline void prefetch_row(const T* row, int row_len) {
  constexpr int kLine = 64;
  const char* p = reinterpret_cast<const char*>(row);
  for (int b = 0; b < row_len * static_cast<int>(sizeof(T)); b += kLine) prefetch_line(p + b);
}

// exp(x) for x <= 0 (logits less their maximum), vectorised (exp_poly.h): with 2 query heads
// per KV head and head 32, libm's exps took as long as reading the K/V rows. Below -87 (e^x
// under FLT_MIN) it returns e^-87, which the softmax sum makes 0 in effect.
inline float exp_nonpositive(float x) { return exp_poly(std::max(x, -87.0f)); }

// l[t] = e^(l[t] - max l) in place, for t < n; returns 1 / their sum (the softmax's scale).
inline float exp_less_max(float* l, int n) {
  float max_logit = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : max_logit)
  for (int t = 0; t < n; ++t) max_logit = std::max(max_logit, l[t]);
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int t = 0; t < n; ++t) {
    l[t] = exp_nonpositive(l[t] - max_logit);
    sum += l[t];
  }
  return 1.f / sum;
}

template <int N>
inline float dot(const float* a, const float* b, int n) {
  const int len = N > 0 ? N : n;
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int i = 0; i < len; ++i) sum += a[i] * b[i];
  return sum;
}

template <int N>
inline void axpy(float alpha, const float* x, float* y, int n) {
  const int len = N > 0 ? N : n;
#pragma omp simd
  for (int i = 0; i < len; ++i) y[i] += alpha * x[i];
}

}  // namespace paged_serve::cpu::attention
