// The torch glue: declares every paged_serve op schema once and registers its CPU, CUDA and
// Meta (shape-only, for torch.compile / fake tensors) implementations. `Tensor(a!)` marks
// what an op writes. Python code reaches these only through cuda_ext/ops.py.
//
// Built without CUDA by default; with -DPAGED_SERVE_WITH_CUDA the CUDA implementations below
// wrap the raw-pointer launchers of cuda/kernels.h. Both backends run the argument checks of
// checks.h; index tensors on a GPU are guarded by the kernels, whose reports
// (take_device_error) become exceptions at the next call.

#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "checks.h"
#include "cpu/cpu_ops.h"
#include "cpu/quant_matmul.h"

#ifdef PAGED_SERVE_WITH_CUDA
#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "cuda/kernels.h"
#endif

namespace paged_serve {

#ifdef PAGED_SERVE_WITH_CUDA
namespace {
int64_t take_device_error();
}
int64_t take_device_error_any() { return take_device_error(); }
#else
int64_t take_device_error_any() { return 0; }
#endif

TORCH_LIBRARY(paged_serve, m) {
  m.def("reshape_and_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
        "Tensor slot_mapping) -> ()");
  m.def("paged_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
        "Tensor block_tables, Tensor context_lens, float scale, int max_context_len, int window=0, "
        "float softcap=0.) -> ()");
  m.def("copy_blocks(Tensor(a!)[] key_caches, Tensor(b!)[] value_caches, Tensor block_mapping, "
        "Tensor? cache_ptrs=None) -> ()");
  m.def("swap_blocks(Tensor src, Tensor(a!) dst, Tensor block_mapping) -> ()");
  // The sampler's fused draw (cpu/sampling.cpp); CPU only: the sampler uses it for CPU logits.
  m.def("draw_tokens(Tensor logits, Tensor temperature, Tensor top_p, Tensor u, Tensor(a!) tokens) -> ()");
  // Token scores and top k (cpu/scoring.cpp); CPU only: the sampler uses it for CPU logits.
  m.def("score_tokens(Tensor logits, Tensor targets, int k, Tensor(a!) logprob, Tensor(b!) rank, "
        "Tensor(c!) top_ids, Tensor(d!) top_vals) -> ()");
  // The model's elementwise work, one pass each (cpu/fused.cpp); CPU only: the layers use them
  // for CPU tensors and keep their torch code elsewhere.
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.def("fused_add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("rotary_embedding(Tensor positions, Tensor(a!) query, Tensor(b!) key, Tensor cos, Tensor sin) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor x) -> ()");
  // fp32 linear layers over a weight packed into column panels (cpu/linear.cpp); CPU only.
  m.def("linear_pack(Tensor weight) -> Tensor");
  m.def("linear_panels(Tensor x, Tensor packed, int out_features) -> Tensor");
  m.def("linear_panels_silu_mul(Tensor x, Tensor packed, int out_features) -> Tensor");
  m.def("linear_panels_available() -> bool", &cpu::linear_panels_available);
  // Causal prefill attention of all a step's prompt chunks over the paged caches
  // (cpu/prefill_attention.cpp); CPU fp32 or bf16. window / softcap: as paged_attention's (0: none).
  m.def("prefill_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
        "Tensor block_tables, Tensor spans, float scale, int window=0, float softcap=0.) -> ()");
  m.def("prefill_attention_available() -> bool", &cpu::prefill_attention_available);
  // A Llama-family model's decoder layers and final norm over one step, in one call
  // (cpu/decoder_stack.cpp); CPU, fp32 with panels-packed weights, fp32 / bf16 with oneDNN's or with
  // quant_pack's (uint8) weights; qk_norms: none, or per layer the per-head query and key norms
  // (Qwen3's); window: every layer's sliding window (0: none). Overwrites x (and the caches).
  m.def("decoder_stack(Tensor(a!) x, Tensor positions, Tensor[] weights, Tensor[] qkv_biases, Tensor[] qk_norms, "
        "Tensor final_norm, "
        "Tensor cos, Tensor sin, Tensor(b!)[] key_caches, Tensor(c!)[] value_caches, Tensor slot_mapping, "
        "Tensor? prefill_tables, Tensor? prefill_spans, int num_prefill_tokens, Tensor? decode_tables, "
        "Tensor? decode_lens, int max_decode_len, int num_heads, int num_kv_heads, int intermediate_size, "
        "float scale, float eps, Tensor? rows, int window=0) -> Tensor");
  // Integer-dot-product products over GGUF-quantized weights (cpu/quant_*.cpp); CPU only. The
  // packed tensor's header holds N, so these have no Meta kernels (shapes depend on its data).
  m.def("quant_isa() -> str", &cpu::quant_isa);
  m.def("quant_pack(Tensor[] parts, int[] types) -> Tensor");
  m.def("quant_matmul(Tensor x, Tensor packed, Tensor? bias=None) -> Tensor");
  m.def("quant_silu_mul(Tensor x, Tensor packed) -> Tensor");
  m.def("quant_embedding(Tensor packed, Tensor ids) -> Tensor");
  m.def("quant_dequantize(Tensor packed) -> Tensor");
  m.def("quant_quantize(Tensor weight, int type) -> Tensor");
  // The CUDA kernels' report of a bad device-resident index since the last call (a
  // cuda::ErrorCode, 0: none), reset; always 0 in a build without CUDA.
  m.def("take_device_error() -> int", &take_device_error_any);
}

TORCH_LIBRARY_IMPL(paged_serve, CPU, m) {
  m.impl("reshape_and_cache", &cpu::reshape_and_cache);
  m.impl("paged_attention", &cpu::paged_attention);
  m.impl("copy_blocks", &cpu::copy_blocks);
  m.impl("swap_blocks", &cpu::swap_blocks);
  m.impl("draw_tokens", &cpu::draw_tokens);
  m.impl("score_tokens", &cpu::score_tokens);
  m.impl("rms_norm", &cpu::rms_norm);
  m.impl("fused_add_rms_norm", &cpu::fused_add_rms_norm);
  m.impl("rotary_embedding", &cpu::rotary_embedding);
  m.impl("silu_and_mul", &cpu::silu_and_mul);
  m.impl("linear_pack", &cpu::linear_pack);
  m.impl("linear_panels", &cpu::linear_panels);
  m.impl("linear_panels_silu_mul", &cpu::linear_panels_silu_mul);
  m.impl("prefill_attention", &cpu::prefill_attention);
  m.impl("decoder_stack", &cpu::decoder_stack);
  m.impl("quant_pack", &cpu::quant_pack);
  m.impl("quant_matmul", &cpu::quant_matmul);
  m.impl("quant_silu_mul", &cpu::quant_silu_mul);
  m.impl("quant_embedding", &cpu::quant_embedding);
  m.impl("quant_dequantize", &cpu::quant_dequantize);
  m.impl("quant_quantize", &cpu::quant_quantize);
}

// NOTE: oneDNN's packed weights are MkldnnCPU tensors, and a call holding one dispatches there.
TORCH_LIBRARY_IMPL(paged_serve, MkldnnCPU, m) {
  m.impl("decoder_stack", &cpu::decoder_stack);
}

// The ops only write into tensors they are given, so their shape functions do nothing.
TORCH_LIBRARY_IMPL(paged_serve, Meta, m) {
  m.impl("reshape_and_cache", [](const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&, const at::Tensor&) {});
  m.impl("paged_attention", [](at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                               const at::Tensor&, double, int64_t, int64_t, double) {});
  m.impl("copy_blocks", [](at::TensorList, at::TensorList, const at::Tensor&, const std::optional<at::Tensor>&) {});
  m.impl("swap_blocks", [](const at::Tensor&, at::Tensor&, const at::Tensor&) {});
  m.impl("draw_tokens", [](const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, at::Tensor&) {});
  m.impl("score_tokens", [](const at::Tensor&, const at::Tensor&, int64_t, at::Tensor&, at::Tensor&, at::Tensor&,
                            at::Tensor&) {});
  m.impl("rms_norm", [](at::Tensor&, const at::Tensor&, const at::Tensor&, double) {});
  m.impl("fused_add_rms_norm", [](at::Tensor&, at::Tensor&, const at::Tensor&, double) {});
  m.impl("rotary_embedding", [](const at::Tensor&, at::Tensor&, at::Tensor&, const at::Tensor&, const at::Tensor&) {});
  m.impl("silu_and_mul", [](at::Tensor&, const at::Tensor&) {});
  m.impl("linear_pack", [](const at::Tensor& w) {
    return at::empty({(w.size(0) + 15) / 16, w.size(1), 16}, w.options());
  });
  m.impl("linear_panels", [](const at::Tensor& x, const at::Tensor&, int64_t out_features) {
    return at::empty({x.size(0), out_features}, x.options());
  });
  m.impl("linear_panels_silu_mul", [](const at::Tensor& x, const at::Tensor&, int64_t out_features) {
    return at::empty({x.size(0), out_features}, x.options());
  });
  m.impl("prefill_attention", [](at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                 const at::Tensor&, const at::Tensor&, double, int64_t, double) {});
  m.impl("decoder_stack", [](at::Tensor& x, const at::Tensor&, at::TensorList, at::TensorList, at::TensorList,
                             const at::Tensor&,
                             const at::Tensor&, const at::Tensor&, at::TensorList, at::TensorList, const at::Tensor&,
                             const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, int64_t,
                             const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, int64_t, int64_t,
                             int64_t, int64_t, double, double, const std::optional<at::Tensor>& rows, int64_t) {
    return at::empty_symint({rows.has_value() ? rows->sym_size(0) : x.sym_size(0), x.sym_size(1)}, x.options());
  });
}

#ifdef PAGED_SERVE_WITH_CUDA
namespace {

void check_cuda(cudaError_t err, const char* what) {
  PS_CHECK(err == cudaSuccess, what, " failed: ", cudaGetErrorString(err));
}

cuda::DType to_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return cuda::DType::kFloat32;
    case at::kHalf: return cuda::DType::kFloat16;
    case at::kBFloat16: return cuda::DType::kBFloat16;
    default: PS_CHECK(false, "paged_attention supports float32, float16 and bfloat16, not ", t);
  }
}

