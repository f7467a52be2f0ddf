// CPU token scores (engine/sample/sampler.py `score_tokens`): per row of logits, a given token's raw
// logprob and rank, and the row's k best tokens with their logprobs, in two passes over the row
// instead of torch's logsumexp, gather, a full-row comparison and topk (four passes, two of
// them writing full-vocabulary temporaries). Prompt logprobs score every prompt row this way
// (a 256-row chunk of a 49k vocabulary: ~50 MB of logits per chunk).
//
// Contract (cuda_ext/reference.py `score_tokens` is the same in torch): logits [rows, vocab]
// fp32 with a contiguous last dim, 0 < vocab; targets [rows] int64 in [0, vocab); outputs
// written: logprob [rows] fp32 (logits[r, t] - logsumexp(logits[r])), rank [rows] int32 (1 +
// the count of logits strictly above the target's), top_ids [rows, k] int64 and top_vals
// [rows, k] fp32 (the k largest logits as logprobs, largest first; ties: lower index first),
// 0 <= k <= vocab. A row holding a NaN or +inf logit is not scored: its rank is written as 0
// and the caller scores it the torch way (whose NaN semantics it keeps).

#include "cpu_ops.h"
#include "exp_poly.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace paged_serve::cpu {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int64_t kChunk = 64;  // logits per top-k candidate test (one max over the chunk)

// The k best (value, index) pairs seen so far, largest first; an equal value goes after those
// already held (so ties keep the lower index first, the row being read in order).
struct TopK {
  std::vector<float> v;
  std::vector<int64_t> i;
  int64_t k = 0, n = 0;

  void reset(int64_t k_) {
    k = k_;
    n = 0;
    v.assign(k, kNegInf);
    i.assign(k, 0);
  }
  float floor() const { return v[k - 1]; }  // once full
  void offer(float x, int64_t idx) {
    if (n == k && !(x > v[k - 1])) return;
    int64_t j = n < k ? n++ : k - 1;
    while (j > 0 && v[j - 1] < x) {
      v[j] = v[j - 1];
      i[j] = i[j - 1];
      --j;
    }
    v[j] = x;
    i[j] = idx;
  }
};

}  // namespace

void score_tokens(const at::Tensor& logits, const at::Tensor& targets, int64_t k, at::Tensor& logprob,
                  at::Tensor& rank, at::Tensor& top_ids, at::Tensor& top_vals) {
  PS_CHECK(logits.device().is_cpu() && logits.dim() == 2 && logits.scalar_type() == at::kFloat &&
               logits.stride(1) == 1,
           "score_tokens: logits must be a [rows, vocab] float32 CPU tensor with a contiguous last dim");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  PS_CHECK(vocab > 0, "score_tokens: empty vocabulary");
  PS_CHECK(0 <= k && k <= vocab, "score_tokens: k must be in [0, vocab], got ", k);
  PS_CHECK(targets.is_cpu() && targets.dim() == 1 && targets.size(0) == rows && targets.is_contiguous() &&
               targets.scalar_type() == at::kLong,
           "score_tokens: targets must be a contiguous int64 CPU vector of ", rows);
  PS_CHECK(logprob.is_cpu() && logprob.numel() == rows && logprob.is_contiguous() && logprob.scalar_type() == at::kFloat,
           "score_tokens: logprob must be a contiguous float32 CPU vector of ", rows);
  PS_CHECK(rank.is_cpu() && rank.numel() == rows && rank.is_contiguous() && rank.scalar_type() == at::kInt,
           "score_tokens: rank must be a contiguous int32 CPU vector of ", rows);
  PS_CHECK(top_ids.is_cpu() && top_ids.numel() == rows * k && top_ids.is_contiguous() &&
               top_ids.scalar_type() == at::kLong,
           "score_tokens: top_ids must be a contiguous int64 CPU tensor of ", rows, " x ", k);
  PS_CHECK(top_vals.is_cpu() && top_vals.numel() == rows * k && top_vals.is_contiguous() &&
               top_vals.scalar_type() == at::kFloat,
           "score_tokens: top_vals must be a contiguous float32 CPU tensor of ", rows, " x ", k);
  const int64_t* tgt = targets.const_data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r)
    PS_CHECK(0 <= tgt[r] && tgt[r] < vocab, "score_tokens: target ", tgt[r], " outside the vocabulary");

  const float* L = logits.const_data_ptr<float>();
  const int64_t ld = logits.stride(0);
  float* lp = logprob.data_ptr<float>();
  int32_t* rk = rank.data_ptr<int32_t>();
  int64_t* ids = top_ids.data_ptr<int64_t>();
  float* vals = top_vals.data_ptr<float>();

  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    TopK top;
    for (int64_t r = begin; r < end; ++r) {
      const float* row = L + r * ld;
      const float chosen = row[tgt[r]];
      top.reset(k);
      // Pass 1: the max, the count above the target, NaN / +inf, and the top-k candidates
      // (a chunk is looked at element by element only when its max could enter the top k).
      float m = kNegInf;
      int64_t above = 0;
      bool odd = false;
      for (int64_t c = 0; c < vocab; c += kChunk) {
        const int64_t hi = std::min(vocab, c + kChunk);
        float cm = kNegInf;
        int64_t ca = 0;
        bool bad = false;
#pragma omp simd reduction(max : cm) reduction(+ : ca) reduction(|| : bad)
        for (int64_t j = c; j < hi; ++j) {
          const float x = row[j];
          cm = std::max(cm, x);
          ca += x > chosen;
          bad = bad || !(x < std::numeric_limits<float>::infinity());  // NaN or +inf
        }
        m = std::max(m, cm);
        above += ca;
        odd = odd || bad;
        if (k > 0 && (top.n < k || cm > top.floor()))
          for (int64_t j = c; j < hi; ++j) top.offer(row[j], j);
      }
      if (odd) {
        rk[r] = 0;  // the caller scores this row the torch way
        continue;
      }
      // Pass 2: sum of exp(x - max), float lanes per chunk, double across chunks.
      double total = 0.0;
      if (m > kNegInf) {
        for (int64_t c = 0; c < vocab; c += kChunk) {
          const int64_t hi = std::min(vocab, c + kChunk);
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t j = c; j < hi; ++j) s += row[j] == kNegInf ? 0.f : exp_nonpositive(row[j] - m);
          total += s;
        }
      }
      // logsumexp; a row of -inf has none (-inf), and every logprob is then -inf (torch: NaN,
      // which the sampler reports as -inf)
      const float lse = m > kNegInf ? m + static_cast<float>(std::log(total)) : kNegInf;
      auto logprob_of = [&](float x) { return (m > kNegInf && x > kNegInf) ? x - lse : kNegInf; };
      lp[r] = logprob_of(chosen);
      rk[r] = static_cast<int32_t>(above + 1);
      for (int64_t j = 0; j < k; ++j) {
        ids[r * k + j] = top.i[j];
        vals[r * k + j] = logprob_of(top.v[j]);
      }
    }
  });
}

}  // namespace paged_serve::cpu
