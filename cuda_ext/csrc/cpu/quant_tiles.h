// The quantized micro-kernels: a tile of MR activation rows times one panel (16 output rows,
// quant_format.h) of one type, over all of K, written once for every instruction set in the
// vector operations of quant_simd.h (`V`: lanes [lane, lane + V::kLanes) of the panel per
// call; an AVX2 build calls it for lanes 0 and 8).
//
// Per block, each group of 4 k is unpacked once (nibbles, high bits) and multiplied into all
// MR rows' int32 sums: one dot4 (vpdpbusd) per row and group. The sums are exact integers;
// the type's scales turn them into floats once per block (per 256 for the K types, where the
// 6-bit / int8 sub-block scales multiply the int32 sums first), accumulated in fp32.
//
// Offsets (ggml's -8 of q4_0, -32 of q6_k, kS8Bias of a signed q8_0 through vpdpbusd) are
// taken out through the activations' block sums: sum (q - 8) a = sum q a - 8 sum a, exactly.
#pragma once

#include "quant_format.h"
#include "quant_simd.h"

#include <cstdint>
#include <type_traits>
#include <utility>

#if defined(__SSE__)
#include <xmmintrin.h>
#endif

namespace paged_serve::cpu::quant {

#define PS_UNROLL _Pragma("GCC unroll 16")

// A tile's activations (quant_activations.h): MR rows interleaved 4 bytes at a time, so the 4
// bytes row m multiplies with k-group g (k = 4g..4g+3) are at q + 4 (g MR + m).
struct ActTile {
  const int8_t* q;     // [K / 4][MR][4]
  const float* d;      // [K / block][MR] scales (q8_0's rounded to fp16, as ggml's)
  const int32_t* s;    // q8_0: [K / 32][MR] sums of q; q8_K: [K / 16][MR] -32 x the sums per 16 (q6_k's offset)
  const int32_t* s32;  // q8_K: [K / 64][MR] int16 pairs: the sums of k 64p..64p+31 and 64p+32..64p+63
};

// Prefetch the block panel kAhead panels past the one at p (every line of its kBytes; a
// prefetch past the weight's end does not fault).
// NOTE: a K-type block panel is 2.4-3.4 KB of work (~250 instructions); streamed from DRAM the
// hardware prefetcher did not stay ahead of it: one thread read q4_k at 20 GB/s where sum()
// reads ~40, though it computes 76 GB/s from L2. Two panels ahead: q4_k 20 -> 35-37 GB/s, q6_k
// 20 -> 38-40; q4_0 / q4_1 sixteen blocks ahead (4.6 / 5.1 KB) +7% / +11%; q8_0 none (-8%: its
// 544-byte blocks are the leanest stream, and a prefetch per line cost more than it won).
// Medians of 5 in-process rounds, one thread, weights rotating over 256 MiB (Zen 5 EPYC).
// NOTE: the K types' panels into L2 (T1), not L1 (T0): on a Zen 4 EPYC a T0 burst of a panel's
// ~40-50 lines stalled the kernel: two threads from DRAM, q4_k 20-24 -> 37-41 GB/s, q6_k 13-15
// -> 31-38 (sum() 43-48 in the same rounds); the 1.7B Q4_K_M model 60-64 -> 39-44 ms a token.
// q4_0 / q4_1 (sixteen small blocks ahead) measured the same either way and keep T0, as do
// q5_0 / q5_1, which share their kernel. (The Zen 5 figures above are T0's; not remeasured there.)
template <int kBytes, int kAhead, bool kToL1 = false>
inline void prefetch_ahead(const uint8_t* p) {
#if defined(__SSE__)
  _Pragma("GCC unroll 64") for (int o = 0; o < kBytes; o += 64) {
    const char* line = reinterpret_cast<const char*>(p + kAhead * kBytes + o);
    if constexpr (kToL1) {
      _mm_prefetch(line, _MM_HINT_T0);
    } else {
      _mm_prefetch(line, _MM_HINT_T1);
    }
  }
#else
  (void)p;
#endif
}

template <int... Is, typename Fn>
inline void static_for(std::integer_sequence<int, Is...>, Fn&& fn) {
  (fn(std::integral_constant<int, Is>{}), ...);
}

template <class V, int MR>
struct Tiles {
  using I = typename V::I;
  using F = typename V::F;
  // NOTE: a row's sum is a chain of dependent vpdpbusd (~5 cycles each); with 1-2 rows a
  // block's chain of 8 bound the kernel, not memory (q4_k at 1 row: 22 GB/s a core where
  // sum() reads 41). Rows 1 and 2 split each sum into kSplit independent parts.
  static constexpr int kSplit = MR == 1 ? 4 : MR == 2 ? 2 : 1;

