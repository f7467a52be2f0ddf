// Runs cuda_ext's CUDA paged attention kernels (attention_kernels.cuh, unchanged) on the CPU
// through cuda_sim.h, with the same grid and instantiation choice as cuda/attention.cu.
// Built and called through ctypes by tests/kernels/test_cuda_kernels_emulated.py.

#include "cuda_sim.h"  // first: it redefines the CUDA keywords the kernels use

#include "../../../cuda_ext/csrc/cuda/attention_kernels.cuh"

namespace {

using namespace paged_serve::cuda;
using namespace paged_serve::cuda::attention_kernels;

template <typename T, int HEAD_SIZE, int GROUP>
void run(void* out, const void* query, const void* key_cache, const void* value_cache, const int* block_tables,
         const int* context_lens, const AttentionShape& shape, float scale, int max_context_len, int* error_flag) {
  const int num_partitions = attention_num_partitions(max_context_len);
  const int group_size = shape.num_heads / shape.num_kv_heads;
  const int chunks = (group_size + GROUP - 1) / GROUP;
  const size_t partials = static_cast<size_t>(shape.num_seqs) * shape.num_heads * num_partitions;
  std::vector<float> partial_out(partials * HEAD_SIZE, NAN), partial_max(partials, NAN), partial_sum(partials, NAN);
  const cuda_sim::Dim3 grid{static_cast<unsigned>(shape.num_kv_heads * chunks), static_cast<unsigned>(shape.num_seqs),
                            static_cast<unsigned>(num_partitions)};
  cuda_sim::launch(grid, kNumThreads, [&] {
    paged_attention_kernel<T, HEAD_SIZE, GROUP>(
        static_cast<T*>(out), static_cast<const T*>(query), static_cast<const T*>(key_cache),
        static_cast<const T*>(value_cache), block_tables, context_lens, partial_out.data(), partial_max.data(),
        partial_sum.data(), shape, scale, error_flag);
  });
  if (num_partitions > 1) {
    const cuda_sim::Dim3 reduce_grid{static_cast<unsigned>(shape.num_heads), static_cast<unsigned>(shape.num_seqs), 1};
    cuda_sim::launch(reduce_grid, kNumThreads, [&] {
      paged_attention_reduce_kernel<T, HEAD_SIZE>(static_cast<T*>(out), partial_out.data(), partial_max.data(),
                                                  partial_sum.data(), context_lens, shape, num_partitions, error_flag);
    });
  }
}

template <typename T, int HEAD_SIZE>
void run_group(int heads_per_block, auto&&... args) {
  switch (heads_per_block) {
    case 1: return run<T, HEAD_SIZE, 1>(args...);
    case 4: return run<T, HEAD_SIZE, 4>(args...);
    default: return run<T, HEAD_SIZE, 8>(args...);
  }
}

template <typename T>
int run_head_size(const AttentionShape& shape, auto&&... args) {
  const int per_block = attention_heads_per_block(shape.num_heads / shape.num_kv_heads);
  switch (shape.head_size) {
    case 64: run_group<T, 64>(per_block, args...); return 0;
    case 128: run_group<T, 128>(per_block, args...); return 0;
    default: return 1;
  }
}

}  // namespace

// dtype: 0 float32, 1 float16, 2 bfloat16. strides: q(seq, head), out(seq, head),
// cache(block, head, token), in elements. error_flag: where the kernels report a bad index
// (ErrorCode). Returns 0, or 1 for an unsupported configuration.
extern "C" int sim_paged_attention(void* out, const void* query, const void* key_cache, const void* value_cache,
                                   const int* block_tables, const int* context_lens, int dtype, int num_seqs,
                                   int num_heads, int num_kv_heads, int head_size, int block_size,
                                   int max_blocks_per_seq, int num_blocks, const int64_t* strides, float scale,
                                   int max_context_len, int* error_flag) {
  const AttentionShape shape{num_seqs, num_heads, num_kv_heads, head_size, block_size, max_blocks_per_seq, num_blocks,
                             strides[0], strides[1], strides[2], strides[3], strides[4], strides[5], strides[6],
                             max_context_len, attention_block_shift(block_size)};
  switch (dtype) {
    case 0: return run_head_size<float>(shape, out, query, key_cache, value_cache, block_tables, context_lens, shape, scale, max_context_len, error_flag);
    case 1: return run_head_size<__half>(shape, out, query, key_cache, value_cache, block_tables, context_lens, shape, scale, max_context_len, error_flag);
    case 2: return run_head_size<__nv_bfloat16>(shape, out, query, key_cache, value_cache, block_tables, context_lens, shape, scale, max_context_len, error_flag);
    default: return 1;
  }
}
