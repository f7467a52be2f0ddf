// A Llama-family decoder stack over one step's flattened tokens in one call (CPU, fp32 or bf16): every
// layer's residual add + RMSNorm, qkv product (+ bias), rotary, cache write, attention (the
// step's prompt chunks, then its decodes), o product, residual add + RMSNorm, gate/up product
// with SiLU * up, down product; then the final RMSNorm.
//
// Why: engine/worker/models/llama.py runs the same kernels one Python call at a time, ~20 per layer
// (module calls, the ops.py wrappers' checks, the dispatcher, views). On a 2-core AVX2 EPYC
// that host work was ~6 ms of every step, ~10 us a call, whatever the batch: 4% of a 64-row
// decode step, ~10% of a 16-row one and ~25% of a 1-row one, where the kernels are short.
//
// Same floats: the kernels below are the ones the Python layers call (fused.cpp, linear.cpp,
// cache.cpp, attention.cpp, prefill_attention.cpp), in the same order, on tensors of the same
// shapes and strides, so each output is bit for bit the Python path's. The caller decides
// where this applies (engine/worker/models/decoder_stack.py): one rank; fp32 on the panels kernel, or
// any dtype on oneDNN's packed weights (bf16 where the CPU multiplies it natively), or fp32 /
// bf16 on GGUF-quantized weights packed by quant_pack.
//
// weights: per layer, in order: input RMSNorm [hidden], qkv, o, post-attention RMSNorm [hidden],
// gate/up, down. The products' weights are all panels (gate/up in pairs, linear_panels_silu_mul's
// layout), all oneDNN's packed tensors (mkldnn::_linear_pointwise's, gate/up one product
// followed by silu_and_mul, as the Python layers do), or all quant_pack's uint8 tensors (the
// dtype says which: quant_matmul, gate/up [gate | up] through quant_silu_mul).

#include "cpu_ops.h"
#include "quant_matmul.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/index_select.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <cstdint>
#include <optional>

namespace paged_serve::cpu {
namespace {

constexpr int64_t kWeightsPerLayer = 6;

// x W^T (+ bias) with W packed by oneDNN: the op engine/worker/models/layers.py's `linear` calls, with
// the same arguments (the bias fused into the product).
at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                               c10::string_view, c10::List<std::optional<at::Scalar>>,
                                               std::optional<c10::string_view>)>();
  return op.call(x, w, bias, "none", c10::List<std::optional<at::Scalar>>(), std::string_view(""));
}

enum class Kernel { kPanels, kOneDnn, kQuant };

// The kernel a product weight was packed for: oneDNN's tensors are MkldnnCPU, quant_pack's uint8.
Kernel kernel_of(const at::Tensor& w) {
  return w.is_mkldnn() ? Kernel::kOneDnn : w.scalar_type() == at::kByte ? Kernel::kQuant : Kernel::kPanels;
}

// One layer's products, on whichever kernel its weights were packed for.
struct Products {
  Kernel kernel;

  at::Tensor linear(const at::Tensor& x, const at::Tensor& w, int64_t out_features,
                    const std::optional<at::Tensor>& bias = std::nullopt) const {
    if (kernel == Kernel::kOneDnn) return onednn_linear(x, w, bias);
    if (kernel == Kernel::kQuant) {
      at::Tensor y = quant_matmul(x, w, bias);
      PS_CHECK(y.size(1) == out_features, "decoder_stack: a quantized weight has ", y.size(1), " rows, expected ",
               out_features);
      return y;
    }
    at::Tensor y = linear_panels(x, w, out_features);
    if (bias.has_value()) y.add_(*bias);
    return y;
  }

  // silu(x W_gate^T) * (x W_up^T)
  at::Tensor silu_mul(const at::Tensor& x, const at::Tensor& w, int64_t intermediate) const {
    if (kernel == Kernel::kPanels) return linear_panels_silu_mul(x, w, intermediate);
    if (kernel == Kernel::kQuant) {
      at::Tensor y = quant_silu_mul(x, w);
      PS_CHECK(y.size(1) == intermediate, "decoder_stack: the quantized gate/up weight has ", 2 * y.size(1),
               " rows, expected 2 x ", intermediate);
      return y;
    }
    const at::Tensor gate_up = onednn_linear(x, w, std::nullopt);
    at::Tensor out = at::empty({x.size(0), intermediate}, x.options());
    silu_and_mul(out, gate_up);
    return out;
  }
};

// `x` ([T, heads, d], a strided view of the qkv product) normed per head by `weight` in place, as
// engine/worker/models/layers.py's rms_norm_heads_ does it: through a contiguous copy.
void norm_heads(at::Tensor& x, const at::Tensor& weight, double eps) {
  at::Tensor rows = x.reshape({-1, x.size(2)}).contiguous();
  at::Tensor out = at::empty_like(rows);
  rms_norm(out, rows, weight, eps);
  x.copy_(out.view(x.sizes()));
}

}  // namespace

