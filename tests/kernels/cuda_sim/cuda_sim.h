// A tiny CUDA emulator for host compilers: just enough to run cuda_ext's kernels on the CPU,
// where no GPU is present. Every CUDA thread of a block is an OS thread; __syncthreads() is a
// block-wide barrier and __shfl_xor_sync a warp-wide exchange through two barriers, so a
// kernel that skips a barrier or a shuffle on some lanes deadlocks here (the test times out)
// instead of passing. __shared__ variables become function statics, shared by the block's
// threads; blocks run one after another. Include before the kernels.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

namespace cuda_sim {

struct Dim3 {
  unsigned x = 1, y = 1, z = 1;
};

inline thread_local Dim3 thread_idx, block_idx;
inline Dim3 grid_dim, block_dim;

struct Block {
  std::barrier<> all;
  std::vector<std::unique_ptr<std::barrier<>>> warps;
  std::vector<float> exchange;  // [num_warps * 32]
  explicit Block(int threads) : all(threads), exchange(threads) {
    for (int w = 0; w < (threads + 31) / 32; ++w)
      warps.push_back(std::make_unique<std::barrier<>>(std::min(32, threads - 32 * w)));
  }
};
inline Block* block = nullptr;

inline void syncthreads() { block->all.arrive_and_wait(); }

inline float shfl_xor(float v, int lane_mask) {
  const int t = static_cast<int>(thread_idx.x), warp = t / 32;
  block->exchange[t] = v;
  block->warps[warp]->arrive_and_wait();
  const float r = block->exchange[warp * 32 + ((t % 32) ^ lane_mask)];
  block->warps[warp]->arrive_and_wait();
  return r;
}

// Runs kernel() for every thread of every block of the grid.
template <typename Kernel>
void launch(Dim3 grid, int threads, Kernel kernel) {
  grid_dim = grid;
  block_dim = Dim3{static_cast<unsigned>(threads), 1, 1};
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        Block b(threads);
        block = &b;
        std::vector<std::thread> pool;
        for (int t = 0; t < threads; ++t) {
          pool.emplace_back([&, t] {
            thread_idx = Dim3{static_cast<unsigned>(t), 0, 0};
            block_idx = Dim3{x, y, z};
            kernel();
            // An exited thread no longer holds back barriers (as on the GPU).
            b.warps[t / 32]->arrive_and_drop();
            b.all.arrive_and_drop();
          });
        }
        for (auto& th : pool) th.join();
        block = nullptr;
      }
}

}  // namespace cuda_sim

// CUDA spellings the kernels use, mapped onto the emulator.
#undef __global__
#undef __device__
#undef __host__
#undef __forceinline__
#undef __shared__
#undef __launch_bounds__
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(...)
#define threadIdx cuda_sim::thread_idx
#define blockIdx cuda_sim::block_idx
#define gridDim cuda_sim::grid_dim
#define blockDim cuda_sim::block_dim

inline void __syncthreads() { cuda_sim::syncthreads(); }
inline float __shfl_xor_sync(unsigned, float v, int lane_mask) { return cuda_sim::shfl_xor(v, lane_mask); }
inline float __uint_as_float(unsigned u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
using std::max;
using std::min;
