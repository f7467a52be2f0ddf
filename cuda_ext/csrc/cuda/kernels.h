// Host entry points of the CUDA kernels. Plain C++ and the CUDA runtime only, no torch
// headers: ../bindings.cpp turns tensors into these pointers, sizes and strides, and
// `nvcc -c` can compile-check the .cu files on machines whose torch has no CUDA.
//
// Cache layout: [num_blocks, num_kv_heads, block_size, head_size], head_size contiguous.
// Every function returns cudaSuccess or the launch error; none synchronises. Element offsets
// are computed in int64 throughout (a pool may hold more than 2^31 elements).
//
// Device-side guards: index data (slots, block ids, context lengths) lives in device memory,
// where the host cannot check it without a synchronisation. The kernels never touch memory
// outside the pool for a bad index: they skip the write (or read block 0 instead) and store
// an ErrorCode into *error_flag (host-mapped memory, may be null), which the bindings turn
// into an exception at the next call.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace paged_serve::cuda {

enum class DType { kFloat32, kFloat16, kBFloat16 };

// What a kernel stores into *error_flag (one code; concurrent stores of different codes leave
// one of them). The flag is only ever set by kernels, and reset by the host.
enum ErrorCode : int {
  kNoError = 0,
  kBadSlot = 1,        // reshape_and_cache: slot >= num_blocks * block_size (token skipped)
  kBadBlockId = 2,     // paged_attention / copy_blocks: block id outside [0, num_blocks)
  kBadContextLen = 3,  // paged_attention: context_len < 0 or > max_context_len / table width
};

// Tokens per partition of the split-context (two-pass) attention path, and the most
// partitions one sequence may have (contexts up to kPartitionSize * kMaxPartitions tokens).
constexpr int kPartitionSize = 512;
constexpr int kMaxPartitions = 1024;

// Head sizes the attention kernel is instantiated for; bindings reject the others.
inline bool attention_supports_head_size(int head_size) { return head_size == 64 || head_size == 128; }

// Number of partitions paged_attention uses for this max_context_len; 1 means single pass
// (no scratch buffers needed). max_context_len must be >= every context length: a longer
// one is reported as kBadContextLen (and cut at num_partitions * kPartitionSize tokens).
inline int attention_num_partitions(int max_context_len) {
  return max_context_len <= kPartitionSize ? 1 : (max_context_len + kPartitionSize - 1) / kPartitionSize;
}

// Longest context paged_attention accepts.
constexpr int kMaxContextLen = kPartitionSize * kMaxPartitions;

// Query heads one attention thread block computes for a GQA group of group_size query heads
// per KV head: the smallest instantiation (1, 4 or 8) that holds the group; larger groups run
// in chunks of 8.
inline int attention_heads_per_block(int group_size) { return group_size == 1 ? 1 : group_size <= 4 ? 4 : 8; }

struct AttentionShape {
  int num_seqs, num_heads, num_kv_heads, head_size, block_size, max_blocks_per_seq, num_blocks;
  int64_t q_stride_seq, q_stride_head;                                // query
  int64_t out_stride_seq, out_stride_head;                            // out
  int64_t cache_stride_block, cache_stride_head, cache_stride_token;  // key and value caches
  int max_context_len;  // the caller's bound on every context_lens entry (checked in the kernel)
  int block_shift;      // log2(block_size) for a power of two (shifts, not divisions), else -1
};

// log2(block_size) when it is a power of two, else -1 (AttentionShape::block_shift).
inline int attention_block_shift(int block_size) {
  int shift = 0;
  while ((1 << shift) < block_size && shift < 30) ++shift;
  return block_size > 0 && (1 << shift) == block_size ? shift : -1;
}

cudaError_t paged_attention(void* out,                 // [num_seqs, num_heads, head_size]
                            const void* query,         // [num_seqs, num_heads, head_size]
                            const void* key_cache,     // [num_blocks, num_kv_heads, block_size, head_size]
                            const void* value_cache,   // [num_blocks, num_kv_heads, block_size, head_size]
                            const int* block_tables,   // [num_seqs, max_blocks_per_seq]
                            const int* context_lens,   // [num_seqs]
                            float* partial_out,        // [num_seqs, num_heads, num_partitions, head_size], if > 1 partition
                            float* partial_max,        // [num_seqs, num_heads, num_partitions], if > 1 partition
                            float* partial_sum,        // [num_seqs, num_heads, num_partitions], if > 1 partition
                            const AttentionShape& shape, float scale, int max_context_len, DType dtype,
                            int* error_flag, cudaStream_t stream);

// Copies token rows into cache slots; element_size in bytes (2 or 4). Strides in elements.
cudaError_t reshape_and_cache(const void* key,          // [num_tokens, num_kv_heads, head_size]
                              const void* value,        // [num_tokens, num_kv_heads, head_size]
                              void* key_cache,          // [num_blocks, num_kv_heads, block_size, head_size]
                              void* value_cache,        // [num_blocks, num_kv_heads, block_size, head_size]
                              const int64_t* slot_mapping,  // [num_tokens]
                              int num_tokens, int num_kv_heads, int head_size, int block_size,
                              int64_t key_stride_token, int64_t key_stride_head,
                              int64_t value_stride_token, int64_t value_stride_head,
                              int64_t cache_stride_block, int64_t cache_stride_head, int64_t cache_stride_token,
                              int64_t num_slots, int element_size, int* error_flag, cudaStream_t stream);

// Copies block src -> dst in every cache. cache_ptrs holds device addresses (as int64) of
// contiguous block-major caches that share one block size in bytes and num_blocks blocks.
cudaError_t copy_blocks(const int64_t* cache_ptrs,     // [num_caches] (device memory)
                        const int64_t* block_mapping,  // [num_pairs, 2] (device memory)
                        int num_caches, int64_t num_pairs, int64_t block_bytes, int64_t num_blocks,
                        int* error_flag, cudaStream_t stream);

// Largest grid y / z dimension: the attention kernels put sequences on y.
constexpr int kMaxGridYZ = 65535;

// Host <-> device or device <-> device block copies, one cudaMemcpyAsync per pair (the host
// side should be pinned memory for the copy to be asynchronous). block_mapping lives in host
// memory.
cudaError_t swap_blocks(const void* src,               // [num_src_blocks, ...]
                        void* dst,                     // [num_dst_blocks, ...]
                        const int64_t* block_mapping,  // [num_pairs, 2] (host memory)
                        int num_pairs, int64_t block_bytes, cudaMemcpyKind kind, cudaStream_t stream);

}  // namespace paged_serve::cuda
