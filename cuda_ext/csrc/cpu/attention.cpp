// CPU paged attention (decode): one query token per sequence against its cached K/V, read
// through the sequence's block table.
//
// Work split: one task per (sequence, KV head). A task computes all the query heads of its GQA
// group, so every K/V row is read from memory once and used `group` times. Tasks run in
// parallel with at::parallel_for; the loops over head_size are written so that the compiler
// vectorises them (fixed trip count for the instantiated head sizes, `omp simd` reductions).
// On AVX2 CPUs rows of up to 512 bytes take the tiled path of attention_avx2.h instead, and on
// AVX-512 CPUs that of attention_avx512.h; the pieces all use are in attention_parts.h.
// A sliding window makes a task's keys the last `window` positions (first_visible), which every
// path reads as a shorter context; a soft-cap bends the logits before the softmax (cap_logits).

#include "cpu_ops.h"

#include "../checks.h"
#include "attention_avx2.h"
#include "attention_avx512.h"
#include "attention_parts.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace paged_serve::cpu {
namespace {

using namespace attention;  // NOLINT: this file is the kernel those pieces are for

// One (sequence, KV head) task. HEAD_SIZE > 0 fixes the head size at compile time; 0 means
// "read it from args" (the generic instantiation for head sizes we do not specialise). The
// query sees the positions [first, context_len) (first_visible: all of them without a window).
template <typename T, int HEAD_SIZE>
void attend_one(const AttentionArgs& a, int seq, int kv_head, T* out, const T* query,
                const T* key_cache, const T* value_cache, const int* block_table, int context_len) {
  const int D = HEAD_SIZE > 0 ? HEAD_SIZE : a.head_size;
  const HeadGroup<T> heads(a, seq, kv_head, D);
  const int group = heads.group;
  if (context_len == 0) return heads.zero_outputs(out);
  const int first = first_visible(a, context_len);
  const int n = context_len - first;  // tokens seen: token t is position first + t

  std::vector<float> q(group * D), acc(group * D, 0.f), logits(group * n), buf(D);
  heads.scaled_queries(query, q.data());

  auto row = [&](const T* cache, int t) {
    const int p = first + t;
    return cache + block_table[block_of(a, p)] * a.cache_stride_block + kv_head * a.cache_stride_head +
           offset_in_block(a, p) * a.cache_stride_token;
  };
  // NOTE: one row at a time, kPrefetchTokens ahead of the row read: a whole block asked for at
  // once (64 lines at block 16, head 64) is more than the core keeps in flight, and ran at
  // ~half the rate (3.05 vs 1.74 ms at batch 32 x 1024, 2 threads).
  auto prefetch_token = [&](const T* cache, int t) {
    if (t < n) prefetch_row(row(cache, t), D);
  };

  // Pass 1: logits[g, t] = q_g . k_t, walking the block table.
  for (int t = 0; t < std::min(kPrefetchTokens, n); ++t) prefetch_token(key_cache, t);
  for (int t = 0; t < n; ++t) {
    prefetch_token(key_cache, t + kPrefetchTokens);
    const float* k = row_as_float<T, HEAD_SIZE>(row(key_cache, t), buf.data(), D);
    for (int g = 0; g < group; ++g) logits[g * n + t] = dot<HEAD_SIZE>(&q[g * D], k, D);
  }

  // Softmax per query head, in fp32 (after the soft-cap, if any).
  std::vector<float> inv_sum(group);
  for (int g = 0; g < group; ++g) {
    cap_logits(a, &logits[g * n], n);
    inv_sum[g] = exp_less_max(&logits[g * n], n);
  }

  // Pass 2: acc[g] = sum_t p[g, t] * v_t.
  for (int t = 0; t < std::min(kPrefetchTokens, n); ++t) prefetch_token(value_cache, t);
  for (int t = 0; t < n; ++t) {
    prefetch_token(value_cache, t + kPrefetchTokens);
    const float* v = row_as_float<T, HEAD_SIZE>(row(value_cache, t), buf.data(), D);
    for (int g = 0; g < group; ++g) axpy<HEAD_SIZE>(logits[g * n + t], v, &acc[g * D], D);
  }

  heads.write_outputs(out, acc.data(), inv_sum.data());
}


template <typename T, int HEAD_SIZE>
void paged_attention_impl(const AttentionArgs& a, int num_seqs, T* out, const T* query,
                          const T* key_cache, const T* value_cache, const int* block_tables,
                          const int* context_lens) {
  const int64_t num_tasks = static_cast<int64_t>(num_seqs) * a.num_kv_heads;
  at::parallel_for(0, num_tasks, 1, [&](int64_t begin, int64_t end) {
#if PAGED_SERVE_ATTENTION_AVX2
    // The vector paths: a thread's tasks in order, each handed the next one's rows (the
    // prefetch stream runs on into it); `ahead` tiles of the first task's K prefetched first.
    auto run_tiled = [&](int tile, int ahead, auto attend) {
      auto rows_of = [&](int64_t task) {
        const int seq = static_cast<int>(task / a.num_kv_heads);
        const int first = first_visible(a, context_lens[seq]);  // a window's first position, else 0
        return TaskRows<T>{&a, key_cache, value_cache, block_tables + static_cast<int64_t>(seq) * a.max_blocks_per_seq,
                           seq, static_cast<int>(task % a.num_kv_heads), context_lens[seq] - first, first};
      };
      TaskRows<T> here = rows_of(begin);
      for (int j = 0; j < std::min(ahead, here.tiles(tile)); ++j) here.prefetch_tile(key_cache, tile, j, HEAD_SIZE);
      for (int64_t task = begin; task < end; ++task) {
        const bool last = task + 1 == end;
        const TaskRows<T> next = last ? here : rows_of(task + 1);
        attend(here, last ? nullptr : &next);
        here = next;
      }
    };
#if PAGED_SERVE_ATTENTION_AVX512
    if constexpr (kAvx512Rows<T, HEAD_SIZE>) {
      run_tiled(kTile512, kAhead512<T, HEAD_SIZE>, [&](const TaskRows<T>& here, const TaskRows<T>* next) {
        attend_one_avx512<T, HEAD_SIZE>(a, here, next, out, query);
      });
      return;
    }
#endif
    if constexpr (kAvx2Rows<T, HEAD_SIZE>) {
      run_tiled(kTileFor<T, HEAD_SIZE>, kAheadTiles<T, HEAD_SIZE>, [&](const TaskRows<T>& here, const TaskRows<T>* next) {
        attend_one_avx2<T, HEAD_SIZE>(a, here, next, out, query);
      });
      return;
    }
#endif
    for (int64_t task = begin; task < end; ++task) {
      const int seq = static_cast<int>(task / a.num_kv_heads);
      attend_one<T, HEAD_SIZE>(a, seq, static_cast<int>(task % a.num_kv_heads), out, query, key_cache, value_cache,
                               block_tables + static_cast<int64_t>(seq) * a.max_blocks_per_seq, context_lens[seq]);
    }
  });
}

}  // namespace

