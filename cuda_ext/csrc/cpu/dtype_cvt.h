// Element <-> float conversions for the CPU kernels' loops, in a form the compiler vectorises.
//
// c10's BFloat16 conversions are right but opaque to GCC's vectoriser (the NaN test and the
// struct's constructor kept `#pragma omp simd` loops scalar): fused.cpp's bf16 ops ran 5-10x
// slower than their fp32 twins. Here bf16 is bit arithmetic on its 16 bits, with the same
// results as c10: widening is a shift, narrowing rounds to nearest even and maps any NaN to
// 0x7FC0 (c10::detail::round_to_nearest_even). float16 and float32 keep static_cast.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace paged_serve::cpu {

// v as float.
template <typename T>
inline float to_float(T v) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const uint32_t bits = static_cast<uint32_t>(v.x) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
  } else {
    return static_cast<float>(v);
  }
}

// f rounded to T (to nearest even, as a torch op on T tensors stores it).
template <typename T>
inline T from_float(float f) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    const bool nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
    return c10::BFloat16(static_cast<uint16_t>(nan ? 0x7FC0u : rounded), c10::BFloat16::from_bits());
  } else {
    return static_cast<T>(f);
  }
}

// The value a torch op on T tensors would hold: f rounded to T, read back as float.
template <typename T>
inline float as_dtype(float f) {
  if constexpr (std::is_same_v<T, float>) {
    return f;
  } else {
    return to_float<T>(from_float<T>(f));
  }
}

}  // namespace paged_serve::cpu
