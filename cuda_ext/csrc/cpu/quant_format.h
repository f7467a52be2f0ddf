// The packed form of a GGUF-quantized weight W [N, K] (out x in) that quant_matmul.cpp
// multiplies: one self-describing uint8 tensor, a header then the weight's row segments, each
// repacked from ggml's blocks into panels of kLanes = 16 output rows.
//
// Header (little-endian int64 words; the data starts at header_bytes, a multiple of 64):
//   0 magic "PSQUANT1", 1 version (1), 2 layout (0: the panels below; 1: ggml's rows as stored,
//   the pure-torch reference's), 3 N, 4 K, 5 segments, 6 header_bytes, 7 total bytes,
//   then per segment: ggml type id, rows, byte offset of its data, its data bytes.
// Segments cover W's rows in order (rows of a merged q/k/v or gate/up product may mix types).
//
// Panels: a segment's rows in groups of 16 (the last zero-padded: a zero scale makes its rows
// 0), each panel its K / block blocks in order; per block (a "block panel") every field is
// stored for the 16 rows together, lane r = row r of the panel:
//   fp16 scales: [16] halves (32 bytes);
//   quants: groups of 64 bytes, 4 bytes per lane: lane r holds 4 consecutive k of row r, so a
//   group is one 512-bit register of 16 int32 lanes and one dot product instruction (vpdpbusd)
//   multiplies 4 k of all 16 rows by 4 activations broadcast; 4-bit quants hold two such
//   groups (the low and high nibbles).
// Per type (bytes per block panel; element e of a block; ggml's own bytes are listed in
// quant_pack.cpp, which converts them):
//   q8_0 (32 k, 544): d[16] | 8 groups: group i = k 4i..4i+3 (int8)
//   q4_0 (32 k, 288): d[16] | 4 groups: low nibbles k 4i.., high nibbles k 16+4i.. (q - 8)
//   q4_1 (32 k, 320): d[16] | m[16] | 4 groups as q4_0 (d q + m)
//   q5_0 (32 k, 352): d[16] | qh[16][4]: bit j of lane r's byte b is the fifth bit of
//       e = 4 (j % 4) + b + 16 (j / 4), i.e. of group j's low nibbles (j < 4), of group
//       j - 4's high ones (j >= 4) | 4 groups as q4_0 (q - 16)
//   q5_1 (32 k, 384): d[16] | m[16] | qh as q5_0's | 4 groups as q4_0 (d q + m)
//   q4_k (256 k, 2368): d[16] | dmin[16] | sc[8][16] u8 | mn[4][16][2] u8 (the mins of
//       sub-blocks 2p, 2p+1 side by side, for vpmaddwd) | 4 chunks x 8 groups: chunk c group
//       i: low nibbles e = 64c + 4i.., high e = 64c + 32 + 4i.. (d sc q - dmin m, per 32)
//   q5_k (256 k, 2880): as q4_k, with qh[8 groups] before the quants: bit s of lane r's byte
//       b in group i is the fifth bit of e = 32s + 4i + b
//   q6_k (256 k, 3360): d[16] | sc[16][16] int8 (per 16) | ql: 4 chunks x 8 groups as q4_k's
//       nibbles | qh: 2 chunks x 8 groups: bits 2t, 2t+1 of chunk h are the top two bits of
//       e = 128h + 32t + 4i + b (d sc (q - 32))
#pragma once

#include "../check_message.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace paged_serve::cpu::quant {

constexpr int kLanes = 16;  // output rows per panel
constexpr int64_t kMagic = 0x31544E4155515350LL;  // "PSQUANT1"
constexpr int64_t kVersion = 1;
constexpr int64_t kLayoutPanels = 0;
constexpr int64_t kLayoutRows = 1;
constexpr int64_t kHeaderWords = 8;
constexpr int64_t kSegmentWords = 4;
constexpr int64_t kMaxSegments = 64;
constexpr int64_t kAlign = 64;

// ggml's type ids (GGMLQuantizationType).
enum Type : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14 };

struct TypeInfo {
  Type type;
  const char* name;
  int block;               // elements per block
  int ggml_bytes;          // bytes per block in ggml's layout (per row)
  int panel_bytes;         // bytes per block panel (16 rows) in the packed layout
  bool k_type;             // activations quantized per 256 (q8_K) instead of per 32 (q8_0)
};