bool aligned16(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

// A kernel dereferences every pointer on one GPU: a stray CPU tensor would crash it.
void check_on(const at::Device& device, std::initializer_list<const at::Tensor*> tensors, const char* op) {
  for (const at::Tensor* t : tensors) {
    PS_CHECK(t->device() == device, op, ": all tensors must be on ", device, ", got one on ", t->device());
  }
}

// The int the kernels report bad device-resident indices into (cuda::ErrorCode): pinned host
// memory mapped into every device (portable), allocated once; {host, device} pointers. Both
// null if the allocation failed (the kernels' guards still hold, only the report is lost).
std::pair<int*, int*> error_flag() {
  static const std::pair<int*, int*> flag = [] {
    int* host = nullptr;
    int* device = nullptr;
    if (cudaHostAlloc(reinterpret_cast<void**>(&host), sizeof(int), cudaHostAllocMapped | cudaHostAllocPortable) !=
            cudaSuccess ||
        cudaHostGetDevicePointer(reinterpret_cast<void**>(&device), host, 0) != cudaSuccess) {
      (void)cudaGetLastError();  // clear the sticky-free error so the next launch does not see it
      return std::pair<int*, int*>{nullptr, nullptr};
    }
    *host = cuda::kNoError;
    return std::pair<int*, int*>{host, device};
  }();
  return flag;
}

const char* error_text(int code) {
  switch (code) {
    case cuda::kBadSlot: return "a slot_mapping entry >= num_blocks * block_size (that token was not written)";
    case cuda::kBadBlockId: return "a block id outside [0, num_blocks) (block 0 was read, or the copy skipped)";
    case cuda::kBadContextLen: return "a context_len < 0 or > max_context_len / the block table's width (it was cut)";
    default: return "an unknown error";
  }
}

// The kernels' report since the last call, reset; 0 if none. Reports land when the kernel
// that made them has run: synchronise first to see those of the calls just made.
int64_t take_device_error() {
  int* host = error_flag().first;
  if (host == nullptr) return 0;
  volatile int* flag = host;
  const int code = *flag;
  if (code != cuda::kNoError) *flag = cuda::kNoError;
  return code;
}

// Raise what an earlier kernel reported, so a bad index surfaces as an exception at the next
// call (a host-side check would need a synchronisation on every call).
void raise_device_error(const char* op) {
  const int64_t code = take_device_error();
  PS_CHECK(code == 0, op, ": an earlier paged_serve CUDA kernel found ", error_text(static_cast<int>(code)),
           "; the device-side inputs of that call were out of range (its bad entries were not used)");
}

// An index tensor's copy on `device`: one on the host is checked there first (by `check`).
// NOTE: non_blocking: from pinned memory the copy is queued on the stream (no host wait);
// from pageable memory torch stages it before returning, which is safe as well.
template <typename Check>
at::Tensor index_on(const at::Tensor& t, const at::Device& device, Check check) {
  if (t.device().is_cpu()) {
    check();
    return t.contiguous().to(device, /*non_blocking=*/true);
  }
  PS_CHECK(t.device() == device, "index tensors must be on the CPU or on ", device, ", got one on ", t.device());
  return t.contiguous();
}

void reshape_and_cache_cuda(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                            at::Tensor& value_cache, const at::Tensor& slot_mapping) {
  raise_device_error("reshape_and_cache");
  checks::check_kv_write(key, value, key_cache, value_cache, slot_mapping);
  check_on(key_cache.device(), {&key, &value, &value_cache}, "reshape_and_cache");
  const c10::cuda::CUDAGuard guard(key_cache.device());
  const int64_t num_slots = key_cache.size(0) * key_cache.size(2);
  const at::Tensor slots = index_on(slot_mapping, key_cache.device(),
                                    [&] { checks::check_slots_on_host(slot_mapping, num_slots); });
  check_cuda(cuda::reshape_and_cache(key.data_ptr(), value.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
                                     slots.const_data_ptr<int64_t>(), key.size(0), key.size(1), key.size(2),
                                     key_cache.size(2), key.stride(0), key.stride(1), value.stride(0), value.stride(1),
                                     key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), num_slots,
                                     key.element_size(), error_flag().second, c10::cuda::getCurrentCUDAStream()),
             "reshape_and_cache");
}

