// e^x in a form the compiler vectorises (std::exp is a libm call per element and does not
// vectorise without -ffast-math), shared by the CPU kernels that need many exps.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace paged_serve::cpu {

// Cephes' expf: x = n ln2 + f with |f| <= ln2/2 (ln2 in two parts), a degree-6 polynomial for
// e^f, then 2^n added to the exponent bits. Relative error ~1e-7 (fp32 rounding). The caller
// keeps x within [-87, 88], where 2^n is a normal float.
inline float exp_poly(float x) {
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  float f = x - n * 0.693359375f;
  f = f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * f + 1.3981999507e-3f;
  p = p * f + 8.3334519073e-3f;
  p = p * f + 4.1665795894e-2f;
  p = p * f + 1.6666665459e-1f;
  p = p * f + 5.0000001201e-1f;
  float y = p * f * f + f + 1.0f;
  int32_t bits;
  std::memcpy(&bits, &y, sizeof bits);
  bits += static_cast<int32_t>(n) << 23;
  std::memcpy(&y, &bits, sizeof bits);
  return y;
}

// e^x over the whole float range, x clamped to [-87, 88] (the results there are below FLT_MIN or
// near FLT_MAX; SiLU only divides by 1 + e^x, so the clamp moves nothing it returns by more
// than ~1e-37).
inline float exp_clamped(float x) { return exp_poly(std::min(std::max(x, -87.0f), 88.0f)); }

// exp(x) for x <= 0: Cephes' expf (range reduction by ln 2, degree-5 polynomial), within a few
// ulp of std::exp; 0 below -87 (where float32 exp is denormal or 0). NOTE: std::exp does not
// vectorise without -ffast-math; this does, under `omp simd`.
inline float exp_nonpositive(float x) {
  const float y = x < -87.0f ? -87.0f : x;
  // round to nearest by the 1.5 * 2^23 trick (std::floor would not vectorise here)
  const float n = (y * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const float r = y - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;  // 2^n
  return x < -87.0f ? 0.f : p * __builtin_bit_cast(float, bits);
}

// cap * tanh(x / cap) (logit soft-capping, as Gemma 2's), in a form the compiler vectorises:
// tanh(y) = sign(y) (1 - e) / (1 + e) with e = e^(-2|y|) <= 1. NOTE: near y = 0, 1 - e carries
// an absolute error of ~1 ulp of 1 (6e-8), so the result is within ~cap * 1e-7 of the exact one
// (50 * 1e-7 = 5e-6 on a logit: a relative 5e-6 on a softmax weight, under fp32 sums' error).
inline float soft_cap(float x, float cap) {
  const float y = x / cap;
  const float e = exp_nonpositive(-2.0f * std::fabs(y));
  const float t = cap * ((1.0f - e) / (1.0f + e));
  return y < 0.0f ? -t : t;
}

}  // namespace paged_serve::cpu
