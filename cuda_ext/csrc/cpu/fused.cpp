// The model's elementwise work on a CPU in one pass each, instead of 4-10 torch ops (each a
// full read and write of its tensor, a dispatch and an allocation): residual add + RMSNorm,
// rotary embedding in place on q and k, SiLU(gate) * up. At a decode batch of 16 rows on a
// 2-core CPU those eager ops were ~13% of a step.
//
// Contracts (cuda_ext/reference.py holds the same in torch, which is what the model ran before):
//   rms_norm(out, x, weight, eps)             out = weight * (x * rsqrt(mean(x^2) + eps))
//   fused_add_rms_norm(x, residual, w, eps)   residual <- x + residual; x <- rms_norm(residual)
//   rotary_embedding(positions, q, k, cos, sin)  q, k <- q * cos + rotate_half(q) * sin (NeoX
//                                             layout: the head's halves rotate together)
//   silu_and_mul(out, x)                      out = silu(x[:, :d]) * x[:, d:]
// Tensors: 2-D [rows, dim] (q/k: 3-D [tokens, heads, head_size]) on the CPU in float32,
// bfloat16 or float16, last dim contiguous; statistics in float32. Every intermediate the torch
// version rounds to the tensor's dtype is rounded here too, so bf16 results match it to
// rounding of the sums; float32 ones to a few ulp (summation order, FMA contraction).

#include "cpu_ops.h"
#include "dtype_cvt.h"
#include "exp_poly.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace paged_serve::cpu {
namespace {

// Rows per parallel task: a decode batch (a few rows of a few hundred elements) stays on one
// thread, where a fork would cost more than the work.
constexpr int64_t kGrainRows = 32;

bool is_model_dtype(at::ScalarType t) { return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf; }

void check_rows(const at::Tensor& t, const char* op, const char* name, at::ScalarType dtype) {
  PS_CHECK(t.device().is_cpu() && t.dim() == 2 && t.stride(1) == 1, op, ": ", name,
           " must be a 2-D CPU tensor with a contiguous last dim, got ", t.sizes(), " with strides ", t.strides());
  PS_CHECK(t.scalar_type() == dtype && is_model_dtype(dtype), op, ": ", name, " must be float32, bfloat16 or "
           "float16 like the others, got ", t.scalar_type());
}

void check_weight(const at::Tensor& w, int64_t dim, at::ScalarType dtype, const char* op) {
  PS_CHECK(w.device().is_cpu() && w.dim() == 1 && w.size(0) == dim && w.is_contiguous() && w.scalar_type() == dtype,
           op, ": weight must be a contiguous [", dim, "] CPU vector of ", dtype, ", got ", w.sizes(), " ",
           w.scalar_type());
}

// The norms' arguments: x and `other` (out, or the residual) [rows, dim] of one model dtype,
// weight [dim] of that dtype.
void check_norm_args(const char* op, const at::Tensor& x, const at::Tensor& other, const char* other_name,
                     const at::Tensor& weight) {
  check_rows(x, op, "x", x.scalar_type());
  check_rows(other, op, other_name, x.scalar_type());
  PS_CHECK(other.sizes() == x.sizes(), op, ": ", other_name, " ", other.sizes(), " must have x's shape ",
           x.sizes());
  check_weight(weight, x.size(1), x.scalar_type(), op);
}

// One row: sum = x (+ residual, stored back), out = weight * (sum * rsqrt(mean(sum^2) + eps)).
template <typename T>
void norm_row(T* out_row, const T* x_row, T* residual_row, const T* w_row, int64_t dim, float eps) {
  auto* out = stored(out_row);
  const auto* x = stored(x_row);
  auto* residual = stored(residual_row);  // null stays null
  const auto* w = stored(w_row);
  float ss = 0.f;
  if (residual != nullptr) {
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < dim; ++i) {
      const auto s = from_float<T>(to_float<T>(x[i]) + to_float<T>(residual[i]));
      residual[i] = s;
      const float f = to_float<T>(s);
      ss += f * f;
    }
    x = residual;
  } else {
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < dim; ++i) {
      const float f = to_float<T>(x[i]);
      ss += f * f;
    }
  }
  const float r = 1.0f / std::sqrt(ss / static_cast<float>(dim) + eps);