  static I reduce(const I* parts) {
    I s = parts[0];
    PS_UNROLL for (int j = 1; j < kSplit; ++j) s = V::add(s, parts[j]);
    return s;
  }

  static void q8_0(const uint8_t* w, int64_t blocks, const ActTile& t, int lane, F* acc) {
    const int8_t* x = t.q;
    for (int64_t b = 0; b < blocks; ++b, w += 544, x += 32 * MR) {
      const F dw = V::f16(reinterpret_cast<const uint16_t*>(w) + lane);
      I sum[MR][kSplit];
      PS_UNROLL for (int m = 0; m < MR; ++m) {
        sum[m][0] = V::set1(-V::kS8Bias * t.s[b * MR + m]);
        PS_UNROLL for (int j = 1; j < kSplit; ++j) sum[m][j] = V::zero();
      }
      PS_UNROLL for (int i = 0; i < 8; ++i) {
        const I q = V::load(w + 32 + 64 * i + 4 * lane);
        PS_UNROLL for (int m = 0; m < MR; ++m) {
          sum[m][i % kSplit] = V::dot4s(sum[m][i % kSplit], q, x + 4 * (i * MR + m));
        }
      }
      PS_UNROLL for (int m = 0; m < MR; ++m) {
        acc[m] = V::fmadd(V::cvt(reduce(sum[m])), V::mul(dw, V::setf(t.d[b * MR + m])), acc[m]);
      }
    }
  }

  // q4_0 (kMin false: q - 8) and q4_1 (kMin true: d q + m, the mins at byte 32); q5_0 / q5_1
  // (kQh true: the fifth bits before the nibbles; q5_0's offset is 16).
  template <bool kMin, bool kQh>
  static void q_legacy(const uint8_t* w, int64_t blocks, const ActTile& t, int lane, F* acc) {
    constexpr int kQh0 = kMin ? 64 : 32, kQs = kQh0 + (kQh ? 64 : 0), kBytes = kQs + 256;
    constexpr int kOffset = kQh ? 16 : 8;
    const int8_t* x = t.q;
    for (int64_t b = 0; b < blocks; ++b, w += kBytes, x += 32 * MR) {
      prefetch_ahead<kBytes, 16, true>(w);
      const F dw = V::f16(reinterpret_cast<const uint16_t*>(w) + lane);
      I part[MR][kSplit], sum[MR];
      PS_UNROLL for (int m = 0; m < MR; ++m) {
        part[m][0] = kMin ? V::zero() : V::set1(-kOffset * t.s[b * MR + m]);
        PS_UNROLL for (int j = 1; j < kSplit; ++j) part[m][j] = V::zero();
      }
      I h = V::zero();
      if constexpr (kQh) h = V::load(w + kQh0 + 4 * lane);
      static_for(std::make_integer_sequence<int, 4>{}, [&](auto group) {
        constexpr int i = decltype(group)::value;
        const I raw = V::load(w + kQs + 64 * i + 4 * lane);
        I lo = V::lo4(raw), hi = V::hi4(raw);
        if constexpr (kQh) {
          lo = V::or_(lo, V::template bits<i - 4>(h, 0x10));
          hi = V::or_(hi, V::template bits<i>(h, 0x10));
        }
        PS_UNROLL for (int m = 0; m < MR; ++m) {
          I& p = part[m][i % kSplit];
          p = V::dot4x2(p, lo, x + 4 * (i * MR + m), hi, x + 4 * ((4 + i) * MR + m));
        }
      });
      PS_UNROLL for (int m = 0; m < MR; ++m) sum[m] = reduce(part[m]);
      if constexpr (kMin) {
        const F mw = V::f16(reinterpret_cast<const uint16_t*>(w + 32) + lane);
        PS_UNROLL for (int m = 0; m < MR; ++m) {
          const float da = t.d[b * MR + m];
          acc[m] = V::fmadd(V::cvt(sum[m]), V::mul(dw, V::setf(da)), acc[m]);
          acc[m] = V::fmadd(mw, V::setf(da * static_cast<float>(t.s[b * MR + m])), acc[m]);
        }
      } else {
        PS_UNROLL for (int m = 0; m < MR; ++m) {
          acc[m] = V::fmadd(V::cvt(sum[m]), V::mul(dw, V::setf(t.d[b * MR + m])), acc[m]);
        }
      }
    }
  }

