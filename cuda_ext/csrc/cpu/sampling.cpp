// CPU token draw for the sampler's common case (engine/sample/random_draw.py `draw`): per row,
// softmax(logits / temperature), one draw by inverting the CDF at u, and top-p's acceptance
// test of that draw, fused into a few passes over the row instead of ~15 full-tensor torch ops.
//
// Contract (cuda_ext/reference.py `draw_tokens` is the same in torch): logits [rows, vocab]
// fp32 with a contiguous last dim; temperature, top_p, u [rows] fp32 (temperature > 0, finite;
// 0 <= u < 1); tokens [rows] int64, written. A logit that is NaN after the temperature counts as
// -inf and +inf as the largest float, as in the torch path. tokens[r] is the drawn token when
// top_p[r] >= 1 or the tokens strictly more likely than it hold less than top_p of the mass
// (the draw is then a draw from the nucleus), and -1 when the draw is rejected or the row has
// no finite logit: the caller settles those rows (more rounds, the exact cut-off, fallbacks).

#include "cpu_ops.h"
#include "exp_poly.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace paged_serve::cpu {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int64_t kBlock = 64;  // tokens per partial sum of the CDF walk

void check_vector(const at::Tensor& t, const char* name, int64_t rows, at::ScalarType type) {
  PS_CHECK(t.device().is_cpu() && t.dim() == 1 && t.size(0) == rows && t.is_contiguous() && t.scalar_type() == type,
           "draw_tokens: ", name, " must be a contiguous CPU vector of ", rows, " ", type);
}

}  // namespace

void draw_tokens(const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& top_p,
                 const at::Tensor& u, at::Tensor& tokens) {
  PS_CHECK(logits.device().is_cpu() && logits.dim() == 2 && logits.scalar_type() == at::kFloat &&
               logits.stride(1) == 1,
           "draw_tokens: logits must be a [rows, vocab] float32 CPU tensor with a contiguous last dim");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  PS_CHECK(vocab > 0 || rows == 0, "draw_tokens: empty vocabulary");
  check_vector(temperature, "temperature", rows, at::kFloat);
  check_vector(top_p, "top_p", rows, at::kFloat);
  check_vector(u, "u", rows, at::kFloat);
  check_vector(tokens, "tokens", rows, at::kLong);

  const float* L = logits.const_data_ptr<float>();
  const int64_t ld = logits.stride(0);
  const float* temp = temperature.const_data_ptr<float>();
  const float* p_top = top_p.const_data_ptr<float>();
  const float* uu = u.const_data_ptr<float>();
  int64_t* out = tokens.data_ptr<int64_t>();

  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    const int64_t num_blocks = (vocab + kBlock - 1) / kBlock;
    std::vector<float> x(vocab), e(vocab);
    std::vector<double> block_sum(num_blocks);
    for (int64_t r = begin; r < end; ++r) {
      const float* row = L + r * ld;
      const float t = temp[r];
      // Pass 1: the logits as the torch path sees them (divided, NaN -> -inf, +inf -> max).
      float m = kNegInf;
#pragma omp simd reduction(max : m)
      for (int64_t j = 0; j < vocab; ++j) {
        float v = row[j] / t;
        v = v == v ? std::min(v, FLT_MAX) : kNegInf;
        x[j] = v;
        m = std::max(m, v);
      }
      if (!(m > kNegInf)) {
        out[r] = -1;  // nothing finite left: the caller's fallback decides
        continue;
      }
      // Pass 2: unnormalised probabilities, summed per block of kBlock tokens (float lanes
      // inside a block, double across blocks).
      double total = 0.0;
      for (int64_t b = 0; b < num_blocks; ++b) {
        const int64_t lo = b * kBlock, hi = std::min(vocab, lo + kBlock);
        float s = 0.f;
#pragma omp simd reduction(+ : s)
        for (int64_t j = lo; j < hi; ++j) {
          const float w = x[j] == kNegInf ? 0.f : exp_nonpositive(x[j] - m);
          e[j] = w;
          s += w;
        }
        block_sum[b] = s;
        total += s;
      }
      // Pass 3: the first token whose cumulative mass passes u * total, found block by block
      // and then inside the block (never a token of mass 0).
      const double target = static_cast<double>(uu[r]) * total;
      double cum = 0.0;
      int64_t b = 0;
      while (b + 1 < num_blocks && cum + block_sum[b] <= target) cum += block_sum[b++];
      int64_t tok = -1;
      for (int64_t j = b * kBlock, hi = std::min(vocab, j + kBlock); j < hi; ++j) {
        if (e[j] > 0.f) {
          tok = j;
          cum += e[j];
          if (cum > target) break;
        }
      }
      // NOTE: rounding (a block's float sum against its tokens' double sum) can leave target
      // past the chosen block's last token of mass > 0, or the block empty: then the last
      // token of mass > 0 at or before it.
      for (int64_t j = std::min(vocab, (b + 1) * kBlock) - 1; tok < 0 && j >= 0; --j)
        if (e[j] > 0.f) tok = j;
      // Pass 4: top-p's test, the mass strictly above the drawn token's logit.
      const float p = p_top[r];
      if (p < 1.f) {
        const float chosen = x[tok];
        float above = 0.f;
#pragma omp simd reduction(+ : above)
        for (int64_t j = 0; j < vocab; ++j) above += x[j] > chosen ? e[j] : 0.f;
        if (!(above < p * total)) tok = -1;
      }
      out[r] = tok;
    }
  });
}

}  // namespace paged_serve::cpu
