// quant_pack: GGUF blocks as stored (ggml's byte layout, one weight row = K / block
// consecutive blocks) repacked into quant_format.h's panels; and back to floats:
// quant_dequantize (every row) and quant_embedding (rows by id), the same floats as
// gguf.quants.dequantize.
//
// ggml's blocks (bytes; fp16 d / dmin / m):
//   q8_0 (34): d, qs[32] int8
//   q4_0 (18): d, qs[16]: element j low nibble of qs[j], element 16 + j high (q - 8)
//   q4_1 (20): d, m, qs[16] as q4_0 (d q + m)
//   q5_0 (22): d, qh (uint32: bit j the fifth bit of element j), qs[16] as q4_0 (q - 16)
//   q5_1 (24): d, m, qh, qs[16] as q5_0 (d q + m)
//   q4_k (144): d, dmin, scales[12] (8 6-bit scales and mins), qs[128]: elements 64c + l and
//       64c + 32 + l the low and high nibbles of qs[32c + l]
//   q5_k (176): d, dmin, scales[12], qh[32] (bit s of qh[l]: fifth bit of element 32s + l), qs[128]
//   q6_k (210): ql[128], qh[64], scales[16] int8 (per 16), d; element 128h + 32t + l: low
//       nibble from ql[64h + l + 32 (t & 1)] (t < 2 low, else high), bits 2t of qh[32h + l]

