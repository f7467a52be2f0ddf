// The AVX-512 path of the CPU paged attention kernel (attention.cpp): the AVX2 path's tiles of
// tokens (attention_avx2.h: lanes of the context, one prefetch stream per thread) with 16-float
// vectors, each K/V row converted at most once instead of once per query head, and bf16 caches
// multiplied as bf16 (vdpbf16ps) where the CPU has AVX512_BF16.
#pragma once

#include "attention_avx2.h"

#if PAGED_SERVE_ATTENTION_AVX2 && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && \
    defined(__AVX512VL__)
#define PAGED_SERVE_ATTENTION_AVX512 1
#else
#define PAGED_SERVE_ATTENTION_AVX512 0
#endif

#if PAGED_SERVE_ATTENTION_AVX512

namespace paged_serve::cpu::attention {

// Why a second vector path: the AVX2 path converts a bf16 or fp16 row to fp32 in registers for
// every query head of the group, in both passes (4 heads at head 128: 4 x 16 conversions of 2-3
// instructions per row). On a 2-core Zen 4 EPYC that, not memory, set bf16's time: 46-50% of
// sum()'s read rate at heads 32, 64 and 128 (fp32: 73-86%); with every row in L2 it took as
// long as from DRAM. Here:
// - Where each row is (block table, strides) is found once per token (TaskRows::offset).
// - pass 1 (q . k): fp32 rows are FMAs on 16 lanes. bf16 rows (AVX512_BF16) are vdpbf16ps
//   straight from the cache against the query's own bf16 values (products exact in fp32, sums
//   in fp32); the scale multiplies the logits instead of the query. fp16 rows (and bf16 without
//   AVX512_BF16) are converted to fp32 once per row into scratch.
// - pass 2 (p . v): fp32 rows as they are, fp16 ones converted once; bf16 rows (AVX512_BF16)
//   two tokens per vdpbf16ps, so the softmax's weights are rounded to bf16 (as GPU kernels,
//   vLLM's among them, round them to the cache's type) and normalised by the sum of the rounded
//   weights. Measured against the fp32 reference (random caches, contexts of 512-1024), the
//   mean error of the bf16 output went from 0.6e-4 to 0.9e-4, under its own rounding (a half
//   ulp of bf16 at |out| ~0.05 is 1.2e-4).
// Summation order differs from the portable loops (16 lanes then a tree; pass 2 in tile order).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// The 8 horizontal sums of s[0..7], as one 8-float vector (lane i: the sum of s[i]'s lanes):
// a tree of 128-bit-chunk shuffles (24 instructions; halving each vector to 256 bits first and
// summing with hadds took ~37, and at head 32 in bf16 the sums were ~15% of the kernel's time).
inline __m256 hsum8x16(const __m512* s) {
  // pairs: chunks (0 + 2, 1 + 3) of s[a], then of s[b]
  auto pair = [](__m512 a, __m512 b) {
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  };
  const __m512 p01 = pair(s[0], s[1]), p23 = pair(s[2], s[3]), p45 = pair(s[4], s[5]), p67 = pair(s[6], s[7]);
  // quads: chunk k holds 4 partial sums of s[k] (q0) or s[4 + k] (q1)
  const __m512 q0 = _mm512_add_ps(_mm512_shuffle_f32x4(p01, p23, 0x88), _mm512_shuffle_f32x4(p01, p23, 0xDD));
  const __m512 q1 = _mm512_add_ps(_mm512_shuffle_f32x4(p45, p67, 0x88), _mm512_shuffle_f32x4(p45, p67, 0xDD));
  // chunk k: [s[k] (0 + 2), s[k] (1 + 3), s[4 + k] (0 + 2), s[4 + k] (1 + 3)], then the two added
  const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(q0, q1, 0x88), _mm512_shuffle_ps(q0, q1, 0xDD));
  const __m512 t = _mm512_add_ps(r, _mm512_permute_ps(r, 0xB1));  // lanes 4k, 4k + 2: s[k], s[4 + k]
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 2, 6, 10, 14, 0, 0, 0, 0, 0, 0, 0, 0);
  return _mm512_castps512_ps256(_mm512_permutexvar_ps(order, t));
}

// Which rows take this path: whole 16-float vectors of up to 512 bytes.
template <typename T, int D>
constexpr bool kAvx512Rows = D > 0 && D % 16 == 0 && !std::is_same_v<T, double> && D * sizeof(T) <= 512;

