// quant_quantize: float weights [N, K] to GGUF blocks in ggml's byte layout ([N, row bytes]
// uint8, what a GGUF file stores), for fp checkpoints served with --quantization; ops.py's
// quantize_weight then packs them with quant_pack.
//
// q8_0, q4_0, q4_1, q5_0 and q5_1 are ggml's reference quantizers (quantize_row_*_ref), byte for
// byte gguf.quants.quantize's. gguf-py has no K-type quantizer, and ggml's searches over ~20
// candidate scales per sub-block (make_qkx2_quants, make_qx_quants); the K types here take a
// min/max start and two least-squares refits of scale and min for the quants it picks (q6_k:
// the largest |x| at -32, as q4_0), then quantize the sub-block scales to 6 bits (int8 for q6_k)
// as ggml does. RMS error on N(0, 1) weights, as a share of their RMS: q4_k 0.074, q5_k 0.037,
// q6_k 0.019 (q4_0 0.086, q4_1 0.078, q5_0 0.043, q5_1 0.038, q8_0 0.0053 with ggml's own).

#include "cpu_ops.h"
#include "quant_format.h"
#include "quant_matmul.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace paged_serve::cpu {
namespace {

using namespace quant;  // NOLINT

inline void put_half(uint8_t* dst, float v) {
  const uint16_t h = c10::detail::fp16_ieee_from_fp32_value(v);
  std::memcpy(dst, &h, 2);
}
inline float half_round(float v) {
  return c10::detail::fp16_ieee_to_fp32_value(c10::detail::fp16_ieee_from_fp32_value(v));
}
inline int nearest(float v) { return static_cast<int>(std::nearbyint(v)); }

void q8_0(const float* x, uint8_t* dst) {
  float amax = 0.f;
  for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[j]));
  const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
  put_half(dst, d);
  for (int j = 0; j < 32; ++j) dst[2 + j] = static_cast<uint8_t>(static_cast<int8_t>(std::round(x[j] * id)));
}

// The value of largest magnitude in x[0..31] (the first of equals): the symmetric types' scale source.
float signed_amax(const float* x) {
  float amax = 0.f, max = 0.f;
  for (int j = 0; j < 32; ++j) {
    if (std::fabs(x[j]) > amax) {
      amax = std::fabs(x[j]);
      max = x[j];
    }
  }
  return max;
}

// The least and greatest of x[0..31]: the asymmetric types' range.
void min_max(const float* x, float* min, float* max) {
  *min = *max = x[0];
  for (int j = 1; j < 32; ++j) {
    *min = std::min(*min, x[j]);
    *max = std::max(*max, x[j]);
  }
}

// The fifth bits of q[0..31] as ggml's qh: bit j of the little-endian uint32 is q[j]'s.
void put_qh(const int* q, uint8_t* dst) {
  for (int b = 0; b < 4; ++b) {
    uint8_t v = 0;
    for (int j = 0; j < 8; ++j) v = static_cast<uint8_t>(v | ((q[8 * b + j] >> 4) & 1) << j);
    dst[b] = v;
  }
}

// q[0..31] after the block's scales (and q5's fifth bits): element j's low 4 bits in byte j's
// low nibble, element 16 + j's in its high nibble.
template <int kBits>
void put_quants(const int* q, uint8_t* dst) {
  if constexpr (kBits == 5) {
    put_qh(q, dst);
    dst += 4;
  }
  for (int j = 0; j < 16; ++j) dst[j] = static_cast<uint8_t>((q[j] & 0xF) | (q[16 + j] & 0xF) << 4);
}

// q4_0 / q5_0: d (q - 2^(bits-1)), d from the value of largest magnitude.
template <int kBits>
void q_0(const float* x, uint8_t* dst) {
  constexpr int kOffset = 1 << (kBits - 1), kMax = (1 << kBits) - 1;
  const float d = signed_amax(x) / -static_cast<float>(kOffset), id = d != 0.f ? 1.f / d : 0.f;
  put_half(dst, d);
  int q[32];
  for (int j = 0; j < 32; ++j) q[j] = std::min(kMax, static_cast<int>(rounded(x[j] * id) + (kOffset + 0.5f)));
  put_quants<kBits>(q, dst + 2);
}