void paged_attention_cuda(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                          const at::Tensor& value_cache, const at::Tensor& block_tables,
                          const at::Tensor& context_lens, double scale, int64_t max_context_len, int64_t window,
                          double softcap) {
  raise_device_error("paged_attention");
  // NOTE: the CUDA kernels compute neither; cuda_ext.ops runs the reference for such calls.
  PS_CHECK(window == 0 && softcap == 0.0, "the CUDA paged_attention computes no sliding window or logit soft-cap "
           "(window ", window, ", softcap ", softcap, "); cuda_ext.ops.paged_attention runs the reference for them");
  checks::check_attention(out, query, key_cache, value_cache, block_tables, context_lens, max_context_len);
  PS_CHECK(cuda::attention_supports_head_size(query.size(2)), "the CUDA paged_attention is built for head sizes 64 "
           "and 128, not ", query.size(2));
  const int64_t vec = 16 / key_cache.element_size();  // elements per 16-byte load
  PS_CHECK(aligned16(key_cache) && aligned16(value_cache) && key_cache.stride(0) % vec == 0 &&
               key_cache.stride(1) % vec == 0 && key_cache.stride(2) % vec == 0,
           "paged_attention: caches must be 16-byte aligned with head_size contiguous");
  PS_CHECK(query.size(0) <= cuda::kMaxGridYZ, "paged_attention: at most ", cuda::kMaxGridYZ,
           " sequences per call, got ", query.size(0));
  PS_CHECK(key_cache.size(0) <= INT32_MAX, "paged_attention: at most 2^31 - 1 blocks (int32 block ids)");
  PS_CHECK(max_context_len <= cuda::kMaxContextLen, "paged_attention: contexts are limited to ",
           cuda::kMaxContextLen, " tokens, got max_context_len ", max_context_len);
  check_on(query.device(), {&out, &key_cache, &value_cache}, "paged_attention");
  const c10::cuda::CUDAGuard guard(query.device());
  // Index tensors on the host are checked entry by entry (block ids where the table is too).
  const at::Tensor lens = index_on(context_lens, query.device(), [&] {
    if (block_tables.device().is_cpu()) {
      checks::check_tables_on_host(block_tables, context_lens, key_cache.size(0), key_cache.size(2), max_context_len);
    } else {
      checks::check_lens_on_host(context_lens, max_context_len, block_tables.size(1));
    }
  });
  const at::Tensor tables = index_on(block_tables, query.device(), [] {});
  const cuda::AttentionShape shape{
      static_cast<int>(query.size(0)), static_cast<int>(query.size(1)), static_cast<int>(key_cache.size(1)),
      static_cast<int>(query.size(2)), static_cast<int>(key_cache.size(2)), static_cast<int>(tables.size(1)),
      static_cast<int>(key_cache.size(0)), query.stride(0), query.stride(1), out.stride(0), out.stride(1),
      key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), static_cast<int>(max_context_len),
      cuda::attention_block_shift(static_cast<int>(key_cache.size(2)))};
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
                                   error_flag().second, c10::cuda::getCurrentCUDAStream()),
             "paged_attention");
}

