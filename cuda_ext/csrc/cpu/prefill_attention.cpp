// Causal attention of a step's prompt chunks (fp32 or bf16 tensors, AVX2 + FMA builds), one call
// per layer for all of them, every key and value read through the chunk's block table: the cached
// prefix and the chunk's own tokens, which reshape_and_cache has just written.
//
// Why our own: torch's SDPA took one call per chunk (~45 us of fixed cost each, 30 layers per
// step), plus a gathered copy of the prefix and a mask for the chunks after a sequence's first,
// and ran the small causal products of short prompts at 16-60 GFLOP/s on a 2-core AVX2 EPYC.
//
// Work split: one task per (chunk, KV head, kQt query tokens), in parallel. A task packs the
// keys its last token attends to as K^T panels ([head_size][16], 16 keys each, zero past the
// end) and gathers their values into contiguous rows; then for each query head of the GQA
// group and each 6 query rows: logits = Q K^T with the panel micro-kernel (panel_tile.h) up to
// the rows' last key, a softmax in fp32 per row (keys past the row's own position get 0), and
// out = P V with the same micro-kernel over V's 16-column strips. Results differ from SDPA's
// only in summation order.
//
// A sliding window of W keys (a row at position p sees (p - W, p]): a task packs only the keys
// from its first row's lower bound on, and each row's softmax gives 0 to the keys below its own
// (at most kQt - 1 of them). A soft-cap c: c * tanh(s / c) of the scaled logits s, in the softmax.
//
// bf16: the keys and values are widened to fp32 as they are packed (which reads every row
// anyway), the queries widened and the output narrowed once per call, so the arithmetic is the
// fp32 path's. (SDPA per chunk had cost ~6% of a bf16 run on a 2-core Zen 4 EPYC.)

#include "cpu_ops.h"
#include "dtype_cvt.h"
#include "exp_poly.h"
#include "panel_tile.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace paged_serve::cpu {
namespace {

using panel::kMr;
using panel::kNr;

constexpr int64_t kQt = 24;  // query tokens per task (4 row tiles of 6)

// T: the caches' element type (float or c10::BFloat16); queries and output are fp32 here.
template <typename T>
struct Problem {
  const float* q;
  float* out;
  const T* key_cache;
  const T* value_cache;
  const int32_t* tables;
  const int32_t* spans;  // per chunk: first row, tokens, cached tokens before it
  int64_t q_row, out_row, table_width, kv_heads, group, head_size, block_size;
  float scale;
  int64_t window;  // a query at position p sees the keys at (p - window, p]; 0: all of [0, p]
  float softcap;   // c * tanh(s / c) of the scaled logits s; 0: none
};

#if PAGED_SERVE_LINEAR_PANELS

// Scratch of one thread, reused across its tasks.
struct Scratch {
  std::vector<float> keys_t, values, logits;
};

// softmax(cap(scale * row[from:n])) in place (cap: the soft-cap, if any); row[0:from] and
// row[n:width] = 0.
void softmax_row(float* row, int64_t from, int64_t n, int64_t width, float scale, float softcap) {
  float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
  for (int64_t j = from; j < n; ++j) {
    row[j] *= scale;
    if (softcap > 0.0f) row[j] = soft_cap(row[j], softcap);
    m = std::max(m, row[j]);
  }
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = from; j < n; ++j) {
    row[j] = exp_clamped(row[j] - m);
    sum += row[j];
  }
  const float inv = 1.0f / sum;
#pragma omp simd
  for (int64_t j = from; j < n; ++j) row[j] *= inv;
  std::fill(row, row + from, 0.0f);
  std::fill(row + n, row + width, 0.0f);
}

