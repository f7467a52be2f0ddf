// CUDA cache kernels: reshape_and_cache (new tokens' K/V into their slots), copy_blocks
// (copy-on-write across all layers in one launch) and swap_blocks (host <-> device copies).
// All are dtype-agnostic copies of 2- or 4-byte words (or 16-byte vectors for whole blocks).

#include "kernels.h"

#include <cstdint>

namespace paged_serve::cuda {
namespace {

constexpr int kNumThreads = 256;

// Grid: (num_tokens); block: kNumThreads threads over num_kv_heads * head_size elements.
template <typename Word>
__global__ void reshape_and_cache_kernel(
    const Word* __restrict__ key,             // [num_tokens, num_kv_heads, head_size]
    const Word* __restrict__ value,           // [num_tokens, num_kv_heads, head_size]
    Word* __restrict__ key_cache,             // [num_blocks, num_kv_heads, block_size, head_size]
    Word* __restrict__ value_cache,           // [num_blocks, num_kv_heads, block_size, head_size]
    const int64_t* __restrict__ slot_mapping, // [num_tokens]
    int num_kv_heads, int head_size, int block_size, int64_t key_stride_token, int64_t key_stride_head,
    int64_t value_stride_token, int64_t value_stride_head, int64_t cache_stride_block,
    int64_t cache_stride_head, int64_t cache_stride_token) {
  const int64_t token = blockIdx.x;
  const int64_t slot = slot_mapping[token];
  if (slot < 0) return;  // padding token
  const int64_t cache_base = (slot / block_size) * cache_stride_block + (slot % block_size) * cache_stride_token;
  for (int i = threadIdx.x; i < num_kv_heads * head_size; i += blockDim.x) {
    const int head = i / head_size, d = i % head_size;
    const int64_t dst = cache_base + head * cache_stride_head + d;
    key_cache[dst] = key[token * key_stride_token + head * key_stride_head + d];
    value_cache[dst] = value[token * value_stride_token + head * value_stride_head + d];
  }
}

// Grid: (num_caches, num_pairs); block: kNumThreads threads over the words of one block.
template <typename Word>
__global__ void copy_blocks_kernel(
    const int64_t* __restrict__ cache_ptrs,     // [num_caches]
    const int64_t* __restrict__ block_mapping,  // [num_pairs, 2]
    int64_t block_words) {
  Word* cache = reinterpret_cast<Word*>(cache_ptrs[blockIdx.x]);
  const int64_t src = block_mapping[2 * blockIdx.y] * block_words;
  const int64_t dst = block_mapping[2 * blockIdx.y + 1] * block_words;
  for (int64_t i = threadIdx.x; i < block_words; i += blockDim.x) cache[dst + i] = cache[src + i];
}

}  // namespace

cudaError_t reshape_and_cache(const void* key, const void* value, void* key_cache, void* value_cache,
                              const int64_t* slot_mapping, int num_tokens, int num_kv_heads, int head_size,
                              int block_size, int64_t key_stride_token, int64_t key_stride_head,
                              int64_t value_stride_token, int64_t value_stride_head, int64_t cache_stride_block,
                              int64_t cache_stride_head, int64_t cache_stride_token, int element_size,
                              cudaStream_t stream) {
  if (num_tokens == 0) return cudaSuccess;
  const int threads = num_kv_heads * head_size < kNumThreads ? num_kv_heads * head_size : kNumThreads;
  switch (element_size) {
    case 2:
      reshape_and_cache_kernel<uint16_t><<<num_tokens, threads, 0, stream>>>(
          static_cast<const uint16_t*>(key), static_cast<const uint16_t*>(value), static_cast<uint16_t*>(key_cache),
          static_cast<uint16_t*>(value_cache), slot_mapping, num_kv_heads, head_size, block_size, key_stride_token,
          key_stride_head, value_stride_token, value_stride_head, cache_stride_block, cache_stride_head,
          cache_stride_token);
      break;
    case 4:
      reshape_and_cache_kernel<uint32_t><<<num_tokens, threads, 0, stream>>>(
          static_cast<const uint32_t*>(key), static_cast<const uint32_t*>(value), static_cast<uint32_t*>(key_cache),
          static_cast<uint32_t*>(value_cache), slot_mapping, num_kv_heads, head_size, block_size, key_stride_token,
          key_stride_head, value_stride_token, value_stride_head, cache_stride_block, cache_stride_head,
          cache_stride_token);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

cudaError_t copy_blocks(const int64_t* cache_ptrs, const int64_t* block_mapping, int num_caches, int num_pairs,
                        int64_t block_bytes, cudaStream_t stream) {
  if (num_caches == 0 || num_pairs == 0) return cudaSuccess;
  const dim3 grid(num_caches, num_pairs);
  if (block_bytes % sizeof(uint4) == 0) {  // whole 16-byte vectors: the usual case
    copy_blocks_kernel<uint4><<<grid, kNumThreads, 0, stream>>>(cache_ptrs, block_mapping, block_bytes / sizeof(uint4));
  } else {
    copy_blocks_kernel<uint8_t><<<grid, kNumThreads, 0, stream>>>(cache_ptrs, block_mapping, block_bytes);
  }
  return cudaGetLastError();
}

cudaError_t swap_blocks(const void* src, void* dst, const int64_t* block_mapping, int num_pairs, int64_t block_bytes,
                        cudaMemcpyKind kind, cudaStream_t stream) {
  const char* from = static_cast<const char*>(src);
  char* to = static_cast<char*>(dst);
  for (int p = 0; p < num_pairs; ++p) {
    const cudaError_t err = cudaMemcpyAsync(to + block_mapping[2 * p + 1] * block_bytes,
                                            from + block_mapping[2 * p] * block_bytes, block_bytes,
                                            kind, stream);
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

}  // namespace paged_serve::cuda