// both passes on vdpbf16ps: bf16 rows of whole 32-element vectors where the CPU has AVX512_BF16
template <typename T, int D>
constexpr bool kBf16Dot =
#if defined(__AVX512BF16__)
    std::is_same_v<T, c10::BFloat16> && D % 32 == 0;
#else
    false;
#endif

// Tokens per tile (one from each of kTile512 lanes, as in the AVX2 path) and how many tiles
// ahead the software prefetches run. NOTE: measured on the 2-core Zen 4 EPYC with the caches
// read from DRAM (in-process A/B, interleaved, the six shapes of bench_paged_attention.py
// --bandwidth): 8 tiles ahead for rows of up to 256 bytes and 4 for 512-byte rows (fp32 head
// 128) took 4-18% less time than 4 and 2; 12-24 and 6-8 measured the same as 8 and 4.
constexpr int kTile512 = 8;
template <typename T, int D>
constexpr int kAhead512 = D * static_cast<int>(sizeof(T)) > 256 ? 4 : 8;

// The softmax's weights in place over one query head's logits in tile order (entry j * tile + i:
// lane i's token j, `per` tokens per lane; entries past the context repeat the last row's logit,
// so they never exceed the maximum), returning 1 / their sum. Entries past the context become
// 0. With `bf16` given, every weight is rounded to bf16 (nearest even), its bits are written
// there, and the sum is of the rounded weights, so the weights pass 2 uses sum to one.
inline float softmax_weights(float* l, int per, int tile, int context_len, uint16_t* bf16) {
  const int n = per * tile;
  __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  int t = 0;
  for (; t + 16 <= n; t += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(l + t));
  float max_logit = _mm512_reduce_max_ps(vmax);
  for (; t < n; ++t) max_logit = std::max(max_logit, l[t]);
#pragma omp simd
  for (int k = 0; k < n; ++k) l[k] = exp_nonpositive(l[k] - max_logit);
  for (int i = 0; i < tile; ++i)  // lane i holds tokens [i * per, (i + 1) * per)
    for (int j = std::max(0, context_len - i * per); j < per; ++j) l[j * tile + i] = 0.f;
  float sum = 0.f;
  if (bf16 != nullptr) {
#pragma omp simd reduction(+ : sum)
    for (int k = 0; k < n; ++k) {
      uint32_t bits;
      std::memcpy(&bits, &l[k], 4);
      bits = (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;  // finite and >= 0: no NaN case
      bf16[k] = static_cast<uint16_t>(bits >> 16);
      std::memcpy(&l[k], &bits, 4);
      sum += l[k];
    }
  } else {
#pragma omp simd reduction(+ : sum)
    for (int k = 0; k < n; ++k) sum += l[k];
  }
  return 1.f / sum;
}

// Where output element d sits in the pair-wise pass 2's accumulators: per 32-element chunk,
// unpacklo's 16 lanes (4 per 128-bit lane: d = 8k .. 8k + 3 in lane k), then unpackhi's (8k + 4 ..).
constexpr int unpacked_index(int d) {
  const int c = d / 32, k = (d % 32) / 8, j = d % 8;
  return 32 * c + (j < 4 ? 0 : 16) + 4 * k + (j % 4);
}

template <typename T, int D>
void attend_one_avx512(const AttentionArgs& a, const TaskRows<T>& task, const TaskRows<T>* next, T* out,
                       const T* query) {
  const int seq = task.seq, context_len = task.context_len;
  constexpr int V = D / 16;  // 16-float vectors per row
  constexpr int kTile = kTile512;
  const HeadGroup<T> heads(a, seq, task.kv_head, D);
  const int group = heads.group;
  if (context_len == 0) return heads.zero_outputs(out);
  Scratch& s = scratch();
  constexpr int ahead = kAhead512<T, D>;
  const int per = task.tiles(kTile);
  const int padded = per * kTile;
  s.q.resize(static_cast<size_t>(group) * D);
  s.logits.resize(static_cast<size_t>(group) * padded);
  s.inv_sum.resize(group);
  // fp16 rows (and bf16 without AVX512_BF16) are converted into `rows`; fp32 and vdpbf16ps read the cache
  if constexpr (!std::is_same_v<T, float> && !kBf16Dot<T, D>) s.rows.resize(static_cast<size_t>(kTile) * D);
  s.offsets.resize(padded);
  if constexpr (kBf16Dot<T, D>) s.weights.resize(static_cast<size_t>(group) * padded);
  uint16_t* weights = s.weights.data();  // the bf16 path's softmax weights as bf16
  float* q = s.q.data();
  float* logits = s.logits.data();
  float* inv_sum = s.inv_sum.data();
  float* converted = s.rows.data();
  // Where each row of the task is, in tile order (entry t0 + i: lane i's token of tile t0; a
  // lane past the context's end repeats its last row, valid memory whose weight the softmax
  // sets to 0). K and V rows sit at the same offsets of their caches. NOTE: found once per token
  // here instead of per read and per prefetch in both passes (4 block-table walks per token).
  int64_t* offsets = s.offsets.data();
  for (int i = 0; i < kTile; ++i)
    for (int j = 0; j < per; ++j) offsets[j * kTile + i] = task.offset(std::min(TaskRows<T>::lane_token(per, j, i), context_len - 1));
  auto prefetch_tile = [&](int m) {
    if constexpr (ahead > 0) {
      if (m < 2 * per) {
        const T* cache = m < per ? task.key_cache : task.value_cache;
        const int64_t* at = offsets + (m % per) * kTile;
        for (int i = 0; i < kTile; ++i) prefetch_row(cache + at[i], D);
      } else if (next != nullptr && m - 2 * per < next->tiles(kTile)) {
        next->prefetch_tile(next->key_cache, kTile, m - 2 * per, D);
      }
    }
  };
  // Rows of tile t0 as fp32: in place for fp32 caches, else converted into `converted`.
  const float* rows[kTile];
  auto tile_as_float = [&](const T* cache, int t0) {
    for (int i = 0; i < kTile; ++i) {
      const T* row = cache + offsets[t0 + i];
      if constexpr (std::is_same_v<T, float>) {
        rows[i] = row;
      } else {
        float* dst = converted + i * D;
        for (int v = 0; v < V; ++v) _mm512_storeu_ps(dst + 16 * v, load16(row + 16 * v));
        rows[i] = dst;
      }
    }
  };

  // Pass 1: logits[g, t] = q_g . k_t, a tile at a time.
  if constexpr (kBf16Dot<T, D>) {
#if defined(__AVX512BF16__)
    // the query's bf16 bits, as pairs: vdpbf16ps multiplies them with the row's pairs
    auto* qb = reinterpret_cast<uint16_t*>(q);  // group * D bf16 fit in q's group * D floats
    for (int g = 0; g < group; ++g)
      std::memcpy(qb + g * D, heads.query_row(query, g), D * sizeof(T));
    const __m256 scale = _mm256_set1_ps(a.scale);
    const T* krows[kTile];
    for (int t0 = 0; t0 < padded; t0 += kTile) {
      prefetch_tile(t0 / kTile + ahead);
      for (int i = 0; i < kTile; ++i) krows[i] = task.key_cache + offsets[t0 + i];
      for (int g = 0; g < group; ++g) {
        const uint16_t* qg = qb + g * D;
        __m512 acc[kTile];
        for (int i = 0; i < kTile; ++i) acc[i] = _mm512_setzero_ps();
        for (int v = 0; v < D / 32; ++v) {
          const __m512bh qv = (__m512bh)_mm512_loadu_si512(qg + 32 * v);
          for (int i = 0; i < kTile; ++i)
            acc[i] = _mm512_dpbf16_ps(acc[i], qv, (__m512bh)_mm512_loadu_si512(krows[i] + 32 * v));
        }
        _mm256_storeu_ps(logits + g * padded + t0, _mm256_mul_ps(hsum8x16(acc), scale));
      }
    }
#endif
  } else {
    heads.scaled_queries(query, q);
    for (int t0 = 0; t0 < padded; t0 += kTile) {
      prefetch_tile(t0 / kTile + ahead);
      tile_as_float(task.key_cache, t0);
      for (int g = 0; g < group; ++g) {
        const float* qg = q + g * D;
        __m512 acc[kTile];
        for (int i = 0; i < kTile; ++i) acc[i] = _mm512_mul_ps(_mm512_loadu_ps(qg), _mm512_loadu_ps(rows[i]));
        for (int v = 1; v < V; ++v) {
          const __m512 qv = _mm512_loadu_ps(qg + 16 * v);
          for (int i = 0; i < kTile; ++i) acc[i] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(rows[i] + 16 * v), acc[i]);
        }
        _mm256_storeu_ps(logits + g * padded + t0, hsum8x16(acc));
      }
    }
  }

  // Softmax per query head, in fp32; entries past the context weigh 0. NOTE: the soft-cap is
  // monotonic, so entries past the context still never exceed the maximum (softmax_weights).
  for (int g = 0; g < group; ++g) {
    cap_logits(a, logits + g * padded, padded);
    inv_sum[g] = softmax_weights(logits + g * padded, per, kTile, context_len, kBf16Dot<T, D> ? weights + g * padded : nullptr);
  }

  // Pass 2: out_g = sum_t p[g, t] v_t / sum. The output accumulates in q's scratch (q is no
  // longer needed).
  float* acc_all = q;
  std::fill(acc_all, acc_all + group * D, 0.f);
  if constexpr (kBf16Dot<T, D>) {
#if defined(__AVX512BF16__)
    // Two tokens per vdpbf16ps: rows i and i + 1 interleaved (unpacklo/hi of their bf16: within
    // each 128-bit lane, element pairs (v_i[d], v_i+1[d])), against (p_i, p_i+1) in every pair.
    // The accumulators' lanes then hold the output in unpack order (see unpacked_index), put
    // back in place once at the end. The tile's interleaved rows are built once, then read by
    // every query head.
    static_assert(kTile % 2 == 0, "tokens go in pairs");
    constexpr int C = D / 32;  // 32-element chunks per row
    __m512i pairs[kTile * C];  // pair i / 2's chunk c: entries (i / 2 * C + c) * 2 (lo), + 1 (hi)
    for (int t0 = 0; t0 < padded; t0 += kTile) {
      prefetch_tile(per + t0 / kTile + ahead);
      for (int i = 0; i < kTile; i += 2) {
        const T* r0 = task.value_cache + offsets[t0 + i];
        const T* r1 = task.value_cache + offsets[t0 + i + 1];
        for (int c = 0; c < C; ++c) {
          const __m512i x0 = _mm512_loadu_si512(r0 + 32 * c), x1 = _mm512_loadu_si512(r1 + 32 * c);
          pairs[(i / 2 * C + c) * 2] = _mm512_unpacklo_epi16(x0, x1);
          pairs[(i / 2 * C + c) * 2 + 1] = _mm512_unpackhi_epi16(x0, x1);
        }
      }
      for (int g = 0; g < group; ++g) {
        const uint16_t* w = weights + g * padded + t0;
        float* dst = acc_all + g * D;
        __m512 acc[2 * C];
        for (int v = 0; v < 2 * C; ++v) acc[v] = _mm512_loadu_ps(dst + 16 * v);
        for (int i = 0; i < kTile; i += 2) {
          // (p_i, p_i+1) as one 32-bit pair: p_i in the low half, as the rows' pairs hold v_i
          uint32_t pair;
          std::memcpy(&pair, w + i, 4);
          const __m512bh pp = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
          for (int v = 0; v < 2 * C; ++v) acc[v] = _mm512_dpbf16_ps(acc[v], (__m512bh)pairs[i / 2 * 2 * C + v], pp);
        }
        for (int v = 0; v < 2 * C; ++v) _mm512_storeu_ps(dst + 16 * v, acc[v]);
      }
    }
    heads.write_outputs(out, acc_all, inv_sum, unpacked_index);
    return;
#endif
  } else {
    // a query head's output stays in registers (up to 8 vectors at a time) over a tile's rows
    constexpr int kChunk = V < 8 ? V : 8;
    static_assert(V % kChunk == 0, "D / 16 is a multiple of the chunk");
    for (int t0 = 0; t0 < padded; t0 += kTile) {
      prefetch_tile(per + t0 / kTile + ahead);
      tile_as_float(task.value_cache, t0);
      for (int g = 0; g < group; ++g) {
        const float* p = logits + g * padded + t0;
        for (int c = 0; c < V; c += kChunk) {
          float* dst = acc_all + g * D + 16 * c;
          __m512 acc[kChunk];
          for (int v = 0; v < kChunk; ++v) acc[v] = _mm512_loadu_ps(dst + 16 * v);
          for (int i = 0; i < kTile; ++i) {
            const __m512 pi = _mm512_set1_ps(p[i]);
            for (int v = 0; v < kChunk; ++v) acc[v] = _mm512_fmadd_ps(pi, _mm512_loadu_ps(rows[i] + 16 * (c + v)), acc[v]);
          }
          for (int v = 0; v < kChunk; ++v) _mm512_storeu_ps(dst + 16 * v, acc[v]);
        }
      }
    }
    heads.write_outputs(out, acc_all, inv_sum);
  }
}

}  // namespace paged_serve::cpu::attention

#endif  // PAGED_SERVE_ATTENTION_AVX512
