// The torch glue: declares every paged_serve op schema once and registers its CPU, CUDA and
// Meta (shape-only, for torch.compile / fake tensors) implementations. `Tensor(a!)` marks
// what an op writes. Python code reaches these only through cuda_ext/ops.py.
//
// Built without CUDA by default; with -DPAGED_SERVE_WITH_CUDA the CUDA implementations below
// wrap the raw-pointer launchers of cuda/kernels.h.

#include <torch/library.h>

#include "cpu/cpu_ops.h"

#ifdef PAGED_SERVE_WITH_CUDA
#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <vector>

#include "cuda/kernels.h"
#endif

namespace paged_serve {

TORCH_LIBRARY(paged_serve, m) {
  m.def("reshape_and_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
        "Tensor slot_mapping) -> ()");
  m.def("paged_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
        "Tensor block_tables, Tensor context_lens, float scale, int max_context_len) -> ()");
  m.def("copy_blocks(Tensor(a!)[] key_caches, Tensor(b!)[] value_caches, Tensor block_mapping) -> ()");
  m.def("swap_blocks(Tensor src, Tensor(a!) dst, Tensor block_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(paged_serve, CPU, m) {
  m.impl("reshape_and_cache", &cpu::reshape_and_cache);
  m.impl("paged_attention", &cpu::paged_attention);
  m.impl("copy_blocks", &cpu::copy_blocks);
  m.impl("swap_blocks", &cpu::swap_blocks);
}

// The ops only write into tensors they are given, so their shape functions do nothing.
TORCH_LIBRARY_IMPL(paged_serve, Meta, m) {
  m.impl("reshape_and_cache", [](const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&, const at::Tensor&) {});
  m.impl("paged_attention", [](at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                               const at::Tensor&, double, int64_t) {});
  m.impl("copy_blocks", [](at::TensorList, at::TensorList, const at::Tensor&) {});
  m.impl("swap_blocks", [](const at::Tensor&, at::Tensor&, const at::Tensor&) {});
}

#ifdef PAGED_SERVE_WITH_CUDA
namespace {

void check_cuda(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, what, " failed: ", cudaGetErrorString(err));
}

cuda::DType to_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return cuda::DType::kFloat32;
    case at::kHalf: return cuda::DType::kFloat16;
    case at::kBFloat16: return cuda::DType::kBFloat16;
    default: TORCH_CHECK(false, "paged_attention supports float32, float16 and bfloat16, not ", t);
  }
}

bool aligned16(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

// A kernel dereferences every pointer on one GPU: a stray CPU tensor would crash it.
void check_on(const at::Device& device, std::initializer_list<const at::Tensor*> tensors, const char* op) {
  for (const at::Tensor* t : tensors) {
    TORCH_CHECK(t->device() == device, op, ": all tensors must be on ", device, ", got one on ", t->device());
  }
}

void reshape_and_cache_cuda(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                            at::Tensor& value_cache, const at::Tensor& slot_mapping) {
  TORCH_CHECK(key.dim() == 3 && key.sizes() == value.sizes(), "key/value must be [num_tokens, num_kv_heads, head_size]");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.sizes() == value_cache.sizes() &&
                  key_cache.strides() == value_cache.strides(),
              "caches must be [num_blocks, num_kv_heads, block_size, head_size] with equal strides");
  TORCH_CHECK(key.size(1) == key_cache.size(1) && key.size(2) == key_cache.size(3), "key/value heads or head_size differ from the cache's");
  TORCH_CHECK(key.scalar_type() == key_cache.scalar_type() && value.scalar_type() == key_cache.scalar_type(), "key/value must have the caches' dtype");
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1 && key_cache.stride(3) == 1, "the head_size dimension must be contiguous");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.numel() == key.size(0), "slot_mapping must be [num_tokens] int64");
  TORCH_CHECK(key.element_size() == 2 || key.element_size() == 4, "reshape_and_cache: 2- or 4-byte dtypes only");
  check_on(key_cache.device(), {&key, &value, &value_cache}, "reshape_and_cache");
  const c10::cuda::CUDAGuard guard(key_cache.device());
  const at::Tensor slots = slot_mapping.to(key_cache.device()).contiguous();
  check_cuda(cuda::reshape_and_cache(key.data_ptr(), value.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
                                     slots.const_data_ptr<int64_t>(), key.size(0), key.size(1), key.size(2),
                                     key_cache.size(2), key.stride(0), key.stride(1), value.stride(0), value.stride(1),
                                     key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
                                     key.element_size(), c10::cuda::getCurrentCUDAStream()),
             "reshape_and_cache");
}

