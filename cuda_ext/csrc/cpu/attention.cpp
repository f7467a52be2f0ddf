// CPU paged attention (decode): one query token per sequence against its cached K/V, read
// through the sequence's block table.
//
// Work split: one task per (sequence, KV head). A task computes all the query heads of its GQA
// group, so every K/V row is read from memory once and used `group` times. Tasks run in
// parallel with at::parallel_for; the loops over head_size are written so that the compiler
// vectorises them (fixed trip count for the instantiated head sizes, `omp simd` reductions).

#include "cpu_ops.h"

#include "../checks.h"
#include "exp_poly.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define PAGED_SERVE_ATTENTION_AVX2 1
#else
#define PAGED_SERVE_ATTENTION_AVX2 0
#endif

namespace paged_serve::cpu {
namespace {

struct AttentionArgs {
  int num_heads, num_kv_heads, head_size, block_size, max_blocks_per_seq;
  int64_t q_stride_seq, q_stride_head, out_stride_seq, out_stride_head;
  int64_t cache_stride_block, cache_stride_head, cache_stride_token;
  float scale;
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

// NOTE: GCC 12 left none of this file's __builtin_prefetch calls in the object code at -O1
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

// One (sequence, KV head) task. HEAD_SIZE > 0 fixes the head size at compile time; 0 means
// "read it from args" (the generic instantiation for head sizes we do not specialise).
template <typename T, int HEAD_SIZE>
void attend_one(const AttentionArgs& a, int seq, int kv_head, T* out, const T* query,
                const T* key_cache, const T* value_cache, const int* block_table, int context_len) {
  const int D = HEAD_SIZE > 0 ? HEAD_SIZE : a.head_size;
  const int group = a.num_heads / a.num_kv_heads;
  const int first_head = kv_head * group;
  auto out_row = [&](int g) { return out + seq * a.out_stride_seq + (first_head + g) * a.out_stride_head; };

  if (context_len == 0) {  // nothing to attend to: define the output as zeros
    for (int g = 0; g < group; ++g) std::fill(out_row(g), out_row(g) + D, T(0.f));
    return;
  }

  std::vector<float> q(group * D), acc(group * D, 0.f), logits(group * context_len), buf(D);
  for (int g = 0; g < group; ++g) {
    const T* src = query + seq * a.q_stride_seq + (first_head + g) * a.q_stride_head;
    for (int i = 0; i < D; ++i) q[g * D + i] = static_cast<float>(src[i]) * a.scale;
  }

  // Pass 1: logits[g, t] = q_g . k_t, walking the block table.
  const int num_blocks = (context_len + a.block_size - 1) / a.block_size;
  auto block_start = [&](const T* cache, int b) {
    return cache + block_table[b] * a.cache_stride_block + kv_head * a.cache_stride_head;
  };
  // NOTE: one row at a time, kPrefetchTokens ahead of the row read: a whole block asked for at
  // once (64 lines at block 16, head 64) is more than the core keeps in flight, and ran at
  // ~half the rate (3.05 vs 1.74 ms at batch 32 x 1024, 2 threads).
  auto prefetch_token = [&](const T* cache, int t) {
    if (t < context_len)
      prefetch_row(block_start(cache, t / a.block_size) + (t % a.block_size) * a.cache_stride_token, D);
  };
  for (int t = 0; t < std::min(kPrefetchTokens, context_len); ++t) prefetch_token(key_cache, t);
  for (int b = 0; b < num_blocks; ++b) {
    const T* k_block = block_start(key_cache, b);
    const int tokens = std::min(a.block_size, context_len - b * a.block_size);
    for (int off = 0; off < tokens; ++off) {
      prefetch_token(key_cache, b * a.block_size + off + kPrefetchTokens);
      const float* k = row_as_float<T, HEAD_SIZE>(k_block + off * a.cache_stride_token, buf.data(), D);
      const int t = b * a.block_size + off;
      for (int g = 0; g < group; ++g) logits[g * context_len + t] = dot<HEAD_SIZE>(&q[g * D], k, D);
    }
  }

  // Softmax per query head, in fp32.
  std::vector<float> inv_sum(group);
  for (int g = 0; g < group; ++g) inv_sum[g] = exp_less_max(&logits[g * context_len], context_len);

  // Pass 2: acc[g] = sum_t p[g, t] * v_t.
  for (int t = 0; t < std::min(kPrefetchTokens, context_len); ++t) prefetch_token(value_cache, t);
  for (int b = 0; b < num_blocks; ++b) {
    const T* v_block = block_start(value_cache, b);
    const int tokens = std::min(a.block_size, context_len - b * a.block_size);
    for (int off = 0; off < tokens; ++off) {
      prefetch_token(value_cache, b * a.block_size + off + kPrefetchTokens);
      const float* v = row_as_float<T, HEAD_SIZE>(v_block + off * a.cache_stride_token, buf.data(), D);
      const int t = b * a.block_size + off;
      for (int g = 0; g < group; ++g) axpy<HEAD_SIZE>(logits[g * context_len + t], v, &acc[g * D], D);
    }
  }

  for (int g = 0; g < group; ++g) {
    T* dst = out_row(g);
    for (int i = 0; i < D; ++i) dst[i] = static_cast<T>(acc[g * D + i] * inv_sum[g]);
  }
}

#if PAGED_SERVE_ATTENTION_AVX2
// ---------------------------------------------------------------------------------------------
// AVX2 + FMA path for head sizes that are a multiple of 8 (32, 64, 128 are instantiated).
//
// Why: the loops above reduce one dot product at a time (one accumulator, then a horizontal
// sum), a chain of D/8 dependent FMAs plus the reduction per (query head, token): at short
// contexts that latency, not memory, set the time (batch 64 x context 100, SmolLM2's 9/3 heads,
// head 64: ~40% of sum()'s read rate). Here pass 1 takes a tile of 8 tokens (4 for 512-byte
// rows, one from each lane of the context: see kAheadTiles) at a time: one independent
// accumulator per token and query head, reduced together by one hadd tree into the tile's
// logits; pass 2 keeps a query head's output slice in registers over the tile. Rows are
// converted to fp32 in registers (bf16: a 16-bit shift; fp16: F16C), so low-precision caches need no copy either.
// Summation order differs from the loops above within a dot product (8 vector lanes, then a
// tree) and in pass 2 (tokens added in tile order); the softmax is the same code.

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// The 8 horizontal sums of s[0..7], as one vector (lane i: the sum of s[i]'s lanes).
inline __m256 hsum8(const __m256* s) {
  const __m256 h01 = _mm256_hadd_ps(s[0], s[1]), h23 = _mm256_hadd_ps(s[2], s[3]);
  const __m256 h45 = _mm256_hadd_ps(s[4], s[5]), h67 = _mm256_hadd_ps(s[6], s[7]);
  const __m256 lo = _mm256_hadd_ps(h01, h23), hi = _mm256_hadd_ps(h45, h67);
  // lo = [s0a s1a s2a s3a | s0b s1b s2b s3b] (a, b: the sums of each 128-bit half), hi likewise
  return _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31));
}

// The 4 horizontal sums of s[0..3], as one vector (lane i: the sum of s[i]'s lanes).
inline __m128 hsum4(const __m256* s) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(s[0], s[1]), _mm256_hadd_ps(s[2], s[3]));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// Tokens per step of both passes: 8, or 4 for rows over 256 bytes. NOTE: fp32 rows of head 128
// (512 bytes) took 4-10% longer at 8 than in the loops above (2-core AVX2 EPYC, interleaved
// A/B); at 4 they take 7-34% less (30 layers' caches, b16 x 1024, b64 x 300, b64 x 128: 6.79 ->
// 5.67 ms, 8.32 -> 6.98, 3.91 -> 2.97). Rows of up to 256 bytes measured within 1-2% either way
// at 4 (bf16 a little slower), so they keep 8.
template <typename T, int D>
constexpr int kTileFor = D * static_cast<int>(sizeof(T)) > 256 ? 4 : 8;