inline constexpr TypeInfo kTypes[] = {
    {kQ8_0, "q8_0", 32, 34, 544, false},    {kQ4_0, "q4_0", 32, 18, 288, false},
    {kQ4_1, "q4_1", 32, 20, 320, false},    {kQ5_0, "q5_0", 32, 22, 352, false},
    {kQ5_1, "q5_1", 32, 24, 384, false},    {kQ4_K, "q4_k", 256, 144, 2368, true},
    {kQ5_K, "q5_k", 256, 176, 2880, true},  {kQ6_K, "q6_k", 256, 210, 3360, true},
};

// The served type with ggml id `id`, or null.
inline const TypeInfo* find_type(int64_t id) {
  for (const TypeInfo& t : kTypes) {
    if (t.type == id) return &t;
  }
  return nullptr;
}

inline const TypeInfo& type_info(int64_t id, const char* op) {
  const TypeInfo* t = find_type(id);
  PS_CHECK(t != nullptr, op, ": ggml type id ", id, " is not one of the served types (q8_0 8, q4_0 2, q4_1 3, ",
           "q5_0 6, q5_1 7, q4_k 12, q5_k 13, q6_k 14)");
  return *t;
}

// v, rounded as computed: a product passed through this is not fused with a later sum.
// NOTE: gguf-py rounds each product before the sum (d * q + m, x * id + 8.5); GCC's default
// -ffp-contract=fast would fuse them into one FMA, which rounds once and differs in the last bit.
inline float rounded(float v) {
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
  asm("" : "+x"(v));
#elif defined(__GNUC__) && defined(__aarch64__)
  asm("" : "+w"(v));
#else
  volatile float t = v;
  v = t;
#endif
  return v;
}

inline int64_t align_up(int64_t v, int64_t a) { return (v + a - 1) / a * a; }
inline int64_t panels_of(int64_t rows) { return (rows + kLanes - 1) / kLanes; }

struct Segment {
  const TypeInfo* type;
  int64_t rows;
  int64_t row_begin;   // first output row (column of y)
  int64_t offset;      // bytes from the start of the packed tensor
  int64_t bytes;
};

// A packed weight's header, parsed and checked against the tensor's size.
struct Packed {
  int64_t layout, N, K, header_bytes;
  std::vector<Segment> segments;
  const uint8_t* base;  // the tensor's first byte

  // Bytes of one segment's data in `layout`.
  static int64_t segment_bytes(int64_t layout, const TypeInfo& t, int64_t rows, int64_t K) {
    const int64_t blocks = K / t.block;
    return layout == kLayoutPanels ? panels_of(rows) * blocks * t.panel_bytes : rows * blocks * t.ggml_bytes;
  }
  static int64_t header_size(int64_t segments) {
    return align_up(8 * (kHeaderWords + kSegmentWords * segments), kAlign);
  }
  bool any_k_type() const {
    for (const Segment& s : segments) if (s.type->k_type) return true;
    return false;
  }
  bool any_legacy() const {
    for (const Segment& s : segments) if (!s.type->k_type) return true;
    return false;
  }
};