  // q4_k (kQh false) and q5_k (kQh true: the fifth bits before the nibbles).
  template <bool kQh>
  static void q45_k(const uint8_t* w, int64_t blocks, const ActTile& t, int lane, F* acc) {
    constexpr int kBytes = kQh ? 2880 : 2368, kQs = kQh ? 832 : 320;
    const int8_t* x = t.q;
    for (int64_t b = 0; b < blocks; ++b, w += kBytes, x += 256 * MR) {
      prefetch_ahead<kBytes, 2>(w);
      I s1[MR];
      PS_UNROLL for (int m = 0; m < MR; ++m) s1[m] = V::zero();
      // chunk c: sub-blocks 2c (low nibbles) and 2c + 1 (high nibbles)
      static_for(std::make_integer_sequence<int, 4>{}, [&](auto chunk) {
        constexpr int c = decltype(chunk)::value;
        constexpr int kParts = (kSplit + 1) / 2;  // lo and hi are two chains already
        I lo_sum[MR][kParts], hi_sum[MR][kParts];
        PS_UNROLL for (int m = 0; m < MR; ++m) {
          PS_UNROLL for (int j = 0; j < kParts; ++j) lo_sum[m][j] = hi_sum[m][j] = V::zero();
        }
        PS_UNROLL for (int i = 0; i < 8; i += 2) {  // groups i and i + 1 share a dot4x2
          I lo[2], hi[2];
          PS_UNROLL for (int j = 0; j < 2; ++j) {
            const I raw = V::load(w + kQs + 512 * c + 64 * (i + j) + 4 * lane);
            lo[j] = V::lo4(raw);
            hi[j] = V::hi4(raw);
            if constexpr (kQh) {
              const I h = V::load(w + 320 + 64 * (i + j) + 4 * lane);
              lo[j] = V::or_(lo[j], V::template bits<2 * c - 4>(h, 0x10));
              hi[j] = V::or_(hi[j], V::template bits<2 * c + 1 - 4>(h, 0x10));
            }
          }
          PS_UNROLL for (int m = 0; m < MR; ++m) {
            const int8_t* xl = x + 4 * ((16 * c + i) * MR + m);
            const int8_t* xh = x + 4 * ((16 * c + 8 + i) * MR + m);
            I& l = lo_sum[m][(i / 2) % kParts];
            l = V::dot4x2(l, lo[0], xl, lo[1], xl + 4 * MR);
            I& h = hi_sum[m][(i / 2) % kParts];
            h = V::dot4x2(h, hi[0], xh, hi[1], xh + 4 * MR);
          }
        }
        const I sc_lo = V::u8(w + 64 + 16 * (2 * c) + lane), sc_hi = V::u8(w + 64 + 16 * (2 * c + 1) + lane);
        PS_UNROLL for (int m = 0; m < MR; ++m) {
          I l = lo_sum[m][0], h = hi_sum[m][0];
          PS_UNROLL for (int j = 1; j < kParts; ++j) {
            l = V::add(l, lo_sum[m][j]);
            h = V::add(h, hi_sum[m][j]);
          }
          s1[m] = V::add(s1[m], V::add(V::mullo(l, sc_lo), V::mullo(h, sc_hi)));
        }
      });
      const F d = V::f16(reinterpret_cast<const uint16_t*>(w) + lane);
      const F dmin = V::f16(reinterpret_cast<const uint16_t*>(w + 32) + lane);
      PS_UNROLL for (int m = 0; m < MR; ++m) {
        I s2 = V::zero();  // sum over sub-blocks of min x the activations' sum
        PS_UNROLL for (int p = 0; p < 4; ++p) {
          s2 = V::add(s2, V::madd_u8pairs(w + 192 + 32 * p + 2 * lane, t.s32[(4 * b + p) * MR + m]));
        }
        const F da = V::setf(t.d[b * MR + m]);
        acc[m] = V::fmadd(V::cvt(s1[m]), V::mul(d, da), acc[m]);
        acc[m] = V::fnmadd(V::cvt(s2), V::mul(dmin, da), acc[m]);
      }
    }
  }