// cache_ptrs: the caches' data pointers as an int64 tensor on their device, in the order
// key_caches then value_caches (cuda_ext.ops.CopyBlocksTable builds it once and checks that
// it matches the caches); without it the table is built and uploaded on every call.
void copy_blocks_cuda(at::TensorList key_caches, at::TensorList value_caches, const at::Tensor& block_mapping,
                      const std::optional<at::Tensor>& cache_ptrs) {
  raise_device_error("copy_blocks");
  PS_CHECK(key_caches.size() == value_caches.size(), "copy_blocks: need as many value caches as key caches");
  PS_CHECK(block_mapping.scalar_type() == at::kLong && block_mapping.dim() == 2 && block_mapping.size(1) == 2,
           "copy_blocks: block_mapping must be [num_pairs, 2] int64");
  if (key_caches.empty() || block_mapping.size(0) == 0) return;
  const at::Device device = key_caches[0].device();
  const c10::cuda::CUDAGuard guard(device);
  const int64_t num_blocks = key_caches[0].dim() >= 1 ? key_caches[0].size(0) : 0;
  PS_CHECK(num_blocks > 0, "copy_blocks: the caches have no blocks");
  const int64_t block_bytes = key_caches[0].numel() / num_blocks * key_caches[0].element_size();
  std::vector<int64_t> ptrs;
  for (at::TensorList caches : {key_caches, value_caches}) {
    for (const at::Tensor& c : caches) {
      PS_CHECK(c.device() == device && c.is_contiguous() && aligned16(c) && c.dim() >= 1 &&
                   c.size(0) == num_blocks && c.numel() / num_blocks * c.element_size() == block_bytes,
               "copy_blocks: caches must be contiguous, on one device, with one number and size of blocks");
      ptrs.push_back(reinterpret_cast<int64_t>(c.data_ptr()));
    }
  }
  at::Tensor device_ptrs;
  if (cache_ptrs.has_value()) {
    device_ptrs = *cache_ptrs;
    PS_CHECK(device_ptrs.device() == device && device_ptrs.scalar_type() == at::kLong && device_ptrs.dim() == 1 &&
                 device_ptrs.numel() == static_cast<int64_t>(ptrs.size()) && device_ptrs.is_contiguous(),
             "copy_blocks: cache_ptrs must be a contiguous [", ptrs.size(), "] int64 tensor on ", device);
  } else {
    device_ptrs = at::tensor(ptrs, at::kLong).to(device, /*non_blocking=*/true);
  }
  const at::Tensor mapping = index_on(block_mapping, device, [&] {
    checks::check_mapping_on_host(block_mapping, num_blocks, num_blocks, "copy_blocks");
  });
  check_cuda(cuda::copy_blocks(device_ptrs.const_data_ptr<int64_t>(), mapping.const_data_ptr<int64_t>(),
                               static_cast<int>(ptrs.size()), mapping.size(0), block_bytes, num_blocks,
                               error_flag().second, c10::cuda::getCurrentCUDAStream()),
             "copy_blocks");
}

void swap_blocks_cuda(const at::Tensor& src, at::Tensor& dst, const at::Tensor& block_mapping) {
  raise_device_error("swap_blocks");
  PS_CHECK(src.scalar_type() == dst.scalar_type() && src.dim() >= 1 && src.sizes().slice(1) == dst.sizes().slice(1) &&
               src.is_contiguous() && dst.is_contiguous(),
           "swap_blocks: src and dst must be contiguous with the same dtype and block shape");
  checks::check_mapping_on_host(block_mapping, src.size(0), dst.size(0), "swap_blocks");
  const at::Device device = src.is_cuda() ? src.device() : dst.device();
  const c10::cuda::CUDAGuard guard(device);
  const at::Tensor mapping = block_mapping.contiguous();
  const int64_t* pairs = mapping.const_data_ptr<int64_t>();
  int64_t block_bytes = src.element_size();
  for (int64_t d = 1; d < src.dim(); ++d) block_bytes *= src.size(d);
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