// Scratch reused by every task a thread runs, instead of vectors allocated per task.
struct Scratch {
  std::vector<float> q, logits, inv_sum;
};
inline Scratch& scratch() {
  thread_local Scratch s;
  return s;
}

// Which rows take the AVX2 path: whole vectors of up to 512 bytes (head 128 in fp32).
template <typename T, int D>
constexpr bool kAvx2Rows = D > 0 && D % 8 == 0 && !std::is_same_v<T, double> && D * sizeof(T) <= 512;

// The K/V rows of one task: (sequence, KV head) through its block table.
template <typename T>
struct TaskRows {
  const AttentionArgs* a;
  const T* key_cache;
  const T* value_cache;
  const int* block_table;
  int seq, kv_head, context_len;
  const T* row(const T* cache, int t) const {
    return cache + block_table[t / a->block_size] * a->cache_stride_block + kv_head * a->cache_stride_head +
           (t % a->block_size) * a->cache_stride_token;
  }
  // Tiles per pass (`per`) when a tile holds one token from each of `tile` lanes: lane i is
  // tokens [i * per, (i + 1) * per), and tile j holds lane_token(per, j, i) of every lane i.
  int tiles(int tile) const { return (context_len + tile - 1) / tile; }
  static int lane_token(int per, int j, int i) { return i * per + j; }
  // Prefetch the rows of `cache`'s tile j (tokens past the context skipped).
  void prefetch_tile(const T* cache, int tile, int j, int row_len) const {
    const int per = tiles(tile);
    for (int i = 0; i < tile; ++i)
      if (lane_token(per, j, i) < context_len) prefetch_row(row(cache, lane_token(per, j, i)), row_len);
  }
};