  static void q6_k(const uint8_t* w, int64_t blocks, const ActTile& t, int lane, F* acc) {
    const int8_t* x = t.q;
    for (int64_t b = 0; b < blocks; ++b, w += 3360, x += 256 * MR) {
      prefetch_ahead<3360, 2>(w);
      I s1[MR];
      PS_UNROLL for (int m = 0; m < MR; ++m) s1[m] = V::zero();
      // group g: 32 k, sub-blocks 2g and 2g + 1 of 16
      static_for(std::make_integer_sequence<int, 8>{}, [&](auto group) {
        constexpr int g = decltype(group)::value;
        constexpr int kParts = (kSplit + 1) / 2;  // the two sub-blocks are two chains already
        I part[MR][2][kParts], lo_sum[MR], hi_sum[MR];
        PS_UNROLL for (int m = 0; m < MR; ++m) {
          part[m][0][0] = V::set1(t.s[(16 * b + 2 * g) * MR + m]);
          part[m][1][0] = V::set1(t.s[(16 * b + 2 * g + 1) * MR + m]);
          PS_UNROLL for (int j = 1; j < kParts; ++j) part[m][0][j] = part[m][1][j] = V::zero();
        }
        PS_UNROLL for (int i = 0; i < 8; i += 2) {  // groups i and i + 1 (one sub-block) share a dot4x2
          I q[2];
          PS_UNROLL for (int j = 0; j < 2; ++j) {
            const I raw = V::load(w + 288 + 512 * (g / 2) + 64 * (i + j) + 4 * lane);
            const I h = V::load(w + 2336 + 512 * (g / 4) + 64 * (i + j) + 4 * lane);
            q[j] = V::or_(g % 2 ? V::hi4(raw) : V::lo4(raw), V::template bits<2 * (g % 4) - 4>(h, 0x30));
          }
          PS_UNROLL for (int m = 0; m < MR; ++m) {
            const int8_t* xi = x + 4 * ((8 * g + i) * MR + m);
            I& sum = part[m][i / 4][(i / 2) % kParts];
            sum = V::dot4x2(sum, q[0], xi, q[1], xi + 4 * MR);
          }
        }
        PS_UNROLL for (int m = 0; m < MR; ++m) {
          lo_sum[m] = part[m][0][0];
          hi_sum[m] = part[m][1][0];
          PS_UNROLL for (int j = 1; j < kParts; ++j) {
            lo_sum[m] = V::add(lo_sum[m], part[m][0][j]);
            hi_sum[m] = V::add(hi_sum[m], part[m][1][j]);
          }
        }
        const auto* sc = reinterpret_cast<const int8_t*>(w + 32);
        const I sc_lo = V::s8(sc + 16 * (2 * g) + lane), sc_hi = V::s8(sc + 16 * (2 * g + 1) + lane);
        PS_UNROLL for (int m = 0; m < MR; ++m) {
          s1[m] = V::add(s1[m], V::add(V::mullo(lo_sum[m], sc_lo), V::mullo(hi_sum[m], sc_hi)));
        }
      });
      const F d = V::f16(reinterpret_cast<const uint16_t*>(w) + lane);
      PS_UNROLL for (int m = 0; m < MR; ++m) {
        acc[m] = V::fmadd(V::cvt(s1[m]), V::mul(d, V::setf(t.d[b * MR + m])), acc[m]);
      }
    }
  }