void paged_attention_cuda(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                          const at::Tensor& value_cache, const at::Tensor& block_tables,
                          const at::Tensor& context_lens, double scale, int64_t max_context_len) {
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes(), "query/out must be [num_seqs, num_heads, head_size]");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.sizes() == value_cache.sizes() &&
                  key_cache.strides() == value_cache.strides(),
              "caches must be [num_blocks, num_kv_heads, block_size, head_size] with equal strides");
  TORCH_CHECK(query.scalar_type() == out.scalar_type() && query.scalar_type() == key_cache.scalar_type() &&
                  query.scalar_type() == value_cache.scalar_type(),
              "query, out and the caches must share one dtype");
  TORCH_CHECK(cuda::attention_supports_head_size(query.size(2)), "the CUDA paged_attention is built for head sizes 64 "
              "and 128, not ", query.size(2));
  TORCH_CHECK(key_cache.size(3) == query.size(2) && query.size(1) % key_cache.size(1) == 0,
              "head_size must match the cache's and num_heads be a multiple of num_kv_heads");
  const int64_t vec = 16 / key_cache.element_size();  // elements per 16-byte load
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1 && key_cache.stride(3) == 1 && aligned16(key_cache) &&
                  aligned16(value_cache) && key_cache.stride(0) % vec == 0 && key_cache.stride(1) % vec == 0 &&
                  key_cache.stride(2) % vec == 0,
              "caches must be 16-byte aligned with head_size contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && context_lens.scalar_type() == at::kInt &&
                  block_tables.dim() == 2 && block_tables.size(0) == query.size(0) && context_lens.numel() == query.size(0),
              "block_tables must be [num_seqs, max_blocks_per_seq] int32, context_lens [num_seqs] int32");
  check_on(query.device(), {&out, &key_cache, &value_cache, &block_tables, &context_lens}, "paged_attention");
  TORCH_CHECK(max_context_len <= cuda::kMaxContextLen, "paged_attention: contexts are limited to ",
              cuda::kMaxContextLen, " tokens, got max_context_len ", max_context_len);
  const c10::cuda::CUDAGuard guard(query.device());
  const at::Tensor tables = block_tables.contiguous(), lens = context_lens.contiguous();
  const cuda::AttentionShape shape{
      static_cast<int>(query.size(0)), static_cast<int>(query.size(1)), static_cast<int>(key_cache.size(1)),
      static_cast<int>(query.size(2)), static_cast<int>(key_cache.size(2)), static_cast<int>(tables.size(1)),
      query.stride(0), query.stride(1), out.stride(0), out.stride(1),
      key_cache.stride(0), key_cache.stride(1), key_cache.stride(2)};
  // Scratch for the split-context path; empty when one partition covers every sequence.
  const int num_partitions = cuda::attention_num_partitions(static_cast<int>(max_context_len));
  at::Tensor partial_out, partial_max, partial_sum;
  if (num_partitions > 1) {
    const auto f32 = query.options().dtype(at::kFloat);
    partial_out = at::empty({query.size(0), query.size(1), num_partitions, query.size(2)}, f32);
    partial_max = at::empty({query.size(0), query.size(1), num_partitions}, f32);
    partial_sum = at::empty({query.size(0), query.size(1), num_partitions}, f32);
  }
  auto ptr = [](const at::Tensor& t) { return t.defined() ? t.data_ptr<float>() : nullptr; };
  check_cuda(cuda::paged_attention(out.data_ptr(), query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
                                   tables.const_data_ptr<int>(), lens.const_data_ptr<int>(), ptr(partial_out),
                                   ptr(partial_max), ptr(partial_sum), shape, static_cast<float>(scale),
                                   static_cast<int>(max_context_len), to_dtype(query.scalar_type()),
                                   c10::cuda::getCurrentCUDAStream()),
             "paged_attention");
}

