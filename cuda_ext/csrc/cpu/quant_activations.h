// The activations of one quant_matmul call, quantized once to int8 for every segment and
// column, as llama.cpp quantizes them:
//
//   q8_0 (the legacy types' partner): blocks of 32, d = amax / 127 rounded to fp16 (ggml's
//   block_q8_0 scale), q = round-to-even(x * 127 / amax); with each block's sum of q.
//   q8_K (the K types'): blocks of 256, d = amax / 127 in fp32, q the same; with -32 x the sums
//   per 16 (q6_k's offset, ready to start its sums from) and the sums per 32 (q4_k / q5_k's mins).
//
// The same float32 operations as reference.quantize_activations, so both give the same ints.
// Rows are laid out in tiles of Vec::kMaxRows (the last may be shorter), interleaved as
// quant_tiles.h's ActTile describes.
#pragma once

#include "dtype_cvt.h"
#include "quant_simd.h"
#include "quant_tiles.h"

#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace paged_serve::cpu::quant {

class Activations {
 public:
  // x: M rows of K (T float or BFloat16), ldx apart; `legacy` / `k_types`: which forms to make.
  template <typename T>
  Activations(const T* x, int64_t ldx, int64_t M, int64_t K, bool legacy, bool k_types) : M_(M), K_(K) {
    if (legacy) {
      q0_.resize(M * K);
      d0_.resize(M * K / 32);
      s0_.resize(M * K / 32);
    }
    if (k_types) {
      qk_.resize(M * K);
      dk_.resize(M * K / 256);
      s16_.resize(M * K / 16);
      s32_.resize(M * K / 64);
    }
    // NOTE: one task per 8 rows, which fill a tile; a row of 2048 takes ~1 us.
    at::parallel_for(0, M, 8, [&](int64_t begin, int64_t end) {
      std::vector<float> row(K);
      std::vector<int8_t> q(K);
      std::vector<int32_t> s16(K / 16);
      for (int64_t r = begin; r < end; ++r) {
        const auto* xr = stored(x + r * ldx);
        for (int64_t k = 0; k < K; ++k) row[k] = to_float<T>(xr[k]);
        if (legacy) quantize_row(r, row.data(), 32, true, q.data(), s16.data());
        if (k_types) quantize_row(r, row.data(), 256, false, q.data(), s16.data());
      }
    });
  }

  // The tile of `rows` rows from row m0 (a multiple of Vec::kMaxRows).
  ActTile tile(bool k_type, int64_t m0) const {
    if (!k_type) return {q0_.data() + m0 * K_, d0_.data() + m0 * K_ / 32, s0_.data() + m0 * K_ / 32, nullptr};
    return {qk_.data() + m0 * K_, dk_.data() + m0 * K_ / 256, s16_.data() + m0 * K_ / 16, s32_.data() + m0 * K_ / 64};
  }

 private:
  // Row r quantized in blocks of `block` (q and s16: scratch of K and K / 16).
  void quantize_row(int64_t r, const float* x, int block, bool fp16_scale, int8_t* q, int32_t* s16) {
    const int64_t blocks = K_ / block;
    const int64_t m0 = r / Vec::kMaxRows * Vec::kMaxRows, m = r - m0;
    const int64_t rows = std::min<int64_t>(Vec::kMaxRows, M_ - m0);
    float* d = (fp16_scale ? d0_.data() : dk_.data()) + m0 * blocks;
    for (int64_t b = 0; b < blocks; ++b) {
      const float* xb = x + b * block;
      // NOTE: |x| as bits: an integer max that the compiler vectorises (a float max reduction
      // it would not, without -ffast-math); a NaN is larger than any number and poisons the block.
      uint32_t bits = 0;
      for (int j = 0; j < block; ++j) {
        uint32_t u;
        std::memcpy(&u, xb + j, 4);
        bits = std::max(bits, u & 0x7FFFFFFFu);
      }
      float amax;
      std::memcpy(&amax, &bits, 4);
      const float id = amax != 0.f ? 127.f / amax : 0.f;
      int8_t* qb = q + b * block;
      for (int j = 0; j < block; ++j) qb[j] = static_cast<int8_t>(static_cast<int32_t>(std::nearbyint(xb[j] * id)));
      const float scale = amax / 127.f;
      d[b * rows + m] = fp16_scale ? static_cast<float>(c10::Half(scale)) : scale;
    }
    for (int64_t j = 0; j < K_ / 16; ++j) {
      int32_t s = 0;
      for (int i = 0; i < 16; ++i) s += q[16 * j + i];
      s16[j] = s;
    }
    // interleave: k-group g of row m at 4 (g rows + m) of the tile
    int8_t* dst = (fp16_scale ? q0_.data() : qk_.data()) + m0 * K_;
    for (int64_t g = 0; g < K_ / 4; ++g) std::memcpy(dst + 4 * (g * rows + m), q + 4 * g, 4);
    if (fp16_scale) {
      int32_t* s = s0_.data() + m0 * K_ / 32;
      for (int64_t j = 0; j < K_ / 32; ++j) s[j * rows + m] = s16[2 * j] + s16[2 * j + 1];
    } else {
      int32_t* s = s16_.data() + m0 * K_ / 16;
      for (int64_t j = 0; j < K_ / 16; ++j) s[j * rows + m] = -32 * s16[j];
      int32_t* pairs = s32_.data() + m0 * K_ / 64;
      for (int64_t p = 0; p < K_ / 64; ++p) {
        const auto lo = static_cast<uint16_t>(s16[4 * p] + s16[4 * p + 1]);
        const auto hi = static_cast<uint16_t>(s16[4 * p + 2] + s16[4 * p + 3]);
        pairs[p * rows + m] = static_cast<int32_t>(lo | static_cast<uint32_t>(hi) << 16);
      }
    }
  }

  int64_t M_, K_;
  std::vector<int8_t> q0_, qk_;
  std::vector<float> d0_, dk_;
  std::vector<int32_t> s0_, s16_, s32_;
};

}  // namespace paged_serve::cpu::quant
