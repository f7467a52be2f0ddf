// quant_matmul / quant_silu_mul: x W^T with W kept as GGUF blocks, repacked into panels of 16
// output rows (quant_format.h), products as integer dot products (quant_tiles.h).
//
// Why: a one-stream decode step reads every weight once; dequantized to fp32 a Q4 model reads
// ~7x the bytes its file holds, and the step is bound by memory. Here a weight byte is read
// once per call and stays 4-8 bits until it is multiplied.
//
// One call: the activations are quantized once (quant_activations.h: q8_0 for the legacy
// types, q8_K for the K types, both when the segments mix them), then threads split the
// panels (at::parallel_for: contiguous ranges, so each core streams its own stretch of the
// weight) and run every row tile of Vec::kMaxRows rows against each panel: at decode (1-8
// rows) a panel's bytes are read once with all rows' activations at hand; at prefill a
// panel's blocks are unpacked once per row tile, from L1/L2 after the first.
//
// NOTE: with many rows the activations of all rows (M x K bytes) would be streamed once per
// panel, from L3 or DRAM once they outgrow L2; the rows go in blocks of ~256 KB of
// activations instead, each block against all of a thread's panels.

#include "cpu_ops.h"
#include "quant_activations.h"
#include "quant_format.h"
#include "quant_matmul.h"
#include "quant_simd.h"
#include "quant_tiles.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace paged_serve::cpu {
namespace {

using namespace quant;  // NOLINT: the kernel those pieces are for

constexpr int64_t kRowBlockBytes = 256 * 1024;

struct PanelRef {
  const Segment* seg;
  int64_t panel;
};

void check_x(const char* op, const at::Tensor& x, const Packed& p) {
  PS_CHECK(x.device().is_cpu() && x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
           op, ": x must be a float32 or bfloat16 CPU tensor [rows, K], got ", x.sizes(), " ", x.scalar_type());
  PS_CHECK(x.size(1) == p.K, op, ": x has ", x.size(1), " columns, the packed weight K = ", p.K);
  PS_CHECK(x.stride(1) == 1 || x.size(0) == 0, op, ": x's last dim must be contiguous");
}

// y [M, N] float32 = x W^T (+ bias, float32 [N] or null).
at::Tensor product(const at::Tensor& x, const Packed& p, const float* bias) {
  const int64_t M = x.size(0), N = p.N, K = p.K;
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  if (M == 0) return y;
  const bool legacy = p.any_legacy(), k_types = p.any_k_type();
  const Activations acts = x.scalar_type() == at::kBFloat16
                               ? Activations(x.const_data_ptr<c10::BFloat16>(), x.stride(0), M, K, legacy, k_types)
                               : Activations(x.const_data_ptr<float>(), x.stride(0), M, K, legacy, k_types);
  std::vector<PanelRef> panels;
  for (const Segment& s : p.segments) {
    for (int64_t i = 0; i < panels_of(s.rows); ++i) panels.push_back({&s, i});
  }
  constexpr int64_t tile = Vec::kMaxRows;
  const int64_t row_block = std::max(tile, kRowBlockBytes / K / tile * tile);
  float* ys = y.data_ptr<float>();
  at::parallel_for(0, static_cast<int64_t>(panels.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t r0 = 0; r0 < M; r0 += row_block) {
      const int64_t r1 = std::min(M, r0 + row_block);
      for (int64_t i = begin; i < end; ++i) {
        const Segment& s = *panels[i].seg;
        const TypeInfo& t = *s.type;
        const int64_t blocks = K / t.block, col0 = s.row_begin + kLanes * panels[i].panel;
        const int cols = static_cast<int>(std::min<int64_t>(kLanes, s.rows - kLanes * panels[i].panel));
        const uint8_t* w = p.base + s.offset + panels[i].panel * blocks * t.panel_bytes;
        for (int lane = 0; lane < cols; lane += Vec::kLanes) {
          const int n = std::min(Vec::kLanes, cols - lane);
          for (int64_t m0 = r0; m0 < r1; m0 += tile) {
            run_tile(static_cast<int>(std::min(tile, M - m0)), t.type, w, blocks, acts.tile(t.k_type, m0), lane,
                     ys + m0 * N + col0 + lane, N, n, bias != nullptr ? bias + col0 + lane : nullptr);
          }
        }
      }
    }
  });
  return y;
}

at::Tensor in_dtype_of(const at::Tensor& y, const at::Tensor& x) {
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

}  // namespace

std::string quant_isa() { return Vec::kName; }

at::Tensor quant_matmul(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  constexpr const char* op = "quant_matmul";
  const Packed p = parse_packed(packed, op);
  check_x(op, x, p);
  at::Tensor b;
  if (bias.has_value()) {
    PS_CHECK(bias->device().is_cpu() && bias->dim() == 1 && bias->numel() == p.N &&
                 (bias->scalar_type() == at::kFloat || bias->scalar_type() == x.scalar_type()),
             op, ": bias must be a 1-D CPU tensor of N = ", p.N, " float32 or x's dtype, got ", bias->sizes(), " ",
             bias->scalar_type());
    b = bias->to(at::kFloat).contiguous();
  }
  return in_dtype_of(product(x, p, b.defined() ? b.const_data_ptr<float>() : nullptr), x);
}

at::Tensor quant_silu_mul(const at::Tensor& x, const at::Tensor& packed) {
  constexpr const char* op = "quant_silu_mul";
  const Packed p = parse_packed(packed, op);
  check_x(op, x, p);
  PS_CHECK(p.N % 2 == 0, op, ": the packed [gate | up] weight has an odd N = ", p.N);
  // NOTE: a second pass over the fp32 product (fused.cpp's silu_and_mul), not an epilogue: at
  // decode the [rows, 2 I] product is a few KB against MBs of weights; see the benchmark.
  const at::Tensor gate_up = product(x, p, nullptr);
  at::Tensor out = at::empty({x.size(0), p.N / 2}, gate_up.options());
  if (x.size(0) > 0) silu_and_mul(out, gate_up);
  return in_dtype_of(out, x);
}

}  // namespace paged_serve::cpu
