// CPU cache ops: reshape_and_cache, copy_blocks, swap_blocks. All are plain byte copies, so
// they work for every dtype without dispatching on it.

#include "cpu_ops.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <cstring>

namespace paged_serve::cpu {
namespace {

// Bytes of one block in a block-major tensor [num_blocks, ...] (checked contiguous).
int64_t block_bytes(const at::Tensor& t) {
  TORCH_CHECK(t.is_contiguous(), "block-major cache tensors must be contiguous");
  return t.dim() == 0 || t.size(0) == 0 ? 0 : t.numel() / t.size(0) * t.element_size();
}

char* block_ptr(const at::Tensor& t, int64_t block, int64_t bytes) {
  TORCH_CHECK(block >= 0 && block < t.size(0), "block id ", block, " out of range [0, ", t.size(0), ")");
  return static_cast<char*>(t.data_ptr()) + block * bytes;
}

void check_mapping(const at::Tensor& mapping) {
  TORCH_CHECK(mapping.device().is_cpu() && mapping.scalar_type() == at::kLong && mapping.dim() == 2 &&
                  mapping.size(1) == 2,
              "block_mapping must be a [num_pairs, 2] int64 CPU tensor");
}

}  // namespace

void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                       at::Tensor& value_cache, const at::Tensor& slot_mapping) {
  TORCH_CHECK(key.dim() == 3 && key.sizes() == value.sizes(), "key/value must be [num_tokens, num_kv_heads, head_size]");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.sizes() == value_cache.sizes(), "caches must be [num_blocks, num_kv_heads, block_size, head_size]");
  TORCH_CHECK(key.size(1) == key_cache.size(1) && key.size(2) == key_cache.size(3), "key/value heads or head_size differ from the cache's");
  TORCH_CHECK(key.scalar_type() == key_cache.scalar_type() && value.scalar_type() == value_cache.scalar_type(),
              "key/value must have the caches' dtype");
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1 && key_cache.stride(3) == 1 && value_cache.stride(3) == 1,
              "the head_size dimension must be contiguous");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.numel() == key.size(0), "slot_mapping must be [num_tokens] int64");

  const at::Tensor slots = slot_mapping.contiguous();
  const int64_t* slot = slots.const_data_ptr<int64_t>();
  const int64_t num_tokens = key.size(0), num_heads = key.size(1);
  const int64_t block_size = key_cache.size(2), num_slots = key_cache.size(0) * block_size;
  const int64_t row_bytes = key.size(2) * key.element_size(), elem = key.element_size();
  for (int64_t t = 0; t < num_tokens; ++t) {
    TORCH_CHECK(slot[t] < num_slots, "slot ", slot[t], " out of range (", num_slots, " slots)");
  }

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

void copy_blocks(at::TensorList key_caches, at::TensorList value_caches, const at::Tensor& block_mapping) {
  TORCH_CHECK(key_caches.size() == value_caches.size(), "need as many value caches as key caches");
  check_mapping(block_mapping);
  const at::Tensor mapping = block_mapping.contiguous();
  const int64_t* pairs = mapping.const_data_ptr<int64_t>();
  const int64_t num_pairs = mapping.size(0);
  std::vector<at::Tensor> caches(key_caches.begin(), key_caches.end());
  caches.insert(caches.end(), value_caches.begin(), value_caches.end());
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
  TORCH_CHECK(src.scalar_type() == dst.scalar_type() && src.sizes().slice(1) == dst.sizes().slice(1),
              "src and dst must have the same dtype and block shape");
  check_mapping(block_mapping);
  const at::Tensor mapping = block_mapping.contiguous();
  const int64_t* pairs = mapping.const_data_ptr<int64_t>();
  const int64_t bytes = block_bytes(src);
  TORCH_CHECK(bytes == block_bytes(dst));
  at::parallel_for(0, mapping.size(0), 16, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      std::memcpy(block_ptr(dst, pairs[2 * p + 1], bytes), block_ptr(src, pairs[2 * p], bytes), bytes);
    }
  });
}

}  // namespace paged_serve::cpu
