// CPU implementations of the paged_serve ops (registered in ../bindings.cpp).
// Cache layout: [num_blocks, num_kv_heads, block_size, head_size], last dim contiguous.
#pragma once

#include <ATen/core/Tensor.h>

#include "../check_message.h"

#include <optional>

namespace paged_serve::cpu {

void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                       at::Tensor& value_cache, const at::Tensor& slot_mapping);

// window: a sliding window of that many keys (0: none); softcap: logit soft-capping, c * tanh(s / c)
// of the scaled logits (0: none).
void paged_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, const at::Tensor& block_tables,
                     const at::Tensor& context_lens, double scale, int64_t max_context_len, int64_t window = 0,
                     double softcap = 0.0);

// cache_ptrs: the CUDA path's device pointer table (ignored here).
void copy_blocks(at::TensorList key_caches, at::TensorList value_caches, const at::Tensor& block_mapping,
                 const std::optional<at::Tensor>& cache_ptrs);

void swap_blocks(const at::Tensor& src, at::Tensor& dst, const at::Tensor& block_mapping);

// The sampler's fused softmax / CDF draw / top-p test (sampling.cpp); CPU only.
void draw_tokens(const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& top_p,
                 const at::Tensor& u, at::Tensor& tokens);

// The scores of given tokens and each row's top k, in two passes per row (scoring.cpp); CPU only.
void score_tokens(const at::Tensor& logits, const at::Tensor& targets, int64_t k, at::Tensor& logprob,
                  at::Tensor& rank, at::Tensor& top_ids, at::Tensor& top_vals);

// The model's elementwise work in one pass each (fused.cpp); CPU only.
void rms_norm(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps);
void fused_add_rms_norm(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps);
void rotary_embedding(const at::Tensor& positions, at::Tensor& query, at::Tensor& key, const at::Tensor& cos,
                      const at::Tensor& sin);
void silu_and_mul(at::Tensor& out, const at::Tensor& x);

// fp32 linear layers over column panels (linear.cpp); CPU only, AVX2 + FMA builds only.
bool linear_panels_available();
at::Tensor linear_pack(const at::Tensor& weight);
at::Tensor linear_panels(const at::Tensor& x, const at::Tensor& packed, int64_t out_features);
// silu(x W_gate^T) * (x W_up^T), [rows, out_features], W = [gate | up] packed by linear_pack with
// gate's and up's panels alternating (panel 2i: gate columns 16i.., 2i + 1: up's).
at::Tensor linear_panels_silu_mul(const at::Tensor& x, const at::Tensor& packed, int64_t out_features);

// Causal attention of a step's prompt chunks over the paged caches (prefill_attention.cpp); CPU
// fp32 or bf16, AVX2 + FMA builds only. spans [chunks, 3] int32: first query row, tokens, tokens
// cached before the chunk; block_tables [chunks, width] int32. window and softcap as paged_attention's
// (a query at position p sees the keys at (p - window, p]).
bool prefill_attention_available();
void prefill_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                       const at::Tensor& value_cache, const at::Tensor& block_tables, const at::Tensor& spans,
                       double scale, int64_t window = 0, double softcap = 0.0);

// Every decoder layer of a Llama-family model and its final RMSNorm over one step's tokens, in
// one call (decoder_stack.cpp); CPU, weights packed for the panels, oneDNN or quant_pack; qk_norms
// empty or two per layer (query then key norm over each head, before the rotary). x (the
// embeddings, [tokens, hidden]) is overwritten; returns the normed hidden states of `rows` (all
// tokens without). window: every layer's sliding window (0: none).
at::Tensor decoder_stack(at::Tensor& x, const at::Tensor& positions, at::TensorList weights,
                         at::TensorList qkv_biases, at::TensorList qk_norms, const at::Tensor& final_norm,
                         const at::Tensor& cos,
                         const at::Tensor& sin, at::TensorList key_caches, at::TensorList value_caches,
                         const at::Tensor& slot_mapping, const std::optional<at::Tensor>& prefill_tables,
                         const std::optional<at::Tensor>& prefill_spans, int64_t num_prefill_tokens,
                         const std::optional<at::Tensor>& decode_tables, const std::optional<at::Tensor>& decode_lens,
                         int64_t max_decode_len, int64_t num_heads, int64_t num_kv_heads, int64_t intermediate_size,
                         double scale, double eps, const std::optional<at::Tensor>& rows, int64_t window);

}  // namespace paged_serve::cpu
