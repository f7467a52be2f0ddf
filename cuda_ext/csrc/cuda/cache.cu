// Host launchers of the cache kernels in cache_kernels.cuh, and swap_blocks (host <-> device
// copies with cudaMemcpyAsync, no kernel).

#include "cache_kernels.cuh"

namespace paged_serve::cuda {

using namespace cache_kernels;

cudaError_t reshape_and_cache(const void* key, const void* value, void* key_cache, void* value_cache,
                              const int64_t* slot_mapping, int num_tokens, int num_kv_heads, int head_size,
                              int block_size, int64_t key_stride_token, int64_t key_stride_head,
                              int64_t value_stride_token, int64_t value_stride_head, int64_t cache_stride_block,
                              int64_t cache_stride_head, int64_t cache_stride_token, int64_t num_slots,
                              int element_size, int* error_flag, cudaStream_t stream) {
  if (num_tokens == 0) return cudaSuccess;
  const int threads = num_kv_heads * head_size < kCacheThreads ? num_kv_heads * head_size : kCacheThreads;
  switch (element_size) {
    case 2:
      reshape_and_cache_kernel<uint16_t><<<num_tokens, threads, 0, stream>>>(
          static_cast<const uint16_t*>(key), static_cast<const uint16_t*>(value), static_cast<uint16_t*>(key_cache),
          static_cast<uint16_t*>(value_cache), slot_mapping, num_kv_heads, head_size, block_size, key_stride_token,
          key_stride_head, value_stride_token, value_stride_head, cache_stride_block, cache_stride_head,
          cache_stride_token, num_slots, error_flag);
      break;
    case 4:
      reshape_and_cache_kernel<uint32_t><<<num_tokens, threads, 0, stream>>>(
          static_cast<const uint32_t*>(key), static_cast<const uint32_t*>(value), static_cast<uint32_t*>(key_cache),
          static_cast<uint32_t*>(value_cache), slot_mapping, num_kv_heads, head_size, block_size, key_stride_token,
          key_stride_head, value_stride_token, value_stride_head, cache_stride_block, cache_stride_head,
          cache_stride_token, num_slots, error_flag);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

cudaError_t copy_blocks(const int64_t* cache_ptrs, const int64_t* block_mapping, int num_caches, int64_t num_pairs,
                        int64_t block_bytes, int64_t num_blocks, int* error_flag, cudaStream_t stream) {
  if (num_caches == 0 || num_pairs == 0) return cudaSuccess;
  if (num_caches > kMaxGridYZ || num_pairs > INT32_MAX) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(num_pairs), num_caches);
  if (block_bytes % sizeof(uint4) == 0) {  // whole 16-byte vectors: the usual case
    copy_blocks_kernel<uint4><<<grid, kCacheThreads, 0, stream>>>(cache_ptrs, block_mapping,
                                                                  block_bytes / sizeof(uint4), num_blocks, error_flag);
  } else {
    copy_blocks_kernel<uint8_t><<<grid, kCacheThreads, 0, stream>>>(cache_ptrs, block_mapping, block_bytes,
                                                                    num_blocks, error_flag);
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
