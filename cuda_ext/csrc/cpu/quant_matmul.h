// Integer-dot-product products over GGUF-quantized weights kept as stored (CPU): the ops of
// quant_pack.cpp, quant_quantize.cpp and quant_matmul.cpp, declared for bindings.cpp and for
// decoder_stack.cpp, which calls the products of a model whose linear layers hold packed weights.
// The packed format: quant_format.h. Types: ggml's ids (q8_0 8, q4_0 2, q4_1 3, q5_0 6, q5_1 7,
// q4_k 12, q5_k 13, q6_k 14).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>

namespace paged_serve::cpu {

// The instruction set the kernels were built for: "avx512_vnni", "avx_vnni", "avx2" or "portable".
std::string quant_isa();

// One packed uint8 tensor from row segments of W [N, K]: parts[i] [rows_i, row_bytes] uint8
// holding GGUF blocks as stored, of ggml type types[i]; all parts of the same K.
at::Tensor quant_pack(at::TensorList parts, at::IntArrayRef types);

// x W^T (+ bias) for x [M, K] float32 or bfloat16 (last dim contiguous); [M, N] in x's dtype.
// Activations quantized per block to int8 (q8_0 for the legacy types, q8_K for the K types),
// integer dot products, fp32 accumulation. bias: [N] float32 or x's dtype.
at::Tensor quant_matmul(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias);

// silu(x G^T) * (x U^T), [M, N / 2] in x's dtype, for a packed [G | U] (N = 2 I, gate rows first).
at::Tensor quant_silu_mul(const at::Tensor& x, const at::Tensor& packed);

// Rows `ids` (int64, each in [0, N)) of the packed weight as float32 [len(ids), K].
at::Tensor quant_embedding(const at::Tensor& packed, const at::Tensor& ids);

// The whole weight as float32 [N, K] (gguf.quants.dequantize's floats).
at::Tensor quant_dequantize(const at::Tensor& packed);

// weight [N, K] (floating) as GGUF blocks of `type`, ggml's layout: uint8 [N, K / block x bytes].
at::Tensor quant_quantize(const at::Tensor& weight, int64_t type);

}  // namespace paged_serve::cpu