// NOTE: a tile holds one token from each of its lanes (TaskRows::tiles), not consecutive tokens:
// the core then reads 8 (or 4) sequential streams at once instead of one, and the hardware
// prefetcher, which follows a stream only within a 4 KB page and starts cold at every block (at
// a random place in the pool), keeps more of them in flight. Reading K/V rows alone through
// random block tables, 30 layers' caches (from DRAM, as in the model): one stream 48-52% of
// sum()'s rate, 8 streams 71-92%.
// Software prefetches run as one stream of tiles, kAheadTiles ahead: the K tiles, then the V
// tiles, then the next task's K tiles, so that a pass or a task never starts by waiting for its
// own first rows. NOTE: 2 tiles ahead for rows of up to 256 bytes (at the workload's short
// contexts lanes are a block or two long and the hardware prefetcher has no time to start:
// b64 x 100 head 64, 0.52 ms without, 0.42 with); none for 512-byte rows, where a tile's
// compute is long enough for the hardware prefetcher and the prefetches only cost instructions
// (head 128, b16 x 1024: 4.1 ms without, 4.6 with).
template <typename T, int D>
constexpr int kAheadTiles = D * static_cast<int>(sizeof(T)) > 256 ? 0 : 2;

template <typename T, int D>
void attend_one_avx2(const AttentionArgs& a, const TaskRows<T>& task, const TaskRows<T>* next, T* out,
                     const T* query) {
  const int seq = task.seq, context_len = task.context_len;
  static_assert(D % 8 == 0, "the AVX2 path takes whole vectors");
  constexpr int V = D / 8;  // vectors per row
  constexpr int kTile = kTileFor<T, D>;
  const int group = a.num_heads / a.num_kv_heads;
  const int first_head = task.kv_head * group;
  auto out_row = [&](int g) { return out + seq * a.out_stride_seq + (first_head + g) * a.out_stride_head; };
  if (context_len == 0) {
    for (int g = 0; g < group; ++g) std::fill(out_row(g), out_row(g) + D, T(0.f));
    return;
  }
  Scratch& s = scratch();
  // logits in tile order (entry j * kTile + i: lane i's token of tile j), padded to whole tiles
  const int per = task.tiles(kTile);
  const int padded = per * kTile;
  auto token = [&](int t0, int i) { return TaskRows<T>::lane_token(per, t0 / kTile, i); };  // at t0 + i
  s.q.resize(static_cast<size_t>(group) * D);
  s.logits.resize(static_cast<size_t>(group) * padded);
  s.inv_sum.resize(group);
  float* q = s.q.data();
  float* logits = s.logits.data();
  float* inv_sum = s.inv_sum.data();
  for (int g = 0; g < group; ++g) {
    const T* src = query + seq * a.q_stride_seq + (first_head + g) * a.q_stride_head;
    for (int i = 0; i < D; ++i) q[g * D + i] = static_cast<float>(src[i]) * a.scale;
  }
  // the m-th tile of this task's stream (K tiles, then V tiles), then of the next task's
  auto prefetch_tile = [&](int m) {
    if constexpr (kAheadTiles<T, D> > 0) {
      if (m < 2 * per) task.prefetch_tile(m < per ? task.key_cache : task.value_cache, kTile, m % per, D);
      else if (next != nullptr && m - 2 * per < next->tiles(kTile)) next->prefetch_tile(next->key_cache, kTile, m - 2 * per, D);
    }
  };

  // Pass 1: logits[g, t] = q_g . k_t, a tile at a time. A lane past the context's end repeats
  // its last row (valid memory); its logit is masked below.
  const T* rows[kTile];
  for (int t0 = 0; t0 < padded; t0 += kTile) {
    prefetch_tile(t0 / kTile + kAheadTiles<T, D>);
    for (int i = 0; i < kTile; ++i) rows[i] = task.row(task.key_cache, std::min(token(t0, i), context_len - 1));
    for (int g = 0; g < group; ++g) {
      const float* qg = q + g * D;
      __m256 acc[kTile];
      for (int i = 0; i < kTile; ++i) acc[i] = _mm256_mul_ps(_mm256_loadu_ps(qg), load8(rows[i]));
      for (int v = 1; v < V; ++v) {
        const __m256 qv = _mm256_loadu_ps(qg + 8 * v);
        for (int i = 0; i < kTile; ++i) acc[i] = _mm256_fmadd_ps(qv, load8(rows[i] + 8 * v), acc[i]);
      }
      if constexpr (kTile == 8) _mm256_storeu_ps(logits + g * padded + t0, hsum8(acc));
      else _mm_storeu_ps(logits + g * padded + t0, hsum4(acc));
    }
  }

  // Softmax per query head, in fp32 (as above). Entries past the context (only the last lanes
  // have them) take -inf, then weigh 0 (their e^-87 in the sum is below its rounding).
  for (int g = 0; g < group; ++g) {
    float* l = logits + g * padded;
    auto past_context = [&](float value) {
      for (int t0 = 0; t0 < padded; t0 += kTile)
        for (int i = 0; i < kTile; ++i)
          if (token(t0, i) >= context_len) l[t0 + i] = value;
    };
    past_context(-std::numeric_limits<float>::infinity());
    inv_sum[g] = exp_less_max(l, padded);
    past_context(0.f);
  }

  // Pass 2: out_g = sum_t p[g, t] v_t / sum. Per query head, its D floats of output stay in
  // registers in chunks of up to 8 vectors while a tile's 8 rows are added in.
  constexpr int kChunk = V < 8 ? V : 8;
  static_assert(V % kChunk == 0, "D / 8 is a multiple of the chunk");
  // NOTE: the output accumulates in q's scratch (q is no longer needed)
  float* acc_all = q;
  std::fill(acc_all, acc_all + group * D, 0.f);
  for (int t0 = 0; t0 < padded; t0 += kTile) {
    prefetch_tile(per + t0 / kTile + kAheadTiles<T, D>);
    for (int i = 0; i < kTile; ++i) rows[i] = task.row(task.value_cache, std::min(token(t0, i), context_len - 1));
    for (int g = 0; g < group; ++g) {
      const float* p = logits + g * padded + t0;
      for (int c = 0; c < V; c += kChunk) {
        float* dst = acc_all + g * D + 8 * c;
        __m256 acc[kChunk];
        for (int v = 0; v < kChunk; ++v) acc[v] = _mm256_loadu_ps(dst + 8 * v);
        for (int i = 0; i < kTile; ++i) {
          const __m256 pi = _mm256_broadcast_ss(p + i);
          for (int v = 0; v < kChunk; ++v) acc[v] = _mm256_fmadd_ps(pi, load8(rows[i] + 8 * (c + v)), acc[v]);
        }
        for (int v = 0; v < kChunk; ++v) _mm256_storeu_ps(dst + 8 * v, acc[v]);
      }
    }
  }
  for (int g = 0; g < group; ++g) {
    T* dst = out_row(g);
    const float* acc = acc_all + g * D;
    for (int i = 0; i < D; ++i) dst[i] = static_cast<T>(acc[i] * inv_sum[g]);
  }
}
#endif  // PAGED_SERVE_ATTENTION_AVX2

