// CPU cache ops: reshape_and_cache, copy_blocks, swap_blocks. All are plain byte copies, so
// they work for every dtype without dispatching on it.

#include "cpu_ops.h"

#include "../checks.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <cstring>

namespace paged_serve::cpu {
namespace {

// Bytes of one block in a block-major tensor [num_blocks, ...] (checked contiguous).
int64_t block_bytes(const at::Tensor& t) {
  PS_CHECK(t.is_contiguous(), "block-major cache tensors must be contiguous");
  int64_t bytes = t.element_size();
  for (int64_t d = 1; d < t.dim(); ++d) bytes *= t.size(d);
  return bytes;
}

// Block ids were checked against the tensors' sizes before any copy (checks.h).
char* block_ptr(const at::Tensor& t, int64_t block, int64_t bytes) {
  return static_cast<char*>(t.data_ptr()) + block * bytes;
}

}  // namespace

void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                       at::Tensor& value_cache, const at::Tensor& slot_mapping) {
  checks::check_kv_write(key, value, key_cache, value_cache, slot_mapping);
  checks::check_slots_on_host(slot_mapping, key_cache.size(0) * key_cache.size(2));

  const at::Tensor slots = slot_mapping.contiguous();
  const int64_t* slot = slots.const_data_ptr<int64_t>();
  const int64_t num_tokens = key.size(0), num_heads = key.size(1);
  const int64_t block_size = key_cache.size(2);
  const int64_t row_bytes = key.size(2) * key.element_size(), elem = key.element_size();

  auto copy = [&](const at::Tensor& src, at::Tensor& cache, int64_t t) {
    const int64_t block = slot[t] / block_size, offset = slot[t] % block_size;
    const char* s = static_cast<const char*>(src.const_data_ptr()) + t * src.stride(0) * elem;
    char* d = static_cast<char*>(cache.data_ptr()) + (block * cache.stride(0) + offset * cache.stride(2)) * elem;
    for (int64_t h = 0; h < num_heads; ++h) {
      std::memcpy(d + h * cache.stride(1) * elem, s + h * src.stride(1) * elem, row_bytes);
    }
  };
  at::parallel_for(0, num_tokens, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (slot[t] < 0) continue;  // padding token
      copy(key, key_cache, t);
      copy(value, value_cache, t);
    }
  });
}

void copy_blocks(at::TensorList key_caches, at::TensorList value_caches, const at::Tensor& block_mapping,
                 const std::optional<at::Tensor>& cache_ptrs) {
  (void)cache_ptrs;  // the CUDA kernel's device pointer table; the CPU loop needs none
  PS_CHECK(key_caches.size() == value_caches.size(), "copy_blocks: need as many value caches as key caches");
  if (key_caches.empty()) return;
  std::vector<at::Tensor> caches(key_caches.begin(), key_caches.end());
  caches.insert(caches.end(), value_caches.begin(), value_caches.end());
  const int64_t num_blocks = caches[0].dim() >= 1 ? caches[0].size(0) : 0;
  for (const at::Tensor& cache : caches) {
    PS_CHECK(cache.dim() >= 1 && cache.size(0) == num_blocks,
             "copy_blocks: caches must be block-major [num_blocks, ...] with one number of blocks");
  }
  checks::check_mapping_on_host(block_mapping, num_blocks, num_blocks, "copy_blocks");
  const at::Tensor mapping = block_mapping.contiguous();
  const int64_t* pairs = mapping.const_data_ptr<int64_t>();
  const int64_t num_pairs = mapping.size(0);
  for (const at::Tensor& cache : caches) {
    const int64_t bytes = block_bytes(cache);
    at::parallel_for(0, num_pairs, 16, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p) {
        std::memcpy(block_ptr(cache, pairs[2 * p + 1], bytes), block_ptr(cache, pairs[2 * p], bytes), bytes);
      }
    });
  }
}

void swap_blocks(const at::Tensor& src, at::Tensor& dst, const at::Tensor& block_mapping) {
  PS_CHECK(src.scalar_type() == dst.scalar_type() && src.sizes().slice(1) == dst.sizes().slice(1),
           "src and dst must have the same dtype and block shape");
  PS_CHECK(src.dim() >= 1, "swap_blocks: src and dst must be block-major [num_blocks, ...]");
  checks::check_mapping_on_host(block_mapping, src.size(0), dst.size(0), "swap_blocks");
  const at::Tensor mapping = block_mapping.contiguous();
  const int64_t* pairs = mapping.const_data_ptr<int64_t>();
  const int64_t bytes = block_bytes(src);
  PS_CHECK(bytes == block_bytes(dst), "swap_blocks: src and dst must be contiguous");
  at::parallel_for(0, mapping.size(0), 16, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      std::memcpy(block_ptr(dst, pairs[2 * p + 1], bytes), block_ptr(src, pairs[2 * p], bytes), bytes);
    }
  });
}

}  // namespace paged_serve::cpu