void copy_blocks_cuda(at::TensorList key_caches, at::TensorList value_caches, const at::Tensor& block_mapping) {
  TORCH_CHECK(key_caches.size() == value_caches.size(), "need as many value caches as key caches");
  TORCH_CHECK(block_mapping.scalar_type() == at::kLong && block_mapping.dim() == 2 && block_mapping.size(1) == 2,
              "block_mapping must be [num_pairs, 2] int64");
  if (key_caches.empty() || block_mapping.size(0) == 0) return;
  const at::Device device = key_caches[0].device();
  const c10::cuda::CUDAGuard guard(device);
  const int64_t block_bytes = key_caches[0].numel() / key_caches[0].size(0) * key_caches[0].element_size();
  std::vector<int64_t> ptrs;
  for (at::TensorList caches : {key_caches, value_caches}) {
    for (const at::Tensor& c : caches) {
      TORCH_CHECK(c.device() == device && c.is_contiguous() && aligned16(c) &&
                      c.numel() / c.size(0) * c.element_size() == block_bytes,
                  "caches must be contiguous, on one device, with one block size");
      ptrs.push_back(reinterpret_cast<int64_t>(c.data_ptr()));
    }
  }
  const at::Tensor device_ptrs = at::tensor(ptrs, at::kLong).to(device);
  const at::Tensor mapping = block_mapping.to(device).contiguous();
  check_cuda(cuda::copy_blocks(device_ptrs.const_data_ptr<int64_t>(), mapping.const_data_ptr<int64_t>(),
                               static_cast<int>(ptrs.size()), static_cast<int>(mapping.size(0)), block_bytes,
                               c10::cuda::getCurrentCUDAStream()),
             "copy_blocks");
}

void swap_blocks_cuda(const at::Tensor& src, at::Tensor& dst, const at::Tensor& block_mapping) {
  TORCH_CHECK(block_mapping.device().is_cpu() && block_mapping.scalar_type() == at::kLong && block_mapping.dim() == 2 &&
                  block_mapping.size(1) == 2,
              "block_mapping must be a [num_pairs, 2] int64 CPU tensor");
  TORCH_CHECK(src.scalar_type() == dst.scalar_type() && src.sizes().slice(1) == dst.sizes().slice(1) &&
                  src.is_contiguous() && dst.is_contiguous(),
              "src and dst must be contiguous with the same dtype and block shape");
  const at::Device device = src.is_cuda() ? src.device() : dst.device();
  const c10::cuda::CUDAGuard guard(device);
  const at::Tensor mapping = block_mapping.contiguous();
  const int64_t* pairs = mapping.const_data_ptr<int64_t>();
  for (int64_t p = 0; p < mapping.size(0); ++p) {
    TORCH_CHECK(pairs[2 * p] >= 0 && pairs[2 * p] < src.size(0) && pairs[2 * p + 1] >= 0 && pairs[2 * p + 1] < dst.size(0),
                "block id out of range in block_mapping row ", p);
  }
  const int64_t block_bytes = src.numel() / std::max<int64_t>(src.size(0), 1) * src.element_size();
  const cudaMemcpyKind kind = src.is_cuda() ? (dst.is_cuda() ? cudaMemcpyDeviceToDevice : cudaMemcpyDeviceToHost)
                                            : cudaMemcpyHostToDevice;
  check_cuda(cuda::swap_blocks(src.data_ptr(), dst.data_ptr(), pairs, static_cast<int>(mapping.size(0)), block_bytes,
                               kind, c10::cuda::getCurrentCUDAStream()),
             "swap_blocks");
}

}  // namespace

TORCH_LIBRARY_IMPL(paged_serve, CUDA, m) {
  m.impl("reshape_and_cache", &reshape_and_cache_cuda);
  m.impl("paged_attention", &paged_attention_cuda);
  m.impl("copy_blocks", &copy_blocks_cuda);
  m.impl("swap_blocks", &swap_blocks_cuda);
}
#endif  // PAGED_SERVE_WITH_CUDA

}  // namespace paged_serve