template <typename T, int HEAD_SIZE>
void paged_attention_impl(const AttentionArgs& a, int num_seqs, T* out, const T* query,
                          const T* key_cache, const T* value_cache, const int* block_tables,
                          const int* context_lens) {
  const int64_t num_tasks = static_cast<int64_t>(num_seqs) * a.num_kv_heads;
  at::parallel_for(0, num_tasks, 1, [&](int64_t begin, int64_t end) {
#if PAGED_SERVE_ATTENTION_AVX2
    if constexpr (kAvx2Rows<T, HEAD_SIZE>) {
      auto rows_of = [&](int64_t task) {
        const int seq = static_cast<int>(task / a.num_kv_heads);
        return TaskRows<T>{&a, key_cache, value_cache, block_tables + static_cast<int64_t>(seq) * a.max_blocks_per_seq,
                           seq, static_cast<int>(task % a.num_kv_heads), context_lens[seq]};
      };
      // the stream's first tiles; every later task's come with the task before it
      TaskRows<T> here = rows_of(begin);
      constexpr int kTile = kTileFor<T, HEAD_SIZE>;
      for (int j = 0; j < std::min(kAheadTiles<T, HEAD_SIZE>, here.tiles(kTile)); ++j)
        here.prefetch_tile(key_cache, kTile, j, HEAD_SIZE);
      for (int64_t task = begin; task < end; ++task) {
        const bool last = task + 1 == end;
        const TaskRows<T> next = last ? here : rows_of(task + 1);
        attend_one_avx2<T, HEAD_SIZE>(a, here, last ? nullptr : &next, out, query);
        here = next;
      }
      return;
    }
#endif
    for (int64_t task = begin; task < end; ++task) {
      const int seq = static_cast<int>(task / a.num_kv_heads);
      attend_one<T, HEAD_SIZE>(a, seq, static_cast<int>(task % a.num_kv_heads), out, query, key_cache, value_cache,
                               block_tables + static_cast<int64_t>(seq) * a.max_blocks_per_seq, context_lens[seq]);
    }
  });
}

}  // namespace