void paged_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, const at::Tensor& block_tables,
                     const at::Tensor& context_lens, double scale, int64_t max_context_len, int64_t window,
                     double softcap) {
  // NOTE: the same checks as the CUDA binding, so that both backends refuse the same calls;
  // max_context_len only bounds context_lens here (the CPU kernel sizes buffers per sequence).
  checks::check_attention(out, query, key_cache, value_cache, block_tables, context_lens, max_context_len);
  PS_CHECK(window >= 0 && window <= INT32_MAX && softcap >= 0.0 && std::isfinite(softcap),
           "paged_attention: window must be >= 0 and softcap finite and >= 0 (0: none), got ", window, " and ",
           softcap);
  checks::check_tables_on_host(block_tables, context_lens, key_cache.size(0), key_cache.size(2), max_context_len,
                               window);
  const int num_kv_heads = static_cast<int>(key_cache.size(1));

  const at::Tensor tables = block_tables.contiguous();
  const at::Tensor lens = context_lens.contiguous();
  const int block_size = static_cast<int>(key_cache.size(2));
  const int block_shift = (block_size & (block_size - 1)) == 0 ? __builtin_ctz(static_cast<unsigned>(block_size)) : -1;
  const AttentionArgs args{
      static_cast<int>(query.size(1)), num_kv_heads, static_cast<int>(query.size(2)),
      block_size, static_cast<int>(tables.size(1)),
      query.stride(0), query.stride(1), out.stride(0), out.stride(1),
      key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), static_cast<float>(scale), block_shift,
      static_cast<int>(window), static_cast<float>(softcap)};

  const int* table_data = tables.const_data_ptr<int>();
  const int* len_data = lens.const_data_ptr<int>();

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, query.scalar_type(), "paged_attention_cpu", [&] {
    auto run = [&](auto head_size_tag) {
      constexpr int HS = decltype(head_size_tag)::value;
      paged_attention_impl<scalar_t, HS>(args, static_cast<int>(query.size(0)), out.data_ptr<scalar_t>(),
                                         query.const_data_ptr<scalar_t>(), key_cache.const_data_ptr<scalar_t>(),
                                         value_cache.const_data_ptr<scalar_t>(), table_data, len_data);
    };
    switch (args.head_size) {
      case 32: run(std::integral_constant<int, 32>{}); break;
      case 64: run(std::integral_constant<int, 64>{}); break;
      case 128: run(std::integral_constant<int, 128>{}); break;
      // NOTE: Gemma's head size; bf16 rows of it (512 bytes) take the vector paths.
      case 256: run(std::integral_constant<int, 256>{}); break;
      default: run(std::integral_constant<int, 0>{}); break;  // generic, any head size
    }
  });
}

}  // namespace paged_serve::cpu