// Parse `packed` (a CPU uint8 tensor from quant_pack), refusing anything inconsistent with a
// RuntimeError naming `op` and what is wrong: nothing later reads past the tensor's bytes.
inline Packed parse_packed(const at::Tensor& packed, const char* op, int64_t want_layout = kLayoutPanels) {
  PS_CHECK(packed.device().is_cpu() && packed.scalar_type() == at::kByte && packed.dim() == 1 &&
               packed.is_contiguous(),
           op, ": packed must be the contiguous 1-D uint8 CPU tensor quant_pack returns, got ", packed.sizes(), " ",
           packed.scalar_type());
  const int64_t numel = packed.numel();
  PS_CHECK(numel >= 8 * kHeaderWords, op, ": packed has ", numel, " bytes, too few for a header");
  Packed p;
  p.base = packed.const_data_ptr<uint8_t>();
  auto word = [&](int64_t i) {
    int64_t v;
    std::memcpy(&v, p.base + 8 * i, 8);
    return v;
  };
  PS_CHECK(word(0) == kMagic, op, ": packed does not start with quant_pack's magic (not a packed weight)");
  PS_CHECK(word(1) == kVersion, op, ": packed has format version ", word(1), ", this build reads ", kVersion);
  p.layout = word(2);
  PS_CHECK(p.layout == want_layout, op, ": packed holds layout ", p.layout,
           p.layout == kLayoutRows ? " (ggml rows, packed by the pure-torch reference)" : "", ", expected ",
           want_layout, " (packed by the compiled quant_pack)");
  p.N = word(3);
  p.K = word(4);
  const int64_t nseg = word(5);
  p.header_bytes = word(6);
  PS_CHECK(nseg >= 1 && nseg <= kMaxSegments, op, ": packed header has ", nseg, " segments (1..", kMaxSegments,
           ")");
  PS_CHECK(p.header_bytes == Packed::header_size(nseg) && word(7) == numel, op, ": packed header sizes (",
           p.header_bytes, ", ", word(7), " bytes) disagree with the tensor's ", numel, " bytes");
  PS_CHECK(p.N >= 1 && p.K >= 1, op, ": packed header has N ", p.N, ", K ", p.K);
  int64_t row = 0, offset = p.header_bytes;
  for (int64_t s = 0; s < nseg; ++s) {
    const int64_t id = word(kHeaderWords + kSegmentWords * s), rows = word(kHeaderWords + kSegmentWords * s + 1);
    const int64_t off = word(kHeaderWords + kSegmentWords * s + 2), bytes = word(kHeaderWords + kSegmentWords * s + 3);
    const TypeInfo* t = find_type(id);
    PS_CHECK(t != nullptr, op, ": packed segment ", s, " has ggml type id ", id, ", not a served type");
    PS_CHECK(p.K % t->block == 0, op, ": packed K ", p.K, " is not a multiple of ", t->name, "'s block of ",
             t->block);
    PS_CHECK(rows >= 1 && rows <= p.N - row && off == offset &&
                 bytes == Packed::segment_bytes(p.layout, *t, rows, p.K) && bytes <= numel - off,
             op, ": packed segment ", s, " (", t->name, ", ", rows, " rows at byte ", off, ", ", bytes,
             " bytes) does not fit the header's N ", p.N, ", K ", p.K, " and the tensor's ", numel, " bytes");
    p.segments.push_back({t, rows, row, off, bytes});
    row += rows;
    offset = align_up(off + bytes, kAlign);
  }
  PS_CHECK(row == p.N && offset == numel, op, ": packed segments cover ", row, " rows and ", offset,
           " bytes, the header says ", p.N, " rows and ", numel, " bytes");
  return p;
}

// A header for `segments` ({type id, rows} each), with the data offsets; returns the bytes in all.
inline int64_t write_header(uint8_t* dst, int64_t layout, int64_t K,
                            const std::vector<std::pair<int64_t, int64_t>>& segs, std::vector<int64_t>* offsets) {
  int64_t N = 0;
  for (const auto& s : segs) N += s.second;
  const int64_t header = Packed::header_size(static_cast<int64_t>(segs.size()));
  std::vector<int64_t> words(header / 8, 0);
  words[0] = kMagic;
  words[1] = kVersion;
  words[2] = layout;
  words[3] = N;
  words[4] = K;
  words[5] = static_cast<int64_t>(segs.size());
  words[6] = header;
  int64_t offset = header;
  offsets->clear();
  for (size_t s = 0; s < segs.size(); ++s) {
    const TypeInfo* t = find_type(segs[s].first);
    const int64_t bytes = Packed::segment_bytes(layout, *t, segs[s].second, K);
    words[kHeaderWords + kSegmentWords * s] = segs[s].first;
    words[kHeaderWords + kSegmentWords * s + 1] = segs[s].second;
    words[kHeaderWords + kSegmentWords * s + 2] = offset;
    words[kHeaderWords + kSegmentWords * s + 3] = bytes;
    offsets->push_back(offset);
    offset = align_up(offset + bytes, kAlign);
  }
  words[7] = offset;
  if (dst != nullptr) std::memcpy(dst, words.data(), header);
  return offset;
}

}  // namespace paged_serve::cpu::quant