void paged_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, const at::Tensor& block_tables,
                     const at::Tensor& context_lens, double scale, int64_t max_context_len) {
  // NOTE: the same checks as the CUDA binding, so that both backends refuse the same calls;
  // max_context_len only bounds context_lens here (the CPU kernel sizes buffers per sequence).
  checks::check_attention(out, query, key_cache, value_cache, block_tables, context_lens, max_context_len);
  checks::check_tables_on_host(block_tables, context_lens, key_cache.size(0), key_cache.size(2), max_context_len);
  const int num_kv_heads = static_cast<int>(key_cache.size(1));

  const at::Tensor tables = block_tables.contiguous();
  const at::Tensor lens = context_lens.contiguous();
  const AttentionArgs args{
      static_cast<int>(query.size(1)), num_kv_heads, static_cast<int>(query.size(2)),
      static_cast<int>(key_cache.size(2)), static_cast<int>(tables.size(1)),
      query.stride(0), query.stride(1), out.stride(0), out.stride(1),
      key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), static_cast<float>(scale)};

  const int* table_data = tables.const_data_ptr<int>();
  const int* len_data = lens.const_data_ptr<int>();

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, query.scalar_type(), "paged_attention_cpu", [&] {
    auto run = [&](auto head_size_tag) {
      constexpr int HS = decltype(head_size_tag)::value;
      paged_attention_impl<scalar_t, HS>(args, static_cast<int>(query.size(0)), out.data_ptr<scalar_t>(),
                                         query.const_data_ptr<scalar_t>(), key_cache.const_data_ptr<scalar_t>(),
                                         value_cache.const_data_ptr<scalar_t>(), table_data, len_data);
    };
    switch (args.head_size) {
      case 32: run(std::integral_constant<int, 32>{}); break;
      case 64: run(std::integral_constant<int, 64>{}); break;
      case 128: run(std::integral_constant<int, 128>{}); break;
      default: run(std::integral_constant<int, 0>{}); break;  // generic, any head size
    }
  });
}

}  // namespace paged_serve::cpu
