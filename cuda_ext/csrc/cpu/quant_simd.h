// The vector operations the quantized micro-kernels (quant_tiles.h) are written in, for the
// instruction set the build targets, chosen at compile time (as attention.cpp's paths are):
//
//   AVX-512 VNNI (__AVX512VNNI__ with F, BW, VL): 16 int32 lanes, a lane's 4-byte dot product
//     one vpdpbusd;
//   AVX2 + FMA + F16C: 8 lanes (a panel's 16 rows are two passes), vpmaddubsw + vpmaddwd, or
//     vpdpbusd where the build has AVX-VNNI;
//   portable: loops over 16 lanes that the compiler vectorises as it can.
//
// Every path computes the same integers: dot4 is exact (a 4-bit, 5-bit or 6-bit weight times
// an activation in [-127, 127] never saturates vpmaddubsw's int16 pair sums: 2 x 63 x 127).
// Only the fp32 accumulation may differ in its last bits (FMA against separate rounding).
#pragma once

#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define PAGED_SERVE_QUANT_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PAGED_SERVE_QUANT_AVX2 1
#endif

#if defined(PAGED_SERVE_QUANT_AVX512) || defined(PAGED_SERVE_QUANT_AVX2)
#include <immintrin.h>
#endif

namespace paged_serve::cpu::quant {

inline int32_t load_i32(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

#if defined(PAGED_SERVE_QUANT_AVX512)

struct Vec {
  static constexpr const char* kName = "avx512_vnni";
  static constexpr int kLanes = 16;
  static constexpr int kMaxRows = 8;  // rows per micro-kernel tile
  // dot4s (signed weights) adds kS8Bias x the activations' sum; the caller starts from minus it.
  static constexpr int kS8Bias = 128;
  using I = __m512i;
  using F = __m512;

  static I zero() { return _mm512_setzero_si512(); }
  static I set1(int32_t v) { return _mm512_set1_epi32(v); }
  static I load(const uint8_t* p) { return _mm512_loadu_si512(p); }
  static I lo4(I v) { return _mm512_and_si512(v, _mm512_set1_epi8(0x0F)); }
  static I hi4(I v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F)); }
  // Per byte: (v >> S) & mask (S < 0: a left shift); `mask` keeps bits that stay in their byte.
  template <int S>
  static I bits(I v, char mask) {
    if constexpr (S > 0) v = _mm512_srli_epi16(v, S);
    if constexpr (S < 0) v = _mm512_slli_epi16(v, -S);
    return _mm512_and_si512(v, _mm512_set1_epi8(mask));
  }
  static I or_(I a, I b) { return _mm512_or_si512(a, b); }
  // acc + per lane sum_b w.u8[4 lane + b] * a[b] for the 4 signed bytes at a.
  // NOTE: GCC 12 does not fold the broadcast into vpdpbusd's {1to16} memory operand; a separate
  // vpbroadcastd per product was a quarter of the q4_k kernel's instructions.
  static I dot4(I acc, I w, const int8_t* a) {
    asm("vpdpbusd %[a]%{1to16%}, %[w], %[acc]"
        : [acc] "+v"(acc)
        : [w] "v"(w), [a] "m"(*reinterpret_cast<const int32_t*>(a)));
    return acc;
  }
  // dot4 of (w0, a0) and of (w1, a1) into acc; unsigned weights up to 63 (see the AVX2 path).
  static I dot4x2(I acc, I w0, const int8_t* a0, I w1, const int8_t* a1) { return dot4(dot4(acc, w0, a0), w1, a1); }
  // The same for signed weights, plus kS8Bias * sum(a) (vpdpbusd takes unsigned weights).
  static I dot4s(I acc, I w, const int8_t* a) { return dot4(acc, _mm512_xor_si512(w, _mm512_set1_epi8(-128)), a); }
  static I add(I a, I b) { return _mm512_add_epi32(a, b); }
  static I mullo(I a, I b) { return _mm512_mullo_epi32(a, b); }
  static I u8(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static I s8(const int8_t* p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  // Per lane p[2 lane] * pair.lo + p[2 lane + 1] * pair.hi (unsigned bytes, int16 pair).
  static I madd_u8pairs(const uint8_t* p, int32_t pair) {
    return _mm512_madd_epi16(_mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))),
                             _mm512_set1_epi32(pair));
  }
  static F f16(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static F zerof() { return _mm512_setzero_ps(); }
  static F setf(float v) { return _mm512_set1_ps(v); }
  static F cvt(I v) { return _mm512_cvtepi32_ps(v); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F fnmadd(F a, F b, F c) { return _mm512_fnmadd_ps(a, b, c); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F addf(F a, F b) { return _mm512_add_ps(a, b); }
  static __mmask16 mask(int n) { return static_cast<__mmask16>((1u << n) - 1u); }
  static F loadf(const float* p, int n) { return _mm512_maskz_loadu_ps(mask(n), p); }
  static void store(float* y, F v, int n) {
    if (n == kLanes) {
      _mm512_storeu_ps(y, v);
    } else {
      _mm512_mask_storeu_ps(y, mask(n), v);
    }
  }
};

#elif defined(PAGED_SERVE_QUANT_AVX2)

struct Vec {
#if defined(__AVXVNNI__)
  static constexpr const char* kName = "avx_vnni";
  static constexpr int kS8Bias = 128;
#else
  static constexpr const char* kName = "avx2";
  static constexpr int kS8Bias = 0;
#endif
  static constexpr int kLanes = 8;
  static constexpr int kMaxRows = 4;
  using I = __m256i;
  using F = __m256;

  static I zero() { return _mm256_setzero_si256(); }
  static I set1(int32_t v) { return _mm256_set1_epi32(v); }
  static I load(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static I lo4(I v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0F)); }
  static I hi4(I v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F)); }
  template <int S>
  static I bits(I v, char mask) {
    if constexpr (S > 0) v = _mm256_srli_epi16(v, S);
    if constexpr (S < 0) v = _mm256_slli_epi16(v, -S);
    return _mm256_and_si256(v, _mm256_set1_epi8(mask));
  }
  static I or_(I a, I b) { return _mm256_or_si256(a, b); }
  static I dot4(I acc, I w, const int8_t* a) {
#if defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, w, _mm256_set1_epi32(load_i32(a)));
#else
    const I p = _mm256_maddubs_epi16(w, _mm256_set1_epi32(load_i32(a)));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
#endif
  }
  // NOTE: with weights up to 63, the two products' int16 pair sums add up to at most
  // 2 x 2 x 63 x 127 = 32004, so one vpmaddwd + vpaddd serves both (5 instructions, not 6).
  static I dot4x2(I acc, I w0, const int8_t* a0, I w1, const int8_t* a1) {
#if defined(__AVXVNNI__)
    return dot4(dot4(acc, w0, a0), w1, a1);
#else
    const I p = _mm256_add_epi16(_mm256_maddubs_epi16(w0, _mm256_set1_epi32(load_i32(a0))),
                                 _mm256_maddubs_epi16(w1, _mm256_set1_epi32(load_i32(a1))));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
#endif
  }
  static I dot4s(I acc, I w, const int8_t* a) {
#if defined(__AVXVNNI__)
    return dot4(acc, _mm256_xor_si256(w, _mm256_set1_epi8(-128)), a);
#else
    // NOTE: |w| as unsigned (128 for -128) times a with w's sign: pair sums stay within
    // 2 x 128 x 127, where w + 128 (up to 255) would saturate vpmaddubsw.
    const I x = _mm256_set1_epi32(load_i32(a));
    const I p = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
#endif
  }
  static I add(I a, I b) { return _mm256_add_epi32(a, b); }
  static I mullo(I a, I b) { return _mm256_mullo_epi32(a, b); }
  static I u8(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
  static I s8(const int8_t* p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
  static I madd_u8pairs(const uint8_t* p, int32_t pair) {
    return _mm256_madd_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
                             _mm256_set1_epi32(pair));
  }
  static F f16(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static F zerof() { return _mm256_setzero_ps(); }
  static F setf(float v) { return _mm256_set1_ps(v); }
  static F cvt(I v) { return _mm256_cvtepi32_ps(v); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F fnmadd(F a, F b, F c) { return _mm256_fnmadd_ps(a, b, c); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F addf(F a, F b) { return _mm256_add_ps(a, b); }
  static I mask(int n) { return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)); }
  static F loadf(const float* p, int n) { return _mm256_maskload_ps(p, mask(n)); }
  static void store(float* y, F v, int n) {
    if (n == kLanes) {
      _mm256_storeu_ps(y, v);
    } else {
      _mm256_maskstore_ps(y, mask(n), v);
    }
  }
};

#else  // portable

struct Vec {
  static constexpr const char* kName = "portable";
  static constexpr int kLanes = 16;
  static constexpr int kMaxRows = 4;
  static constexpr int kS8Bias = 0;
  struct I {
    int32_t v[16];
    const uint8_t* bytes() const { return reinterpret_cast<const uint8_t*>(v); }
    uint8_t* bytes() { return reinterpret_cast<uint8_t*>(v); }
  };
  struct F {
    float v[16];
  };

  static I zero() { return set1(0); }
  static I set1(int32_t x) {
    I r;
    for (int l = 0; l < kLanes; ++l) r.v[l] = x;
    return r;
  }
  static I load(const uint8_t* p) {
    I r;
    std::memcpy(r.v, p, sizeof r.v);
    return r;
  }
  static I lo4(I v) {
    for (int j = 0; j < 4 * kLanes; ++j) v.bytes()[j] &= 0x0F;
    return v;
  }
  static I hi4(I v) {
    for (int j = 0; j < 4 * kLanes; ++j) v.bytes()[j] >>= 4;
    return v;
  }
  template <int S>
  static I bits(I v, char mask) {
    for (int j = 0; j < 4 * kLanes; ++j) {
      const unsigned b = v.bytes()[j];
      const unsigned shifted = S >= 0 ? b >> (S >= 0 ? S : 0) : b << (S < 0 ? -S : 0);
      v.bytes()[j] = static_cast<uint8_t>(shifted & static_cast<uint8_t>(mask));
    }
    return v;
  }
  static I or_(I a, I b) {
    for (int l = 0; l < kLanes; ++l) a.v[l] |= b.v[l];
    return a;
  }
  static I dot4(I acc, const I& w, const int8_t* a) {
    for (int l = 0; l < kLanes; ++l) {
      for (int b = 0; b < 4; ++b) acc.v[l] += static_cast<int32_t>(w.bytes()[4 * l + b]) * a[b];
    }
    return acc;
  }
  static I dot4x2(I acc, const I& w0, const int8_t* a0, const I& w1, const int8_t* a1) {
    return dot4(dot4(acc, w0, a0), w1, a1);
  }
  static I dot4s(I acc, const I& w, const int8_t* a) {
    const int8_t* s = reinterpret_cast<const int8_t*>(w.bytes());
    for (int l = 0; l < kLanes; ++l) {
      for (int b = 0; b < 4; ++b) acc.v[l] += static_cast<int32_t>(s[4 * l + b]) * a[b];
    }
    return acc;
  }
  static I add(I a, const I& b) {
    for (int l = 0; l < kLanes; ++l) a.v[l] += b.v[l];
    return a;
  }
  static I mullo(I a, const I& b) {
    for (int l = 0; l < kLanes; ++l) a.v[l] *= b.v[l];
    return a;
  }
  static I u8(const uint8_t* p) {
    I r;
    for (int l = 0; l < kLanes; ++l) r.v[l] = p[l];
    return r;
  }
  static I s8(const int8_t* p) {
    I r;
    for (int l = 0; l < kLanes; ++l) r.v[l] = p[l];
    return r;
  }
  static I madd_u8pairs(const uint8_t* p, int32_t pair) {
    const auto lo = static_cast<int16_t>(pair & 0xFFFF), hi = static_cast<int16_t>(static_cast<uint32_t>(pair) >> 16);
    I r;
    for (int l = 0; l < kLanes; ++l) r.v[l] = p[2 * l] * lo + p[2 * l + 1] * hi;
    return r;
  }
  static F f16(const uint16_t* p) {
    F r;
    for (int l = 0; l < kLanes; ++l) r.v[l] = c10::detail::fp16_ieee_to_fp32_value(p[l]);
    return r;
  }
  static F zerof() { return setf(0.f); }
  static F setf(float x) {
    F r;
    for (int l = 0; l < kLanes; ++l) r.v[l] = x;
    return r;
  }
  static F cvt(const I& v) {
    F r;
    for (int l = 0; l < kLanes; ++l) r.v[l] = static_cast<float>(v.v[l]);
    return r;
  }
  static F fmadd(const F& a, const F& b, F c) {
    for (int l = 0; l < kLanes; ++l) c.v[l] += a.v[l] * b.v[l];
    return c;
  }
  static F fnmadd(const F& a, const F& b, F c) {
    for (int l = 0; l < kLanes; ++l) c.v[l] -= a.v[l] * b.v[l];
    return c;
  }
  static F mul(F a, const F& b) {
    for (int l = 0; l < kLanes; ++l) a.v[l] *= b.v[l];
    return a;
  }
  static F addf(F a, const F& b) {
    for (int l = 0; l < kLanes; ++l) a.v[l] += b.v[l];
    return a;
  }
  static F loadf(const float* p, int n) {
    F r = zerof();
    for (int l = 0; l < n; ++l) r.v[l] = p[l];
    return r;
  }
  static void store(float* y, const F& v, int n) {
    for (int l = 0; l < n; ++l) y[l] = v.v[l];
  }
};

#endif

}  // namespace paged_serve::cpu::quant
