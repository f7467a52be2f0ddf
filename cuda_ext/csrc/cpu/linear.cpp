// CPU fp32 linear layer y = x W^T over a weight packed once into column panels (AVX2 + FMA).
//
// Why our own: a decode step multiplies a few rows (one per running sequence) by every weight
// of the model, and oneDNN's fp32 inner product ran those at about half the FMA peak on a
// 2-core AVX2 EPYC (80 GFLOP/s at 16 rows over the SmolLM2-135M layers with weights cold from
// DRAM, as in the model), where this kernel ran 110 (and 1.1-1.3x oneDNN at 32-256 rows).
//
// Layout: W [N, K] (out x in, row-major) is packed as panels of kNr = 16 output columns,
// panels[N / 16][K][16] (the last panel zero-padded), so one panel is read front to back.
// Micro-kernel: a tile of up to kMr = 6 rows x 16 columns lives in 12 ymm accumulators; per k,
// two 8-float loads of the panel, one broadcast per row, two FMAs per row. Threads split the
// panels; each thread walks its panels in order, all rows per panel (the panel stays in L1/L2
// for the row tiles after the first), prefetching the next panel while the first tile streams
// the current one (from 3 rows on). Every output is one fp32 sum over k in order (no reassociation), so results
// differ from other GEMMs only in summation order (~1e-6 relative).
//
// linear_panels_silu_mul is the MLP's gate/up product with SiLU * up as its epilogue: with the
// halves' panels alternating, one thread computes a gate tile and the matching up tile and
// stores only silu(gate) * up, so the [rows, 2 x intermediate] product is never written nor
// read back by a separate pass.

#include "cpu_ops.h"
#include "exp_poly.h"
#include "panel_tile.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <cstdint>

namespace paged_serve::cpu {
namespace {

using panel::kMr;
using panel::kNr;

#if PAGED_SERVE_LINEAR_PANELS
using panel::tile_rows;

// NOTE: with 1-2 rows a tile streams its panel at memory's pace and the hardware prefetcher
// keeps up; prefetching the next panel as well only competed with it. On a 2-core AVX2 EPYC a
// one-sequence decode step of SmolLM2 took 16.4 -> 13.9 ms without it, two sequences 17.3 ->
// 15.8; from 3-4 rows on the prefetch pays (the model's products, weights cold, ran 15-23% slower
// without it at 4 rows and 2-5% at 64; a 4-sequence decode step 16.5 -> 20.3 ms).
constexpr int64_t kPrefetchMinRows = 3;

// All M rows of x times one panel (the panel stays in L1/L2 after the first row tile, which
// also prefetches `next`).
void panel_rows(const float* x, int64_t ldx, int64_t M, const float* panel, int64_t K, float* y, int64_t ldy,
                int cols, const float* next) {
  if (M < kPrefetchMinRows) next = nullptr;
  for (int64_t m = 0; m < M; m += kMr) {
    tile_rows(static_cast<int>(std::min<int64_t>(kMr, M - m)), x + m * ldx, ldx, panel, kNr, K, y + m * ldy, ldy, cols,
              m == 0 ? next : nullptr);
  }
}

// y[:, 0:cols] = silu(x gate) * (x up) for a pair of panels, gate's then up's (columns c of
// both are the same output column). Per row tile, both products go to a small buffer and only
// the result is stored; `next`: the next pair, prefetched during the first row tile.
void pair_rows(const float* x, int64_t ldx, int64_t M, const float* gate, int64_t K, float* y, int64_t ldy, int cols,
               const float* next) {
  const float* up = gate + K * kNr;
  alignas(32) float g[kMr * kNr], u[kMr * kNr];
  if (M < kPrefetchMinRows) next = nullptr;
  for (int64_t m = 0; m < M; m += kMr) {
    const int rows = static_cast<int>(std::min<int64_t>(kMr, M - m));
    const bool first = m == 0 && next != nullptr;
    tile_rows(rows, x + m * ldx, ldx, gate, kNr, K, g, kNr, kNr, first ? next : nullptr);
    tile_rows(rows, x + m * ldx, ldx, up, kNr, K, u, kNr, kNr, first ? next + K * kNr : nullptr);
    for (int r = 0; r < rows; ++r) {
      float* dst = y + (m + r) * ldy;
      const float* gr = g + r * kNr;
      const float* ur = u + r * kNr;
      // NOTE: the expression of fused.cpp's silu_mul_rows for fp32, so this epilogue and the
      // separate silu_and_mul op over linear_panels' output give the same floats.
#pragma omp simd
      for (int c = 0; c < cols; ++c) dst[c] = gr[c] / (1.0f + exp_clamped(-gr[c])) * ur[c];
    }
  }
}

#endif  // PAGED_SERVE_LINEAR_PANELS

}  // namespace

bool linear_panels_available() { return PAGED_SERVE_LINEAR_PANELS == 1; }

at::Tensor linear_pack(const at::Tensor& weight) {
  PS_CHECK(weight.device().is_cpu() && weight.dim() == 2 && weight.scalar_type() == at::kFloat, "linear_pack: weight ",
           "must be a 2-D float32 CPU tensor [out_features, in_features], got ", weight.sizes(), " ",
           weight.scalar_type());
  const int64_t N = weight.size(0), K = weight.size(1), panels = (N + kNr - 1) / kNr;
  at::Tensor packed = at::zeros({panels, K, kNr}, weight.options());
  const at::Tensor w = weight.contiguous();
  const float* src = w.const_data_ptr<float>();
  float* dst = packed.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      for (int64_t c = 0; c < std::min(kNr, N - p * kNr); ++c) {
        const float* row = src + (p * kNr + c) * K;
        for (int64_t k = 0; k < K; ++k) dst[(p * K + k) * kNr + c] = row[k];
      }
    }
  });
  return packed;
}