template <typename T>
void run_task(const Problem<T>& p, int64_t chunk, int64_t kv_head, int64_t t0, Scratch& s) {
  const int32_t* span = p.spans + 3 * chunk;
  const int64_t first = span[0], cached = span[2], t1 = std::min<int64_t>(span[1], t0 + kQt);
  const int32_t* table = p.tables + chunk * p.table_width;
  // The keys the task's rows see: positions [key0, cached + t1), key j of the task being position
  // key0 + j. Under a window, key0 is the lower bound of the task's first row (later rows' are
  // higher: softmax_row zeroes the keys below a row's own).
  const int64_t key0 = p.window > 0 ? std::max<int64_t>(0, cached + t0 - p.window + 1) : 0;
  const int64_t D = p.head_size, keys = cached + t1 - key0, panels = (keys + kNr - 1) / kNr, width = panels * kNr;
  s.keys_t.assign(panels * D * kNr, 0.0f);
  s.values.resize(keys * D);
  s.logits.resize(kMr * width);
  for (int64_t j = 0; j < keys; ++j) {
    const int64_t pos = key0 + j;
    const int64_t at = ((static_cast<int64_t>(table[pos / p.block_size]) * p.kv_heads + kv_head) * p.block_size +
                        pos % p.block_size) * D;
    const auto* k = stored(p.key_cache + at);
    const auto* v = stored(p.value_cache + at);
    float* kt = s.keys_t.data() + (j / kNr) * D * kNr + j % kNr;
    float* vr = s.values.data() + j * D;
    for (int64_t d = 0; d < D; ++d) kt[d * kNr] = to_float<T>(k[d]);
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) vr[d] = to_float<T>(v[d]);
  }
  for (int64_t h = kv_head * p.group; h < (kv_head + 1) * p.group; ++h) {
    for (int64_t r0 = t0; r0 < t1; r0 += kMr) {
      const int rows = static_cast<int>(std::min<int64_t>(kMr, t1 - r0));
      const int64_t last = cached + r0 + rows - key0;  // keys up to the rows' last token
      const float* x = p.q + (first + r0) * p.q_row + h * D;
      for (int64_t b = 0; b < (last + kNr - 1) / kNr; ++b) {
        panel::tile_rows(rows, x, p.q_row, s.keys_t.data() + b * D * kNr, kNr, D, s.logits.data() + b * kNr, width,
                         kNr, nullptr);
      }
      for (int r = 0; r < rows; ++r) {
        const int64_t pos = cached + r0 + r;  // the row's position; it sees keys (pos - window, pos]
        const int64_t from = p.window > 0 ? std::max<int64_t>(0, pos - p.window + 1 - key0) : 0;
        softmax_row(s.logits.data() + r * width, from, pos + 1 - key0, last, p.scale, p.softcap);
      }
      float* y = p.out + (first + r0) * p.out_row + h * D;
      for (int64_t c = 0; c < D; c += kNr) {
        panel::tile_rows(rows, s.logits.data(), width, s.values.data() + c, D, last, y + c, p.out_row, kNr, nullptr);
      }
    }
  }
}

// Every task (chunk, kv head, first token: three entries each of `tasks`), in parallel.
template <typename T>
void run_tasks(const at::Tensor& q, at::Tensor& y, const at::Tensor& key_cache, const at::Tensor& value_cache,
               const int32_t* tables, const int32_t* spans, int64_t width, int64_t kv_heads, int64_t group, int64_t D,
               int64_t block_size, double scale, int64_t window, double softcap,
               const std::vector<int64_t>& tasks) {
  const Problem<T> p{q.const_data_ptr<float>(), y.data_ptr<float>(), key_cache.const_data_ptr<T>(),
                     value_cache.const_data_ptr<T>(), tables, spans, q.stride(0), y.stride(0), width, kv_heads,
                     group, D, block_size, static_cast<float>(scale), window, static_cast<float>(softcap)};
  at::parallel_for(0, static_cast<int64_t>(tasks.size() / 3), 1, [&](int64_t begin, int64_t end) {
    Scratch s;
    for (int64_t t = begin; t < end; ++t) run_task(p, tasks[3 * t], tasks[3 * t + 1], tasks[3 * t + 2], s);
  });
}

#endif  // PAGED_SERVE_LINEAR_PANELS

}  // namespace

bool prefill_attention_available() { return PAGED_SERVE_LINEAR_PANELS == 1; }