#include "cpu_ops.h"
#include "quant_format.h"
#include "quant_matmul.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace paged_serve::cpu {
namespace {

using namespace quant;  // NOLINT: this file is the format's own

// ggml's get_scale_min_k4: sub-block j's 6-bit scale and min from the 12 packed bytes.
void scale_min_k4(int j, const uint8_t* q, uint8_t* sc, uint8_t* m) {
  if (j < 4) {
    *sc = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// One block panel: lanes r < n from the ggml blocks at src[r]; the other lanes stay as they are (zero).
void pack_block(Type type, const uint8_t* const* src, int n, uint8_t* dst) {
  for (int r = 0; r < n; ++r) {
    const uint8_t* s = src[r];
    auto group4 = [&](int64_t to, const uint8_t* from) { std::memcpy(dst + to + 4 * r, from, 4); };
    switch (type) {
      case kQ8_0:
        std::memcpy(dst + 2 * r, s, 2);
        for (int i = 0; i < 8; ++i) group4(32 + 64 * i, s + 2 + 4 * i);
        break;
      case kQ4_0:
        std::memcpy(dst + 2 * r, s, 2);
        for (int i = 0; i < 4; ++i) group4(32 + 64 * i, s + 2 + 4 * i);
        break;
      case kQ4_1:
        std::memcpy(dst + 2 * r, s, 2);
        std::memcpy(dst + 32 + 2 * r, s + 2, 2);
        for (int i = 0; i < 4; ++i) group4(64 + 64 * i, s + 4 + 4 * i);
        break;
      case kQ5_0:
      case kQ5_1: {
        const bool q51 = type == kQ5_1;
        std::memcpy(dst + 2 * r, s, 2);
        if (q51) std::memcpy(dst + 32 + 2 * r, s + 2, 2);
        const uint8_t* qh = s + (q51 ? 4 : 2);
        const uint32_t bits = qh[0] | qh[1] << 8 | qh[2] << 16 | static_cast<uint32_t>(qh[3]) << 24;
        for (int b = 0; b < 4; ++b) {
          uint8_t v = 0;
          for (int j = 0; j < 8; ++j) {
            v = static_cast<uint8_t>(v | ((bits >> (4 * (j % 4) + b + 16 * (j / 4))) & 1) << j);
          }
          dst[(q51 ? 64 : 32) + 4 * r + b] = v;
        }
        for (int i = 0; i < 4; ++i) group4((q51 ? 128 : 96) + 64 * i, qh + 4 + 4 * i);
        break;
      }
      case kQ4_K:
      case kQ5_K: {
        std::memcpy(dst + 2 * r, s, 2);
        std::memcpy(dst + 32 + 2 * r, s + 2, 2);
        for (int j = 0; j < 8; ++j) {
          scale_min_k4(j, s + 4, dst + 64 + 16 * j + r, dst + 192 + 32 * (j / 2) + 2 * r + j % 2);
        }
        const bool q5 = type == kQ5_K;
        if (q5) {
          for (int i = 0; i < 8; ++i) group4(320 + 64 * i, s + 16 + 4 * i);
        }
        const uint8_t* qs = s + (q5 ? 48 : 16);
        for (int c = 0; c < 4; ++c) {
          for (int i = 0; i < 8; ++i) group4((q5 ? 832 : 320) + 512 * c + 64 * i, qs + 32 * c + 4 * i);
        }
        break;
      }
      case kQ6_K: {
        std::memcpy(dst + 2 * r, s + 208, 2);
        for (int j = 0; j < 16; ++j) dst[32 + 16 * j + r] = s[192 + j];
        uint8_t q[256];
        for (int h = 0; h < 2; ++h) {
          const uint8_t* ql = s + 64 * h;
          const uint8_t* qh = s + 128 + 32 * h;
          for (int l = 0; l < 32; ++l) {
            q[128 * h + l] = (ql[l] & 0xF) | ((qh[l] >> 0) & 3) << 4;
            q[128 * h + 32 + l] = (ql[l + 32] & 0xF) | ((qh[l] >> 2) & 3) << 4;
            q[128 * h + 64 + l] = (ql[l] >> 4) | ((qh[l] >> 4) & 3) << 4;
            q[128 * h + 96 + l] = (ql[l + 32] >> 4) | ((qh[l] >> 6) & 3) << 4;
          }
        }
        for (int c = 0; c < 4; ++c) {
          for (int i = 0; i < 8; ++i) {
            for (int b = 0; b < 4; ++b) {
              const int e = 64 * c + 4 * i + b;
              dst[288 + 512 * c + 64 * i + 4 * r + b] = (q[e] & 0xF) | (q[e + 32] & 0xF) << 4;
            }
          }
        }
        for (int h = 0; h < 2; ++h) {
          for (int i = 0; i < 8; ++i) {
            for (int b = 0; b < 4; ++b) {
              uint8_t v = 0;
              for (int t = 0; t < 4; ++t) v |= (q[128 * h + 32 * t + 4 * i + b] >> 4) << (2 * t);
              dst[2336 + 512 * h + 64 * i + 4 * r + b] = v;
            }
          }
        }
        break;
      }
    }
  }
}

inline float half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return c10::detail::fp16_ieee_to_fp32_value(h);
}

// Lane r of a block panel as floats (the block's elements in order), gguf.quants.dequantize's.
void dequant_block(Type type, const uint8_t* w, int r, float* out) {
  auto byte = [&](int64_t group_base, int e) { return w[group_base + 64 * (e / 4) + 4 * r + e % 4]; };
  switch (type) {
    case kQ8_0: {
      const float d = half(w + 2 * r);
      for (int e = 0; e < 32; ++e) out[e] = static_cast<float>(static_cast<int8_t>(byte(32, e))) * d;
      break;
    }
    case kQ4_0:
    case kQ4_1: {
      const bool q41 = type == kQ4_1;
      const float d = half(w + 2 * r), m = q41 ? half(w + 32 + 2 * r) : 0.f;
      for (int e = 0; e < 32; ++e) {
        const int b = byte(q41 ? 64 : 32, e % 16);
        const int q = e < 16 ? b & 0xF : b >> 4;
        out[e] = q41 ? rounded(d * static_cast<float>(q)) + m : d * static_cast<float>(q - 8);
      }
      break;
    }
    case kQ5_0:
    case kQ5_1: {
      const bool q51 = type == kQ5_1;
      const int qh = q51 ? 64 : 32;
      const float d = half(w + 2 * r), m = q51 ? half(w + 32 + 2 * r) : 0.f;
      for (int e = 0; e < 32; ++e) {
        const int b = byte(qh + 64, e % 16), j = e % 16 / 4 + 4 * (e / 16);
        const int q = (e < 16 ? b & 0xF : b >> 4) | ((w[qh + 4 * r + e % 4] >> j) & 1) << 4;
        out[e] = q51 ? rounded(d * static_cast<float>(q)) + m : d * static_cast<float>(q - 16);
      }
      break;
    }
    case kQ4_K:
    case kQ5_K: {
      const bool q5 = type == kQ5_K;
      const float d = half(w + 2 * r), dmin = half(w + 32 + 2 * r);
      for (int s = 0; s < 8; ++s) {
        const float ds = d * static_cast<float>(w[64 + 16 * s + r]);
        const float dm = rounded(dmin * static_cast<float>(w[192 + 32 * (s / 2) + 2 * r + s % 2]));
        for (int l = 0; l < 32; ++l) {
          const int b = byte((q5 ? 832 : 320) + 512 * (s / 2), l);
          int q = s % 2 ? b >> 4 : b & 0xF;
          if (q5) q |= ((byte(320, l) >> s) & 1) << 4;
          out[32 * s + l] = rounded(ds * static_cast<float>(q)) - dm;
        }
      }
      break;
    }
    case kQ6_K: {
      const float d = half(w + 2 * r);
      const auto* sc = reinterpret_cast<const int8_t*>(w + 32);
      for (int e = 0; e < 256; ++e) {
        const int g = e / 32, l = e % 32;
        const int b = byte(288 + 512 * (g / 2), l);
        const int q = ((g % 2 ? b >> 4 : b & 0xF) | ((byte(2336 + 512 * (g / 4), l) >> (2 * (g % 4))) & 3) << 4) - 32;
        out[e] = rounded(d * static_cast<float>(sc[16 * (e / 16) + r])) * static_cast<float>(q);
      }
      break;
    }
  }
}

// Row n of the packed weight as floats (K of them).
void dequant_row(const Packed& p, int64_t n, float* out) {
  for (const Segment& s : p.segments) {
    if (n >= s.row_begin + s.rows) continue;
    const int64_t local = n - s.row_begin, blocks = p.K / s.type->block;
    const uint8_t* panel = p.base + s.offset + local / kLanes * blocks * s.type->panel_bytes;
    for (int64_t b = 0; b < blocks; ++b) {
      dequant_block(s.type->type, panel + b * s.type->panel_bytes, static_cast<int>(local % kLanes),
                    out + b * s.type->block);
    }
    return;
  }
}

}  // namespace

at::Tensor quant_pack(at::TensorList parts, at::IntArrayRef types) {
  constexpr const char* op = "quant_pack";
  PS_CHECK(!parts.empty() && parts.size() == types.size() && static_cast<int64_t>(parts.size()) <= kMaxSegments, op,
           ": needs 1..", kMaxSegments, " parts, one type each, got ", parts.size(), " parts and ", types.size(),
           " types");
  int64_t K = 0;
  std::vector<std::pair<int64_t, int64_t>> segs;
  std::vector<at::Tensor> data;
  for (size_t i = 0; i < parts.size(); ++i) {
    const TypeInfo& t = type_info(types[i], op);
    const at::Tensor& part = parts[i];
    PS_CHECK(part.device().is_cpu() && part.scalar_type() == at::kByte && part.dim() == 2 && part.size(0) >= 1, op,
             ": part ", i, " (", t.name, ") must be a 2-D uint8 CPU tensor [rows, row_bytes] with rows >= 1, got ",
             part.sizes(), " ", part.scalar_type());
    const int64_t row_bytes = part.size(1);
    PS_CHECK(row_bytes > 0 && row_bytes % t.ggml_bytes == 0, op, ": part ", i, " (", t.name, ") has ", row_bytes,
             " bytes per row, not a whole number of ", t.name, "'s ", t.ggml_bytes, "-byte blocks");
    const int64_t k = row_bytes / t.ggml_bytes * t.block;
    PS_CHECK(i == 0 || k == K, op, ": part ", i, " (", t.name, ") holds rows of K = ", k, ", part 0 of K = ", K);
    K = k;
    segs.emplace_back(t.type, part.size(0));
    data.push_back(part.contiguous());
  }
  std::vector<int64_t> offsets;
  const int64_t total = write_header(nullptr, kLayoutPanels, K, segs, &offsets);
  at::Tensor packed = at::empty({total}, at::TensorOptions().dtype(at::kByte));
  uint8_t* base = packed.data_ptr<uint8_t>();
  write_header(base, kLayoutPanels, K, segs, &offsets);
  for (size_t i = 0; i < segs.size(); ++i) {
    const TypeInfo& t = *find_type(segs[i].first);
    const int64_t rows = segs[i].second, blocks = K / t.block, panels = panels_of(rows);
    const int64_t bytes = Packed::segment_bytes(kLayoutPanels, t, rows, K);
    const int64_t end = i + 1 < segs.size() ? offsets[i + 1] : total;
    // The last panel's padding lanes and the gap to the next segment are zeros.
    const int64_t last = (panels - 1) * blocks * t.panel_bytes;
    std::memset(base + offsets[i] + last, 0, end - offsets[i] - last);
    const uint8_t* src = data[i].const_data_ptr<uint8_t>();
    const int64_t row_bytes = data[i].size(1);
    at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t stop) {
      const uint8_t* rows_src[kLanes];
      for (int64_t p = begin; p < stop; ++p) {
        const int n = static_cast<int>(std::min<int64_t>(kLanes, rows - p * kLanes));
        uint8_t* dst = base + offsets[i] + p * blocks * t.panel_bytes;
        for (int64_t b = 0; b < blocks; ++b) {
          for (int r = 0; r < n; ++r) rows_src[r] = src + (p * kLanes + r) * row_bytes + b * t.ggml_bytes;
          pack_block(t.type, rows_src, n, dst + b * t.panel_bytes);
        }
      }
    });
  }
  return packed;
}