#pragma omp simd
  for (int64_t i = 0; i < dim; ++i) {
    const float normed = as_dtype<T>(to_float<T>(x[i]) * r);
    out[i] = from_float<T>(to_float<T>(w[i]) * normed);
  }
}

template <typename T>
void norm_rows(T* out, int64_t out_stride, const T* x, int64_t x_stride, T* residual, int64_t res_stride,
               const T* w, int64_t rows, int64_t dim, float eps) {
  at::parallel_for(0, rows, kGrainRows, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      norm_row<T>(out + r * out_stride, x + r * x_stride, residual ? residual + r * res_stride : nullptr, w, dim,
                  eps);
    }
  });
}

// One head in place: x[i] <- x[i] cos[i] - x[i+h] sin[i], x[i+h] <- x[i+h] cos[i+h] + x[i] sin[i+h].
// C: the tables' type (float32, or T itself when the model was cast with its buffers).
template <typename T, typename C>
inline void rotate_head(T* head, const C* cos_row, const C* sin_row, int64_t half) {
  auto* x = stored(head);
  const auto* cos = stored(cos_row);
  const auto* sin = stored(sin_row);
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = to_float<T>(x[i]), x2 = to_float<T>(x[i + half]);
    const float c1 = as_dtype<T>(to_float<C>(cos[i])), s1 = as_dtype<T>(to_float<C>(sin[i]));
    const float c2 = as_dtype<T>(to_float<C>(cos[i + half]));
    const float s2 = as_dtype<T>(to_float<C>(sin[i + half]));
    x[i] = from_float<T>(as_dtype<T>(x1 * c1) - as_dtype<T>(x2 * s1));
    x[i + half] = from_float<T>(as_dtype<T>(x2 * c2) + as_dtype<T>(x1 * s2));
  }
}

template <typename T, typename C>
void rotate_tokens(const int64_t* positions, int64_t tokens, at::Tensor& query, at::Tensor& key, const C* cos,
                   const C* sin, int64_t head_size) {
  T* q = query.data_ptr<T>();
  T* k = key.data_ptr<T>();
  const int64_t half = head_size / 2;
  at::parallel_for(0, tokens, kGrainRows, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const C* c = cos + positions[t] * head_size;
      const C* s = sin + positions[t] * head_size;
      for (int64_t h = 0; h < query.size(1); ++h) {
        rotate_head<T, C>(q + t * query.stride(0) + h * query.stride(1), c, s, half);
      }
      for (int64_t h = 0; h < key.size(1); ++h) {
        rotate_head<T, C>(k + t * key.stride(0) + h * key.stride(1), c, s, half);
      }
    }
  });
}

// out[r] = silu(gate) * up for each row r of x = [gate | up] (d each).
template <typename T>
void silu_mul_rows(T* out, int64_t out_stride, const T* x, int64_t x_stride, int64_t rows, int64_t d) {
  at::parallel_for(0, rows, kGrainRows, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const auto* gate = stored(x + r * x_stride);
      const auto* up = gate + d;
      auto* dst = stored(out + r * out_stride);
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) {
        const float g = to_float<T>(gate[i]);
        const float silu = as_dtype<T>(g / (1.0f + exp_clamped(-g)));
        dst[i] = from_float<T>(silu * to_float<T>(up[i]));
      }
    }
  });
}

void check_heads(const at::Tensor& t, const char* name, int64_t tokens, int64_t head_size, at::ScalarType dtype) {
  constexpr const char* op = "rotary_embedding";
  PS_CHECK(t.device().is_cpu() && t.dim() == 3 && t.size(0) == tokens && t.size(2) == head_size &&
               t.stride(2) == 1,
           op, ": ", name, " must be a [", tokens, ", heads, ", head_size, "] CPU tensor with a contiguous last "
           "dim, got ", t.sizes(), " with strides ", t.strides());
  PS_CHECK(t.scalar_type() == dtype && is_model_dtype(dtype), op, ": query and key must share one dtype of "
           "float32, bfloat16, float16, got ", t.scalar_type(), " and ", dtype);
}

}  // namespace