void prefill_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                       const at::Tensor& value_cache, const at::Tensor& block_tables, const at::Tensor& spans,
                       double scale, int64_t window, double softcap) {
  constexpr const char* op = "prefill_attention";
  PS_CHECK(prefill_attention_available(), op, ": this build has no AVX2/FMA kernel (built for a CPU without them)");
  PS_CHECK(window >= 0 && softcap >= 0.0 && std::isfinite(softcap), op,
           ": window must be >= 0 and softcap finite and >= 0 (0: none), got ", window, " and ", softcap);
  const at::ScalarType dtype = query.scalar_type();
  PS_CHECK(query.device().is_cpu() && query.dim() == 3 && (dtype == at::kFloat || dtype == at::kBFloat16) &&
               query.stride(2) == 1,
           op, ": query must be a float32 or bfloat16 CPU [tokens, heads, head_size] tensor with a contiguous last "
           "dim, got ", query.sizes(), " ", dtype);
  PS_CHECK(out.device().is_cpu() && out.sizes() == query.sizes() && out.scalar_type() == dtype &&
               out.stride(2) == 1 && out.stride(1) == query.size(2) && query.stride(1) == query.size(2),
           op, ": out must be a CPU tensor of query's dtype and shape, heads contiguous in both, got ", out.sizes(),
           " ", out.scalar_type());
  PS_CHECK(key_cache.device().is_cpu() && key_cache.dim() == 4 && key_cache.is_contiguous() &&
               key_cache.scalar_type() == dtype && value_cache.sizes() == key_cache.sizes() &&
               value_cache.is_contiguous() && value_cache.scalar_type() == dtype,
           op, ": caches must be contiguous CPU [blocks, kv_heads, block_size, head_size] tensors of one shape "
           "and query's dtype, got ", key_cache.sizes(), " ", key_cache.scalar_type(), " and ", value_cache.sizes(),
           " ", value_cache.scalar_type());
  const int64_t tokens = query.size(0), heads = query.size(1), D = query.size(2);
  const int64_t blocks = key_cache.size(0), kv_heads = key_cache.size(1), block_size = key_cache.size(2);
  PS_CHECK(key_cache.size(3) == D && D % kNr == 0 && kv_heads > 0 && heads % kv_heads == 0 && block_size > 0, op,
           ": head_size ", D, " must match the caches' (", key_cache.size(3), ") and be a multiple of ", kNr,
           ", and the ", heads, " query heads a multiple of the ", kv_heads, " KV heads");
  PS_CHECK(spans.device().is_cpu() && spans.dim() == 2 && spans.size(1) == 3 && spans.scalar_type() == at::kInt &&
               spans.is_contiguous() && block_tables.device().is_cpu() && block_tables.dim() == 2 &&
               block_tables.size(0) == spans.size(0) && block_tables.scalar_type() == at::kInt &&
               block_tables.is_contiguous(),
           op, ": spans must be [chunks, 3] int32 (first row, tokens, cached) and block_tables [chunks, width] int32, "
           "both contiguous CPU tensors, got ", spans.sizes(), " and ", block_tables.sizes());
  const int64_t chunks = spans.size(0), width = block_tables.size(1);
  const int32_t* sp = spans.const_data_ptr<int32_t>();
  const int32_t* tables = block_tables.const_data_ptr<int32_t>();
  std::vector<int64_t> tasks;  // chunk, kv head, first token: packed as three entries
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t first = sp[3 * c], n = sp[3 * c + 1], cached = sp[3 * c + 2];
    PS_CHECK(first >= 0 && n >= 0 && cached >= 0 && first + n <= tokens, op, ": chunk ", c, " (first row ", first,
             ", ", n, " tokens, ", cached, " cached) does not fit the ", tokens, " query rows");
    const int64_t used = (cached + n + block_size - 1) / block_size;
    PS_CHECK(used <= width, op, ": chunk ", c, " needs ", used, " blocks, its table has ", width);
    // NOTE: under a window the chunk's first row (position `cached`) sees keys from
    // cached - window + 1 on; the blocks before that one may have been given back (-1)
    const int64_t from = window > 0 ? std::max<int64_t>(0, cached - window + 1) / block_size : 0;
    for (int64_t b = from; b < used; ++b) {
      const int32_t id = tables[c * width + b];
      PS_CHECK(id >= 0 && id < blocks, op, ": chunk ", c, " block ", b, " is ", id, ", outside [0, ", blocks, ")");
    }
    for (int64_t h = 0; h < kv_heads; ++h) {
      for (int64_t t = 0; t < n; t += kQt) tasks.insert(tasks.end(), {c, h, t});
    }
  }
#if PAGED_SERVE_LINEAR_PANELS
  // NOTE: bf16 queries and output go through fp32 copies ([tokens, heads, head_size], small next
  // to the keys and values every task reads); fp32 ones are used in place.
  const bool wide = dtype == at::kFloat;
  const at::Tensor q = wide ? query : query.to(at::kFloat);
  at::Tensor y = wide ? out : at::empty(out.sizes(), out.options().dtype(at::kFloat));
  const auto run = [&](auto element) {
    run_tasks<decltype(element)>(q, y, key_cache, value_cache, tables, sp, width, kv_heads, heads / kv_heads, D,
                                 block_size, scale, window, softcap, tasks);
  };
  if (wide) {
    run(float{});
  } else {
    run(c10::BFloat16{});
  }
  if (!wide) out.copy_(y);
#endif
}

}  // namespace paged_serve::cpu
