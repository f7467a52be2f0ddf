// Element <-> float conversions for the CPU kernels' loops, in a form the compiler vectorises.
//
// c10's BFloat16 conversions are right but opaque to GCC's vectoriser: its NaN test kept
// `#pragma omp simd` loops scalar, and a store of the BFloat16 struct became one vpextrw per
// element even in a vectorised loop. fused.cpp's bf16 ops ran 5-10x slower than their fp32
// twins. So a loop works on `stored_t<T>`, bf16 as its bare 16 bits (uint16_t), through
// `stored(ptr)`; widening is a shift, narrowing rounds to nearest even and maps any NaN to
// 0x7FC0, the same results as c10::detail::round_to_nearest_even. float16 and float32 keep
// their own types and static_cast.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace paged_serve::cpu {

template <typename T>
constexpr bool kIsBf16 = std::is_same_v<T, c10::BFloat16>;

// How a loop holds a T: bf16 as uint16_t, other types as themselves.
template <typename T>
using stored_t = std::conditional_t<kIsBf16<T>, uint16_t, T>;

template <typename T>
inline stored_t<T>* stored(T* p) {
  return reinterpret_cast<stored_t<T>*>(p);
}

template <typename T>
inline const stored_t<T>* stored(const T* p) {
  return reinterpret_cast<const stored_t<T>*>(p);
}

// A stored T as float.
template <typename T>
inline float to_float(stored_t<T> v) {
  if constexpr (kIsBf16<T>) {
    const uint32_t bits = static_cast<uint32_t>(v) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
  } else {
    return static_cast<float>(v);
  }
}

// f rounded to T (to nearest even, as a torch op on T tensors stores it), as stored.
template <typename T>
inline stored_t<T> from_float(float f) {
  if constexpr (kIsBf16<T>) {
    uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    const bool nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
    return static_cast<uint16_t>(nan ? 0x7FC0u : rounded);
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
