// The fp32 micro-kernel of the panel products (AVX2 + FMA): a tile of up to kMr = 6 rows of x
// times one panel of kNr = 16 columns, [K][16] floats (its rows ldp apart), accumulated in 12
// ymm registers over k in order and stored once. linear.cpp multiplies activations by packed
// weights with it, prefill_attention.cpp queries by keys and probabilities by values.
#pragma once

#include <cstdint>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PAGED_SERVE_LINEAR_PANELS 1
#else
#define PAGED_SERVE_LINEAR_PANELS 0
#endif

namespace paged_serve::cpu::panel {

constexpr int64_t kNr = 16;  // columns per panel (two ymm registers)
constexpr int kMr = 6;       // rows per micro-kernel tile (12 accumulators + 2 weights + 1 broadcast)

#if PAGED_SERVE_LINEAR_PANELS

// NOTE: named accumulators, not an array: GCC 12 kept an __m256 acc[6][2] in registers but also
// stored it to the stack on every k (dead stores it could not remove), at 60% of this speed.
#define PS_ROW(r)                                                                    \
  if constexpr (MR > r) {                                                            \
    const __m256 a = _mm256_broadcast_ss(x + r * ldx + k);                           \
    c##r##0 = _mm256_fmadd_ps(a, w0, c##r##0);                                       \
    c##r##1 = _mm256_fmadd_ps(a, w1, c##r##1);                                       \
  }
#define PS_STORE(r)                                                                  \
  if constexpr (MR > r) {                                                            \
    float* row = y + r * ldy;                                                        \
    if (full) {                                                                      \
      _mm256_storeu_ps(row, c##r##0);                                                \
      _mm256_storeu_ps(row + 8, c##r##1);                                            \
    } else {                                                                         \
      _mm256_maskstore_ps(row, lo, c##r##0);                                         \
      _mm256_maskstore_ps(row + 8, hi, c##r##1);                                     \
    }                                                                                \
  }

// y[r, 0:cols] = x[r, 0:K] . panel for r < MR. x rows ldx apart, panel rows ldp apart, y rows
// ldy apart; `next`: a packed panel ([K][16]) to prefetch a line of per k (or null).
template <int MR>
inline void tile(const float* __restrict x, int64_t ldx, const float* __restrict panel, int64_t ldp, int64_t K,
                 float* __restrict y, int64_t ldy, int cols, const float* next) {
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00, c31 = c00,
         c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  for (int64_t k = 0; k < K; ++k) {
    if (next != nullptr) _mm_prefetch(reinterpret_cast<const char*>(next + k * kNr), _MM_HINT_T0);
    const __m256 w0 = _mm256_loadu_ps(panel + k * ldp), w1 = _mm256_loadu_ps(panel + k * ldp + 8);
    PS_ROW(0) PS_ROW(1) PS_ROW(2) PS_ROW(3) PS_ROW(4) PS_ROW(5)
  }
  const bool full = cols == kNr;
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i lo = _mm256_cmpgt_epi32(_mm256_set1_epi32(cols), lane);
  const __m256i hi = _mm256_cmpgt_epi32(_mm256_set1_epi32(cols - 8), lane);
  PS_STORE(0) PS_STORE(1) PS_STORE(2) PS_STORE(3) PS_STORE(4) PS_STORE(5)
}
#undef PS_ROW
#undef PS_STORE

// The first `rows` (1..kMr) rows of x times one panel; see tile().
inline void tile_rows(int rows, const float* x, int64_t ldx, const float* panel, int64_t ldp, int64_t K, float* y,
                      int64_t ldy, int cols, const float* next) {
  switch (rows) {
    case 6: tile<6>(x, ldx, panel, ldp, K, y, ldy, cols, next); break;
    case 5: tile<5>(x, ldx, panel, ldp, K, y, ldy, cols, next); break;
    case 4: tile<4>(x, ldx, panel, ldp, K, y, ldy, cols, next); break;
    case 3: tile<3>(x, ldx, panel, ldp, K, y, ldy, cols, next); break;
    case 2: tile<2>(x, ldx, panel, ldp, K, y, ldy, cols, next); break;
    case 1: tile<1>(x, ldx, panel, ldp, K, y, ldy, cols, next); break;
    default: break;
  }
}

#endif  // PAGED_SERVE_LINEAR_PANELS

}  // namespace paged_serve::cpu::panel
