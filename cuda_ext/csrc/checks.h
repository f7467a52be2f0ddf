// Argument checks shared by the CPU ops (cpu/*.cpp) and the CUDA bindings (bindings.cpp), so
// that both backends accept and refuse the same calls with the same PS_CHECK (TORCH_CHECK) messages
// (RuntimeError in Python), never a SIGFPE or an out-of-bounds access:
//
//   * shapes, dtypes and strides of every tensor, value_cache included;
//   * no zero divisors: 0 KV heads, 0 blocks, block size 0, head size 0 are refused;
//   * max_context_len <= block table width * block size (a longer context would read past
//     its table row);
//   * index tensors that live in host memory (slot_mapping, block_tables, context_lens,
//     block mappings) are checked entry by entry: slots < capacity, block ids < number of
//     blocks, context_lens in [0, max_context_len]. Index tensors already on a GPU cannot be
//     read without a synchronisation: the CUDA kernels guard those themselves (cuda/kernels.h,
//     ErrorCode) and the bindings raise the error at the next call.
#pragma once

#include <algorithm>

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include "check_message.h"

#include <cstdint>

namespace paged_serve::checks {

inline bool is_kv_dtype(at::ScalarType t) { return t == at::kFloat || t == at::kHalf || t == at::kBFloat16; }

// Caches [num_blocks, num_kv_heads, block_size, head_size], key and value alike, non-empty.
inline void check_caches(const at::Tensor& key_cache, const at::Tensor& value_cache, const char* op) {
  PS_CHECK(key_cache.dim() == 4 && key_cache.sizes() == value_cache.sizes() &&
               key_cache.strides() == value_cache.strides(),
           op, ": key_cache/value_cache must be [num_blocks, num_kv_heads, block_size, head_size] with equal "
           "strides, got ", key_cache.sizes(), " and ", value_cache.sizes());
  PS_CHECK(key_cache.scalar_type() == value_cache.scalar_type() && is_kv_dtype(key_cache.scalar_type()), op,
           ": key_cache and value_cache must share one dtype of float32, float16, bfloat16; got ",
           key_cache.scalar_type(), " and ", value_cache.scalar_type());
  PS_CHECK(key_cache.size(0) > 0 && key_cache.size(1) > 0 && key_cache.size(2) > 0 && key_cache.size(3) > 0, op,
           ": the caches must have at least one block, KV head, slot and element, got ", key_cache.sizes());
  PS_CHECK(key_cache.stride(3) == 1, op, ": the caches' head_size dimension must be contiguous");
}

// reshape_and_cache: K/V [num_tokens, num_kv_heads, head_size] in the caches' dtype and layout.
inline void check_kv_write(const at::Tensor& key, const at::Tensor& value, const at::Tensor& key_cache,
                           const at::Tensor& value_cache, const at::Tensor& slot_mapping) {
  constexpr const char* op = "reshape_and_cache";
  check_caches(key_cache, value_cache, op);
  PS_CHECK(key.dim() == 3 && key.sizes() == value.sizes(), op, ": key/value must be [num_tokens, num_kv_heads, "
           "head_size], got ", key.sizes(), " and ", value.sizes());
  PS_CHECK(key.size(1) == key_cache.size(1) && key.size(2) == key_cache.size(3), op, ": key/value ", key.sizes(),
           " differ from the cache's heads or head_size ", key_cache.sizes());
  PS_CHECK(key.scalar_type() == key_cache.scalar_type() && value.scalar_type() == key_cache.scalar_type(), op,
           ": key/value must have the caches' dtype ", key_cache.scalar_type(), ", got ", key.scalar_type(), " and ",
           value.scalar_type());
  PS_CHECK(key.stride(2) == 1 && value.stride(2) == 1, op, ": the head_size dimension must be contiguous");
  PS_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 && slot_mapping.numel() == key.size(0),
           op, ": slot_mapping must be [num_tokens] int64");
}

// Every slot < num_blocks * block_size (negative: a skipped padding token). Host memory only.
inline void check_slots_on_host(const at::Tensor& slot_mapping, int64_t num_slots) {
  TORCH_INTERNAL_ASSERT(slot_mapping.device().is_cpu());
  const at::Tensor slots = slot_mapping.contiguous();
  const int64_t* slot = slots.const_data_ptr<int64_t>();
  for (int64_t t = 0; t < slots.numel(); ++t) {
    PS_CHECK(slot[t] < num_slots, "reshape_and_cache: slot ", slot[t], " of token ", t, " out of range (",
             num_slots, " slots)");
  }
}