// q4_1 / q5_1: d q + m over the block's range.
template <int kBits>
void q_1(const float* x, uint8_t* dst) {
  constexpr int kMax = (1 << kBits) - 1;
  float min, max;
  min_max(x, &min, &max);
  const float d = (max - min) / static_cast<float>(kMax), id = d != 0.f ? 1.f / d : 0.f;
  put_half(dst, d);
  put_half(dst + 2, min);
  int q[32];
  for (int j = 0; j < 32; ++j) q[j] = std::min(kMax, static_cast<int>(rounded((x[j] - min) * id) + 0.5f));
  put_quants<kBits>(q, dst + 4);
}

// x ~ scale q - min over n values, q in [0, nmax], min >= 0 (ggml's K-type convention: the
// sub-block's minimum is at most 0). Returns scale; writes min.
float fit_scale_min(const float* x, int n, int nmax, float* min_out) {
  float lo = 0.f, hi = x[0];
  for (int j = 0; j < n; ++j) {
    lo = std::min(lo, x[j]);
    hi = std::max(hi, x[j]);
  }
  float scale = (hi - lo) / nmax, min = -lo;
  for (int iter = 0; iter < 2 && scale > 0.f; ++iter) {
    // least squares of x = scale q + offset for the quants the current fit picks
    const float inv = 1.f / scale;
    float sq = 0, sqq = 0, sx = 0, sqx = 0;
    for (int j = 0; j < n; ++j) {
      const float q = static_cast<float>(std::clamp(nearest((x[j] + min) * inv), 0, nmax));
      sq += q;
      sqq += q * q;
      sx += x[j];
      sqx += q * x[j];
    }
    const float det = n * sqq - sq * sq;
    if (!(det > 0)) break;
    float s = (n * sqx - sq * sx) / det, off = (sx - s * sq) / n;
    if (off > 0) {  // the minimum must stay <= 0: fit the scale alone
      off = 0;
      s = sqx / sqq;
    }
    if (!(s > 0)) break;
    scale = s;
    min = -off;
  }
  *min_out = min;
  return scale;
}

// ggml's 6-bit scales and mins of 8 sub-blocks into its 12 bytes (get_scale_min_k4's inverse).
void put_scales_k4(const uint8_t* sc, const uint8_t* m, uint8_t* q) {
  for (int j = 0; j < 4; ++j) {
    q[j] = sc[j] | (sc[j + 4] >> 4) << 6;
    q[j + 4] = m[j] | (m[j + 4] >> 4) << 6;
    q[j + 8] = (sc[j + 4] & 0xF) | (m[j + 4] & 0xF) << 4;
  }
}

// q4_k (nmax 15) and q5_k (nmax 31).
void q45_k(const float* x, uint8_t* dst, int nmax) {
  float scales[8], mins[8], max_scale = 0.f, max_min = 0.f;
  for (int s = 0; s < 8; ++s) {
    scales[s] = fit_scale_min(x + 32 * s, 32, nmax, mins + s);
    max_scale = std::max(max_scale, scales[s]);
    max_min = std::max(max_min, mins[s]);
  }
  const float d = half_round(max_scale / 63.f), dmin = half_round(max_min / 63.f);
  uint8_t sc[8], m[8];
  for (int s = 0; s < 8; ++s) {
    sc[s] = static_cast<uint8_t>(d > 0 ? std::clamp(nearest(scales[s] / d), 0, 63) : 0);
    m[s] = static_cast<uint8_t>(dmin > 0 ? std::clamp(nearest(mins[s] / dmin), 0, 63) : 0);
  }
  put_half(dst, d);
  put_half(dst + 2, dmin);
  put_scales_k4(sc, m, dst + 4);
  const bool q5 = nmax == 31;
  uint8_t* qh = dst + 16;
  uint8_t* qs = dst + (q5 ? 48 : 16);
  if (q5) std::memset(qh, 0, 32);
  uint8_t q[256];
  for (int s = 0; s < 8; ++s) {
    const float ds = d * sc[s], dm = dmin * m[s], inv = ds > 0 ? 1.f / ds : 0.f;
    for (int l = 0; l < 32; ++l) {
      q[32 * s + l] = static_cast<uint8_t>(std::clamp(nearest((x[32 * s + l] + dm) * inv), 0, nmax));
    }
  }
  for (int c = 0; c < 4; ++c) {
    for (int l = 0; l < 32; ++l) {
      const uint8_t a = q[64 * c + l], b = q[64 * c + 32 + l];
      qs[32 * c + l] = (a & 0xF) | (b & 0xF) << 4;
      if (q5) qh[l] |= ((a >> 4) << (2 * c)) | ((b >> 4) << (2 * c + 1));
    }
  }
}