at::Tensor quant_dequantize(const at::Tensor& packed) {
  const Packed p = parse_packed(packed, "quant_dequantize");
  at::Tensor out = at::empty({p.N, p.K}, at::TensorOptions().dtype(at::kFloat));
  float* y = out.data_ptr<float>();
  at::parallel_for(0, p.N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) dequant_row(p, n, y + n * p.K);
  });
  return out;
}

at::Tensor quant_embedding(const at::Tensor& packed, const at::Tensor& ids) {
  constexpr const char* op = "quant_embedding";
  const Packed p = parse_packed(packed, op);
  PS_CHECK(ids.device().is_cpu() && ids.scalar_type() == at::kLong && ids.dim() == 1, op,
           ": ids must be a 1-D int64 CPU tensor, got ", ids.sizes(), " ", ids.scalar_type());
  const at::Tensor idx = ids.contiguous();
  const int64_t* id = idx.const_data_ptr<int64_t>();
  const int64_t n = idx.numel();
  for (int64_t i = 0; i < n; ++i) {
    PS_CHECK(id[i] >= 0 && id[i] < p.N, op, ": id ", id[i], " (at ", i, ") outside the weight's ", p.N, " rows");
  }
  at::Tensor out = at::empty({n, p.K}, at::TensorOptions().dtype(at::kFloat));
  float* y = out.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) dequant_row(p, id[i], y + i * p.K);
  });
  return out;
}

}  // namespace paged_serve::cpu