// paged_attention: everything but the contents of block_tables / context_lens.
inline void check_attention(const at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                            const at::Tensor& value_cache, const at::Tensor& block_tables,
                            const at::Tensor& context_lens, int64_t max_context_len) {
  constexpr const char* op = "paged_attention";
  check_caches(key_cache, value_cache, op);
  PS_CHECK(query.dim() == 3 && out.sizes() == query.sizes(), op, ": query/out must be [num_seqs, num_heads, "
           "head_size], got ", query.sizes(), " and ", out.sizes());
  PS_CHECK(query.scalar_type() == out.scalar_type() && query.scalar_type() == key_cache.scalar_type(), op,
           ": query, out and the caches must share one dtype, got ", query.scalar_type(), ", ", out.scalar_type(),
           " and ", key_cache.scalar_type());
  PS_CHECK(query.stride(2) == 1 && out.stride(2) == 1, op, ": the head_size dimension must be contiguous");
  PS_CHECK(key_cache.size(3) == query.size(2), op, ": the cache's head_size ", key_cache.size(3),
           " differs from the query's ", query.size(2));
  PS_CHECK(query.size(1) % key_cache.size(1) == 0, op, ": num_heads ", query.size(1),
           " must be a multiple of num_kv_heads ", key_cache.size(1));
  PS_CHECK(block_tables.scalar_type() == at::kInt && context_lens.scalar_type() == at::kInt &&
               block_tables.dim() == 2 && block_tables.size(0) == query.size(0) && context_lens.dim() == 1 &&
               context_lens.numel() == query.size(0),
           op, ": block_tables must be [num_seqs, max_blocks_per_seq] int32, context_lens [num_seqs] int32");
  const int64_t capacity = block_tables.size(1) * key_cache.size(2);
  PS_CHECK(max_context_len >= 0 && max_context_len <= capacity, op, ": max_context_len ", max_context_len,
           " does not fit its block table of ", block_tables.size(1), " blocks of ", key_cache.size(2), " tokens");
}

// Every context_len in [0, max_context_len] (check_attention: so within its table row of
// `width` blocks). Host memory only.
inline void check_lens_on_host(const at::Tensor& context_lens, int64_t max_context_len, int64_t width) {
  TORCH_INTERNAL_ASSERT(context_lens.device().is_cpu());
  const at::Tensor lens = context_lens.contiguous();
  const int* len = lens.const_data_ptr<int>();
  for (int64_t seq = 0; seq < lens.numel(); ++seq) {
    PS_CHECK(len[seq] >= 0 && len[seq] <= max_context_len, "paged_attention: sequence ", seq, ": context_len ",
             len[seq], " outside [0, max_context_len=", max_context_len, "] (it would be cut, or read past its "
             "block table of ", width, " blocks)");
  }
}

// Every context_len in [0, max_context_len] (so within its table row) and every block id it
// uses in [0, num_blocks). Host memory only.
// With a sliding `window` (> 0), only the blocks from the one holding position len - window on
// are checked: the block manager gives back (-1) the blocks before it, which the kernel never reads.
inline void check_tables_on_host(const at::Tensor& block_tables, const at::Tensor& context_lens, int64_t num_blocks,
                                 int64_t block_size, int64_t max_context_len, int64_t window = 0) {
  TORCH_INTERNAL_ASSERT(block_tables.device().is_cpu() && context_lens.device().is_cpu());
  const int64_t width = block_tables.size(1);
  check_lens_on_host(context_lens, max_context_len, width);
  const at::Tensor tables = block_tables.contiguous(), lens = context_lens.contiguous();
  const int* table = tables.const_data_ptr<int>();
  const int* len = lens.const_data_ptr<int>();
  for (int64_t seq = 0; seq < lens.numel(); ++seq) {
    const int64_t blocks = (len[seq] + block_size - 1) / block_size;
    const int64_t first = window > 0 ? std::max<int64_t>(0, len[seq] - window) / block_size : 0;
    for (int64_t b = first; b < blocks; ++b) {
      const int id = table[seq * width + b];
      PS_CHECK(id >= 0 && id < num_blocks, "paged_attention: sequence ", seq, ": block id ", id,
               " out of range [0, ", num_blocks, ")");
    }
  }
}

// [num_pairs, 2] int64 (src, dst) rows; src < num_src, dst < num_dst. Host memory only.
inline void check_mapping_on_host(const at::Tensor& mapping, int64_t num_src, int64_t num_dst, const char* op) {
  PS_CHECK(mapping.device().is_cpu() && mapping.scalar_type() == at::kLong && mapping.dim() == 2 &&
               mapping.size(1) == 2,
           op, ": block_mapping must be a [num_pairs, 2] int64 CPU tensor");
  const at::Tensor m = mapping.contiguous();
  const int64_t* pairs = m.const_data_ptr<int64_t>();
  for (int64_t p = 0; p < m.size(0); ++p) {
    PS_CHECK(pairs[2 * p] >= 0 && pairs[2 * p] < num_src && pairs[2 * p + 1] >= 0 && pairs[2 * p + 1] < num_dst,
             op, ": block id out of range in block_mapping row ", p, ": (", pairs[2 * p], ", ", pairs[2 * p + 1],
             ") with ", num_src, " source and ", num_dst, " destination blocks");
  }
}

}  // namespace paged_serve::checks