void q6_k(const float* x, uint8_t* dst) {
  float scales[16], max_abs = 0.f, max_scale = 0.f;
  for (int s = 0; s < 16; ++s) {
    float amax = 0.f, v = 0.f;
    for (int l = 0; l < 16; ++l) {
      if (std::fabs(x[16 * s + l]) > amax) {
        amax = std::fabs(x[16 * s + l]);
        v = x[16 * s + l];
      }
    }
    scales[s] = v / -32.f;  // the largest |x| at -32, the end with one more step (as q4_0)
    if (std::fabs(scales[s]) > max_abs) {
      max_abs = std::fabs(scales[s]);
      max_scale = scales[s];
    }
  }
  const float d = half_round(max_scale / -128.f);
  int8_t sc[16];
  for (int s = 0; s < 16; ++s) sc[s] = static_cast<int8_t>(d != 0 ? std::clamp(nearest(scales[s] / d), -128, 127) : 0);
  uint8_t q[256];
  for (int s = 0; s < 16; ++s) {
    const float ds = d * sc[s];
    for (int l = 0; l < 16; ++l) {
      q[16 * s + l] = static_cast<uint8_t>(ds != 0 ? std::clamp(nearest(x[16 * s + l] / ds), -32, 31) + 32 : 32);
    }
  }
  for (int h = 0; h < 2; ++h) {
    uint8_t* ql = dst + 64 * h;
    uint8_t* qh = dst + 128 + 32 * h;
    for (int l = 0; l < 32; ++l) {
      const uint8_t* e = q + 128 * h + l;
      ql[l] = (e[0] & 0xF) | (e[64] & 0xF) << 4;
      ql[l + 32] = (e[32] & 0xF) | (e[96] & 0xF) << 4;
      qh[l] = (e[0] >> 4) | (e[32] >> 4) << 2 | (e[64] >> 4) << 4 | (e[96] >> 4) << 6;
    }
  }
  std::memcpy(dst + 192, sc, 16);
  put_half(dst + 208, d);
}

}  // namespace

at::Tensor quant_quantize(const at::Tensor& weight, int64_t type) {
  constexpr const char* op = "quant_quantize";
  const TypeInfo& t = type_info(type, op);
  PS_CHECK(weight.device().is_cpu() && weight.dim() == 2 && at::isFloatingType(weight.scalar_type()), op,
           ": weight must be a 2-D floating CPU tensor [out, in], got ", weight.sizes(), " ", weight.scalar_type());
  const int64_t N = weight.size(0), K = weight.size(1);
  PS_CHECK(K % t.block == 0, op, ": in_features ", K, " is not a multiple of ", t.name, "'s block of ", t.block);
  const at::Tensor w = weight.to(at::kFloat).contiguous();
  const int64_t blocks = K / t.block;
  at::Tensor out = at::empty({N, blocks * t.ggml_bytes}, at::TensorOptions().dtype(at::kByte));
  const float* src = w.const_data_ptr<float>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, N * blocks, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* x = src + i * t.block;
      uint8_t* y = dst + i * t.ggml_bytes;
      switch (t.type) {
        case kQ8_0: q8_0(x, y); break;
        case kQ4_0: q_0<4>(x, y); break;
        case kQ4_1: q_1<4>(x, y); break;
        case kQ5_0: q_0<5>(x, y); break;
        case kQ5_1: q_1<5>(x, y); break;
        case kQ4_K: q45_k(x, y, 15); break;
        case kQ5_K: q45_k(x, y, 31); break;
        case kQ6_K: q6_k(x, y); break;
      }
    }
  });
  return out;
}

}  // namespace paged_serve::cpu
