// The AVX2 + FMA path of the CPU paged attention kernel (attention.cpp): tiles of tokens taken
// from 8 (4) lanes of the context at once, K/V rows converted to fp32 in registers.
#pragma once

#include "attention_parts.h"

#if PAGED_SERVE_ATTENTION_AVX2

#include <ATen/Parallel.h>

#include <vector>

namespace paged_serve::cpu::attention {

// AVX2 + FMA path for head sizes that are a multiple of 8 (32, 64, 128 are instantiated).
//
// Why: the portable loops (attention.cpp's attend_one) reduce one dot product at a time (one accumulator, then a horizontal
// sum), a chain of D/8 dependent FMAs plus the reduction per (query head, token): at short
// contexts that latency, not memory, set the time (batch 64 x context 100, SmolLM2's 9/3 heads,
// head 64: ~40% of sum()'s read rate). Here pass 1 takes a tile of 8 tokens (4 for 512-byte
// rows, one from each lane of the context: see kAheadTiles) at a time: one independent
// accumulator per token and query head, reduced together by one hadd tree into the tile's
// logits; pass 2 keeps a query head's output slice in registers over the tile. Rows are
// converted to fp32 in registers (bf16: a 16-bit shift; fp16: F16C), so low-precision caches need no copy either.
// Summation order differs from the portable loops within a dot product (8 vector lanes, then a
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
// (512 bytes) took 4-10% longer at 8 than in the portable loops (2-core AVX2 EPYC, interleaved
// A/B); at 4 they take 7-34% less (30 layers' caches, b16 x 1024, b64 x 300, b64 x 128: 6.79 ->
// 5.67 ms, 8.32 -> 6.98, 3.91 -> 2.97). Rows of up to 256 bytes measured within 1-2% either way
// at 4 (bf16 a little slower), so they keep 8.
template <typename T, int D>
constexpr int kTileFor = D * static_cast<int>(sizeof(T)) > 256 ? 4 : 8;

// Scratch reused by every task a thread runs, instead of vectors allocated per task.
struct Scratch {
  std::vector<float> q, logits, inv_sum;
  // the AVX-512 path's: a tile's rows as fp32 (low-precision caches), the task's row offsets,
  // the softmax's weights as bf16 (bf16 caches)
  std::vector<float> rows;
  std::vector<int64_t> offsets;
  std::vector<uint16_t> weights;
};
inline Scratch& scratch() {
  thread_local Scratch s;
  return s;
}

// Which rows take the AVX2 path: whole vectors of up to 512 bytes (head 128 in fp32).
template <typename T, int D>
constexpr bool kAvx2Rows = D > 0 && D % 8 == 0 && !std::is_same_v<T, double> && D * sizeof(T) <= 512;

// The K/V rows of one task: (sequence, KV head) through its block table. The task attends to
// its `context_len` tokens, token t being position first + t of the sequence (first > 0 only
// under a sliding window: first_visible).
template <typename T>
struct TaskRows {
  const AttentionArgs* a;
  const T* key_cache;
  const T* value_cache;
  const int* block_table;
  int seq, kv_head, context_len;
  int first = 0;
  // Where token t's row is in either cache (K and V share their layout).
  int64_t offset(int t) const {
    const int p = first + t;
    return block_table[block_of(*a, p)] * a->cache_stride_block + kv_head * a->cache_stride_head +
           offset_in_block(*a, p) * a->cache_stride_token;
  }
  const T* row(const T* cache, int t) const { return cache + offset(t); }
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
  const HeadGroup<T> heads(a, seq, task.kv_head, D);
  const int group = heads.group;
  if (context_len == 0) return heads.zero_outputs(out);
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
  heads.scaled_queries(query, q);
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

  // Softmax per query head, in fp32 (as in the portable loops). Entries past the context (only the last lanes
  // have them) take -inf, then weigh 0 (their e^-87 in the sum is below its rounding).
  for (int g = 0; g < group; ++g) {
    float* l = logits + g * padded;
    cap_logits(a, l, padded);
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
  heads.write_outputs(out, acc_all, inv_sum);
}

}  // namespace paged_serve::cpu::attention

#endif  // PAGED_SERVE_ATTENTION_AVX2