  // y[m][0:n] (+ bias[0:n]) = the tile's rows times lanes [lane, lane + n) of a panel of `type`;
  // w: the panel's first block, `blocks` of them.
  static void run(Type type, const uint8_t* w, int64_t blocks, const ActTile& t, int lane, float* y, int64_t ldy,
                  int n, const float* bias) {
    F acc[MR];
    PS_UNROLL for (int m = 0; m < MR; ++m) acc[m] = V::zerof();
    switch (type) {
      case kQ8_0: q8_0(w, blocks, t, lane, acc); break;
      case kQ4_0: q_legacy<false, false>(w, blocks, t, lane, acc); break;
      case kQ4_1: q_legacy<true, false>(w, blocks, t, lane, acc); break;
      case kQ5_0: q_legacy<false, true>(w, blocks, t, lane, acc); break;
      case kQ5_1: q_legacy<true, true>(w, blocks, t, lane, acc); break;
      case kQ4_K: q45_k<false>(w, blocks, t, lane, acc); break;
      case kQ5_K: q45_k<true>(w, blocks, t, lane, acc); break;
      case kQ6_K: q6_k(w, blocks, t, lane, acc); break;
    }
    const F b = bias != nullptr ? V::loadf(bias, n) : V::zerof();
    PS_UNROLL for (int m = 0; m < MR; ++m) V::store(y + m * ldy, V::addf(acc[m], b), n);
  }
};

#undef PS_UNROLL

// Tiles<Vec, R>::run for a tile of R rows (quant_tile_rows.h), compiled in the
// quant_tiles_rows_*.cpp files, not in the files that call it.
// NOTE: one translation unit per pair of row counts (1 and 5, 2 and 6, 3 and 7, 4 and 8), so
// that the compiler runs on them in parallel: all in quant_matmul.cpp, the portable build's
// loops made that one file 96 s of a 111 s build on two cores (the other files were done at
// 33 s). Within one of these files, R = 4 takes about 4x as long as R = 1.
template <int R>
void run_rows(Type type, const uint8_t* w, int64_t blocks, const ActTile& t, int lane, float* y, int64_t ldy, int n,
              const float* bias);

// Tiles<Vec, rows>::run for a tile of 1..Vec::kMaxRows rows.
inline void run_tile(int rows, Type type, const uint8_t* w, int64_t blocks, const ActTile& t, int lane, float* y,
                     int64_t ldy, int n, const float* bias) {
  static_assert(Vec::kMaxRows <= 8, "run_tile instantiates up to 8 rows");
  switch (rows) {
#define PS_ROWS(r) \
  case r:          \
    if constexpr (r <= Vec::kMaxRows) run_rows<r>(type, w, blocks, t, lane, y, ldy, n, bias); \
    break;
    PS_ROWS(1) PS_ROWS(2) PS_ROWS(3) PS_ROWS(4) PS_ROWS(5) PS_ROWS(6) PS_ROWS(7) PS_ROWS(8)
#undef PS_ROWS
    default: break;
  }
}

}  // namespace paged_serve::cpu::quant
