// Host launchers of the paged attention kernels in attention_kernels.cuh: pick the
// instantiation (dtype, head size, GQA chunk) and the single- or two-pass path.

#include "attention_kernels.cuh"

namespace paged_serve::cuda {
namespace {

using namespace attention_kernels;

template <typename T, int HEAD_SIZE, int GROUP>
cudaError_t launch(void* out, const void* query, const void* key_cache, const void* value_cache,
                   const int* block_tables, const int* context_lens, float* partial_out, float* partial_max,
                   float* partial_sum, const AttentionShape& shape, float scale, int max_context_len,
                   int* error_flag, cudaStream_t stream) {
  const int num_partitions = attention_num_partitions(max_context_len);
  const int group_size = shape.num_heads / shape.num_kv_heads;
  const int chunks = (group_size + GROUP - 1) / GROUP;
  const dim3 grid(shape.num_kv_heads * chunks, shape.num_seqs, num_partitions);
  paged_attention_kernel<T, HEAD_SIZE, GROUP><<<grid, kNumThreads, 0, stream>>>(
      static_cast<T*>(out), static_cast<const T*>(query), static_cast<const T*>(key_cache),
      static_cast<const T*>(value_cache), block_tables, context_lens, partial_out, partial_max, partial_sum,
      shape, scale, error_flag);
  if (num_partitions > 1) {
    const dim3 reduce_grid(shape.num_heads, shape.num_seqs);
    paged_attention_reduce_kernel<T, HEAD_SIZE><<<reduce_grid, kNumThreads, 0, stream>>>(
        static_cast<T*>(out), partial_out, partial_max, partial_sum, context_lens, shape, num_partitions, error_flag);
  }
  return cudaGetLastError();
}

template <typename T, int HEAD_SIZE, typename... Args>
cudaError_t launch_for_group(int group_size, Args... args) {
  switch (attention_heads_per_block(group_size)) {
    case 1: return launch<T, HEAD_SIZE, 1>(args...);
    case 4: return launch<T, HEAD_SIZE, 4>(args...);
    default: return launch<T, HEAD_SIZE, 8>(args...);
  }
}

template <typename T, typename... Args>
cudaError_t launch_for_shape(const AttentionShape& shape, Args... args) {
  const int group_size = shape.num_heads / shape.num_kv_heads;
  switch (shape.head_size) {
    case 64: return launch_for_group<T, 64>(group_size, args...);
    case 128: return launch_for_group<T, 128>(group_size, args...);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

cudaError_t paged_attention(void* out, const void* query, const void* key_cache, const void* value_cache,
                            const int* block_tables, const int* context_lens, float* partial_out,
                            float* partial_max, float* partial_sum, const AttentionShape& shape, float scale,
                            int max_context_len, DType dtype, int* error_flag, cudaStream_t stream) {
  if (shape.num_seqs == 0 || shape.num_heads == 0) return cudaSuccess;
  if (shape.num_kv_heads <= 0 || shape.block_size <= 0 || shape.num_blocks <= 0 || shape.num_seqs > kMaxGridYZ ||
      attention_num_partitions(max_context_len) > kMaxPartitions)
    return cudaErrorInvalidValue;
  switch (dtype) {
    case DType::kFloat32:
      return launch_for_shape<float>(shape, out, query, key_cache, value_cache, block_tables,
                                         context_lens, partial_out, partial_max, partial_sum, shape, scale,
                                         max_context_len, error_flag, stream);
    case DType::kFloat16:
      return launch_for_shape<__half>(shape, out, query, key_cache, value_cache, block_tables,
                                          context_lens, partial_out, partial_max, partial_sum, shape, scale,
                                          max_context_len, error_flag, stream);
    case DType::kBFloat16:
      return launch_for_shape<__nv_bfloat16>(shape, out, query, key_cache, value_cache,
                                                 block_tables, context_lens, partial_out, partial_max,
                                                 partial_sum, shape, scale, max_context_len, error_flag, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace paged_serve::cuda