namespace {

// y = x times every panel (kPairs: every pair of panels, SiLU * up as the epilogue), the panels
// (pairs) split over threads, each walking its share in order and prefetching the next.
template <bool kPairs>
at::Tensor panels_product(const char* op, const at::Tensor& x, const at::Tensor& packed, int64_t out_features) {
  constexpr int64_t group = kPairs ? 2 : 1;
  PS_CHECK(linear_panels_available(), op, ": this build has no AVX2/FMA kernel (built for a CPU without them)");
  PS_CHECK(packed.device().is_cpu() && packed.dim() == 3 && packed.size(2) == kNr && packed.is_contiguous() &&
               packed.scalar_type() == at::kFloat && packed.size(0) % group == 0,
           op, ": packed must come from linear_pack", kPairs ? " (of a [gate | up] weight in pairs)" : "", ", got ",
           packed.sizes());
  const int64_t K = packed.size(1), units = packed.size(0) / group;
  PS_CHECK(out_features > (units - 1) * kNr && out_features <= units * kNr, op, ": out_features ", out_features,
           " does not match ", units, " panels");
  PS_CHECK(x.device().is_cpu() && x.dim() == 2 && x.size(1) == K && x.scalar_type() == at::kFloat && x.stride(1) == 1,
           op, ": x must be a float32 CPU [rows, ", K, "] tensor with a contiguous last dim, got ", x.sizes(), " ",
           x.scalar_type());
  const int64_t M = x.size(0);
  at::Tensor y = at::empty({M, out_features}, x.options());
#if PAGED_SERVE_LINEAR_PANELS
  if (M == 0 || out_features == 0) return y;
  const float* xs = x.const_data_ptr<float>();
  const float* ps = packed.const_data_ptr<float>();
  float* ys = y.data_ptr<float>();
  const int64_t ldx = x.stride(0), stride = group * K * kNr;
  at::parallel_for(0, units, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const float* first = ps + p * stride;
      const float* next = p + 1 < end ? first + stride : nullptr;
      const int cols = static_cast<int>(std::min(kNr, out_features - p * kNr));
      if constexpr (kPairs) {
        pair_rows(xs, ldx, M, first, K, ys + p * kNr, out_features, cols, next);
      } else {
        panel_rows(xs, ldx, M, first, K, ys + p * kNr, out_features, cols, next);
      }
    }
  });
#endif
  return y;
}

}  // namespace

at::Tensor linear_panels(const at::Tensor& x, const at::Tensor& packed, int64_t out_features) {
  return panels_product<false>("linear_panels", x, packed, out_features);
}

at::Tensor linear_panels_silu_mul(const at::Tensor& x, const at::Tensor& packed, int64_t out_features) {
  return panels_product<true>("linear_panels_silu_mul", x, packed, out_features);
}

}  // namespace paged_serve::cpu
