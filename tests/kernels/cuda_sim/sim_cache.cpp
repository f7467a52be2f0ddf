// Runs cuda_ext's CUDA cache kernels (cache_kernels.cuh, unchanged) on the CPU through
// cuda_sim.h, with the same launch shapes as cuda/cache.cu. Called through ctypes by
// tests/kernels/test_cuda_kernels_emulated.py.

#include "cuda_sim.h"  // first: it redefines the CUDA keywords the kernels use

#include "../../../cuda_ext/csrc/cuda/cache_kernels.cuh"

using namespace paged_serve::cuda::cache_kernels;

// strides: key(token, head), value(token, head), cache(block, head, token), in elements.
extern "C" int sim_reshape_and_cache(const void* key, const void* value, void* key_cache, void* value_cache,
                                     const int64_t* slot_mapping, int num_tokens, int num_kv_heads, int head_size,
                                     int block_size, const int64_t* s, int64_t num_slots, int element_size,
                                     int* error_flag) {
  const int threads = std::min(num_kv_heads * head_size, kCacheThreads);
  const cuda_sim::Dim3 grid{static_cast<unsigned>(num_tokens), 1, 1};
  auto run = [&](auto word) {
    using W = decltype(word);
    cuda_sim::launch(grid, threads, [&] {
      reshape_and_cache_kernel<W>(static_cast<const W*>(key), static_cast<const W*>(value), static_cast<W*>(key_cache),
                                  static_cast<W*>(value_cache), slot_mapping, num_kv_heads, head_size, block_size,
                                  s[0], s[1], s[2], s[3], s[4], s[5], s[6], num_slots, error_flag);
    });
  };
  switch (element_size) {
    case 2: run(uint16_t{}); return 0;
    case 4: run(uint32_t{}); return 0;
    default: return 1;
  }
}

extern "C" int sim_copy_blocks(const int64_t* cache_ptrs, const int64_t* block_mapping, int num_caches, int num_pairs,
                               int64_t block_bytes, int64_t num_blocks, int* error_flag) {
  const cuda_sim::Dim3 grid{static_cast<unsigned>(num_pairs), static_cast<unsigned>(num_caches), 1};
  if (block_bytes % sizeof(uint4) == 0) {
    cuda_sim::launch(grid, kCacheThreads, [&] {
      copy_blocks_kernel<uint4>(cache_ptrs, block_mapping, block_bytes / sizeof(uint4), num_blocks, error_flag);
    });
  } else {
    cuda_sim::launch(grid, kCacheThreads,
                     [&] { copy_blocks_kernel<uint8_t>(cache_ptrs, block_mapping, block_bytes, num_blocks, error_flag); });
  }
  return 0;
}