void rms_norm(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_norm_args("rms_norm", x, out, "out", weight);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "rms_norm_cpu", [&] {
    norm_rows<scalar_t>(out.data_ptr<scalar_t>(), out.stride(0), x.const_data_ptr<scalar_t>(), x.stride(0), nullptr,
                        0, weight.const_data_ptr<scalar_t>(), x.size(0), x.size(1), static_cast<float>(eps));
  });
}

void fused_add_rms_norm(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  check_norm_args("fused_add_rms_norm", x, residual, "residual", weight);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "fused_add_rms_norm_cpu", [&] {
    // NOTE: row by row, each row's sum is complete (and stored) before its output overwrites x.
    norm_rows<scalar_t>(x.data_ptr<scalar_t>(), x.stride(0), x.const_data_ptr<scalar_t>(), x.stride(0),
                        residual.data_ptr<scalar_t>(), residual.stride(0), weight.const_data_ptr<scalar_t>(),
                        x.size(0), x.size(1), static_cast<float>(eps));
  });
}

void rotary_embedding(const at::Tensor& positions, at::Tensor& query, at::Tensor& key, const at::Tensor& cos,
                      const at::Tensor& sin) {
  constexpr const char* op = "rotary_embedding";
  const at::ScalarType table = cos.scalar_type();
  PS_CHECK(cos.device().is_cpu() && cos.dim() == 2 && cos.is_contiguous() && sin.device().is_cpu() &&
               sin.sizes() == cos.sizes() && sin.is_contiguous() && sin.scalar_type() == table &&
               (table == at::kFloat || table == query.scalar_type()),
           op, ": cos and sin must be contiguous [max_positions, head_size] CPU tensors of float32 or the "
           "query's dtype");
  const int64_t head_size = cos.size(1), max_pos = cos.size(0);
  PS_CHECK(head_size > 0 && head_size % 2 == 0, op, ": head_size must be even, got ", head_size);
  PS_CHECK(positions.device().is_cpu() && positions.dim() == 1 && positions.scalar_type() == at::kLong, op,
           ": positions must be a [tokens] int64 CPU tensor");
  const int64_t tokens = positions.numel();
  check_heads(query, "query", tokens, head_size, query.scalar_type());
  check_heads(key, "key", tokens, head_size, query.scalar_type());
  const at::Tensor pos = positions.contiguous();
  const int64_t* p = pos.const_data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    PS_CHECK(p[t] >= 0 && p[t] < max_pos, op, ": position ", p[t], " of token ", t, " outside [0, ", max_pos, ")");
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, query.scalar_type(), "rotary_embedding_cpu", [&] {
    if (table == at::kFloat) {
      rotate_tokens<scalar_t, float>(p, tokens, query, key, cos.const_data_ptr<float>(), sin.const_data_ptr<float>(),
                                     head_size);
    } else {
      rotate_tokens<scalar_t, scalar_t>(p, tokens, query, key, cos.const_data_ptr<scalar_t>(),
                                        sin.const_data_ptr<scalar_t>(), head_size);
    }
  });
}

void silu_and_mul(at::Tensor& out, const at::Tensor& x) {
  constexpr const char* op = "silu_and_mul";
  check_rows(x, op, "x", x.scalar_type());
  check_rows(out, op, "out", x.scalar_type());
  PS_CHECK(x.size(1) % 2 == 0 && out.size(0) == x.size(0) && out.size(1) * 2 == x.size(1), op,
           ": x must be [rows, 2 * d] and out [rows, d], got ", x.sizes(), " and ", out.sizes());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "silu_and_mul_cpu", [&] {
    silu_mul_rows<scalar_t>(out.data_ptr<scalar_t>(), out.stride(0), x.const_data_ptr<scalar_t>(), x.stride(0),
                            x.size(0), out.size(1));
  });
}

}  // namespace paged_serve::cpu
