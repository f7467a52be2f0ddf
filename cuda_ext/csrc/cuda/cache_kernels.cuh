// CUDA cache kernels: reshape_and_cache (new tokens' K/V into their slots) and copy_blocks
// (copy-on-write across all layers in one launch). Dtype-agnostic copies of 2- or 4-byte
// words (16-byte vectors for whole blocks). Plain CUDA C++; cache.cu launches them, and
// tests/kernels/cuda_sim runs them on the CPU.
#pragma once

#include "errors.cuh"
#include "kernels.h"

#include <cstdint>

namespace paged_serve::cuda::cache_kernels {

constexpr int kCacheThreads = 256;

// Grid: (num_tokens); block: kCacheThreads threads over num_kv_heads * head_size elements.
template <typename Word>
__global__ void reshape_and_cache_kernel(
    const Word* __restrict__ key,             // [num_tokens, num_kv_heads, head_size]
    const Word* __restrict__ value,           // [num_tokens, num_kv_heads, head_size]
    Word* __restrict__ key_cache,             // [num_blocks, num_kv_heads, block_size, head_size]
    Word* __restrict__ value_cache,           // [num_blocks, num_kv_heads, block_size, head_size]
    const int64_t* __restrict__ slot_mapping, // [num_tokens]
    int num_kv_heads, int head_size, int block_size, int64_t key_stride_token, int64_t key_stride_head,
    int64_t value_stride_token, int64_t value_stride_head, int64_t cache_stride_block,
    int64_t cache_stride_head, int64_t cache_stride_token, int64_t num_slots, int* error_flag) {
  const int64_t token = blockIdx.x;
  const int64_t slot = slot_mapping[token];
  if (slot < 0) return;  // padding token
  if (slot >= num_slots) {  // would write into the next layer's cache: skip, tell the host
    if (threadIdx.x == 0) report_error(error_flag, kBadSlot);
    return;
  }
  const int64_t cache_base = (slot / block_size) * cache_stride_block + (slot % block_size) * cache_stride_token;
  for (int i = threadIdx.x; i < num_kv_heads * head_size; i += blockDim.x) {
    const int64_t head = i / head_size, d = i % head_size;
    const int64_t dst = cache_base + head * cache_stride_head + d;
    key_cache[dst] = key[token * key_stride_token + head * key_stride_head + d];
    value_cache[dst] = value[token * value_stride_token + head * value_stride_head + d];
  }
}

// Grid: (num_pairs, num_caches) (pairs on x: up to 2^31 - 1 of them); block: kCacheThreads
// threads over the words of one block.
template <typename Word>
__global__ void copy_blocks_kernel(
    const int64_t* __restrict__ cache_ptrs,     // [num_caches]
    const int64_t* __restrict__ block_mapping,  // [num_pairs, 2]
    int64_t block_words, int64_t num_blocks, int* error_flag) {
  Word* cache = reinterpret_cast<Word*>(cache_ptrs[blockIdx.y]);
  const int64_t pair = blockIdx.x;
  const int64_t src_block = block_mapping[2 * pair], dst_block = block_mapping[2 * pair + 1];
  if (src_block < 0 || src_block >= num_blocks || dst_block < 0 || dst_block >= num_blocks) {
    if (threadIdx.x == 0) report_error(error_flag, kBadBlockId);
    return;
  }
  const int64_t src = src_block * block_words, dst = dst_block * block_words;
  for (int64_t i = threadIdx.x; i < block_words; i += blockDim.x) cache[dst + i] = cache[src + i];
}

}  // namespace paged_serve::cuda::cache_kernels
