// Device side of the kernels' error reporting (kernels.h, ErrorCode): a bad index found by a
// kernel is stored into a host-mapped int that the bindings read at the next call.
#pragma once

#include "kernels.h"

namespace paged_serve::cuda {

// A plain volatile store, no atomic: atomics to host-mapped memory need PCIe atomics, which
// not every system has; concurrent reporters all store a nonzero code, so one of them wins.
__device__ __forceinline__ void report_error(int* error_flag, int code) {
  if (error_flag != nullptr) *reinterpret_cast<volatile int*>(error_flag) = code;
}

}  // namespace paged_serve::cuda