at::Tensor decoder_stack(at::Tensor& x, const at::Tensor& positions, at::TensorList weights,
                         at::TensorList qkv_biases, at::TensorList qk_norms, const at::Tensor& final_norm,
                         const at::Tensor& cos,
                         const at::Tensor& sin, at::TensorList key_caches, at::TensorList value_caches,
                         const at::Tensor& slot_mapping, const std::optional<at::Tensor>& prefill_tables,
                         const std::optional<at::Tensor>& prefill_spans, int64_t num_prefill_tokens,
                         const std::optional<at::Tensor>& decode_tables, const std::optional<at::Tensor>& decode_lens,
                         int64_t max_decode_len, int64_t num_heads, int64_t num_kv_heads, int64_t intermediate_size,
                         double scale, double eps, const std::optional<at::Tensor>& rows, int64_t window) {
  constexpr const char* op = "decoder_stack";
  const int64_t layers = static_cast<int64_t>(key_caches.size());
  PS_CHECK(layers > 0 && static_cast<int64_t>(value_caches.size()) == layers &&
               static_cast<int64_t>(weights.size()) == kWeightsPerLayer * layers,
           op, ": expected ", kWeightsPerLayer, " weights and a key and a value cache per layer, got ", weights.size(),
           " weights and ", key_caches.size(), " / ", value_caches.size(), " caches");
  PS_CHECK(qkv_biases.empty() || static_cast<int64_t>(qkv_biases.size()) == layers, op,
           ": qkv_biases must be empty or one per layer, got ", qkv_biases.size());
  PS_CHECK(qk_norms.empty() || static_cast<int64_t>(qk_norms.size()) == 2 * layers, op,
           ": qk_norms must be empty or two per layer (query, key), got ", qk_norms.size());
  PS_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous(), op,
           ": x must be a contiguous CPU [tokens, hidden] tensor, got ", x.sizes());
  const Products products{kernel_of(weights[1])};
  for (int64_t i = 0; i < layers; ++i) {
    for (int64_t j : {1, 2, 4, 5}) {
      PS_CHECK(kernel_of(weights[kWeightsPerLayer * i + j]) == products.kernel, op, ": layer ", i, " weight ", j,
               " is packed for another kernel than layer 0's qkv (all panels, all oneDNN or all quant_pack's uint8)");
    }
  }
  PS_CHECK(products.kernel != Kernel::kPanels || x.scalar_type() == at::kFloat, op,
           ": the panels kernel takes float32 x, got ", x.scalar_type());
  PS_CHECK(products.kernel != Kernel::kQuant || x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
           op, ": the quantized kernels take float32 or bfloat16 x, got ", x.scalar_type());
  PS_CHECK(cos.dim() == 2, op, ": cos must be [max_positions, head_size], got ", cos.sizes());
  const int64_t T = x.size(0), hidden = x.size(1), d = cos.size(1), P = num_prefill_tokens;
  const int64_t q_size = num_heads * d, kv_size = num_kv_heads * d;
  PS_CHECK(P >= 0 && P <= T, op, ": num_prefill_tokens ", P, " outside [0, ", T, "]");
  PS_CHECK(P == 0 || (prefill_tables.has_value() && prefill_spans.has_value()), op,
           ": prompt tokens need prefill_tables and prefill_spans");
  PS_CHECK(P == T || (decode_tables.has_value() && decode_lens.has_value()), op,
           ": decode tokens need decode_tables and decode_lens");
  if (T == 0) return at::empty({rows.has_value() ? rows->numel() : 0, hidden}, x.options());

  // NOTE: the first layer's input norm has no residual to add: the embeddings are the residual.
  at::Tensor residual = x;
  at::Tensor h = at::empty_like(x);
  rms_norm(h, x, weights[0], eps);
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor* w = weights.data() + kWeightsPerLayer * l;
    if (l > 0) fused_add_rms_norm(h, residual, w[0], eps);
    at::Tensor qkv = products.linear(h, w[1], q_size + 2 * kv_size,
                                     qkv_biases.empty() ? std::nullopt : std::optional<at::Tensor>(qkv_biases[l]));
    // q, k and v stay strided views of the product, as in LlamaAttention.forward.
    at::Tensor q = qkv.narrow(1, 0, q_size).view({T, num_heads, d});
    at::Tensor k = qkv.narrow(1, q_size, kv_size).view({T, num_kv_heads, d});
    at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({T, num_kv_heads, d});
    if (!qk_norms.empty()) {  // as layers.rms_norm_heads_: each head's row normed, written back
      norm_heads(q, qk_norms[2 * l], eps);
      norm_heads(k, qk_norms[2 * l + 1], eps);
    }
    rotary_embedding(positions, q, k, cos, sin);
    at::Tensor key_cache = key_caches[l], value_cache = value_caches[l];
    reshape_and_cache(k, v, key_cache, value_cache, slot_mapping);
    at::Tensor attn = at::empty({T, num_heads, d}, x.options());
    if (P > 0) {
      at::Tensor out = attn.narrow(0, 0, P);
      prefill_attention(out, q.narrow(0, 0, P), key_cache, value_cache, *prefill_tables, *prefill_spans, scale, window);
    }
    if (P < T) {
      at::Tensor out = attn.narrow(0, P, T - P);
      paged_attention(out, q.narrow(0, P, T - P), key_cache, value_cache, *decode_tables, *decode_lens, scale,
                      max_decode_len, window);
    }
    at::Tensor a = attn.view({T, q_size});
    if (l == layers - 1 && rows.has_value()) {
      // Past the last attention, only the wanted rows (as LlamaModel.forward's `rows`).
      a = a.index_select(0, *rows);
      residual = residual.index_select(0, *rows);
    }
    h = products.linear(a, w[2], hidden);
    fused_add_rms_norm(h, residual, w[3], eps);
    h = products.linear(products.silu_mul(h, w[4], intermediate_size), w[5], hidden);
  }
  fused_add_rms_norm(h, residual, final_norm, eps);
  return h;
}

}  // namespace paged_serve::cpu
