// The sampler's passes over a batch's logits.
//
// argmax_rows: the index of each row's largest value, the first on ties, the first NaN where
// there is one (torch.argmax's answer). torch's CPU argmax tracks an index beside every value
// and took 10x its max (2 ms for 32 x 49152, 33 ms for 256 rows, one thread); here a
// vectorized max, then a vectorized search for its first position in the row still in cache.
//
// lse_and_ranks: per row, the log-sum-exp (log-softmax without writing it) and the rank of a
// given token (1 + the values above its own): what a logprob costs, for sampled tokens and
// scored prompt rows. torch wrote an [N, V] bool for the rank and took 160 ms for 682 x 49152
// (its bool sum alone), logsumexp another 110 ms; here two passes over a row still in cache.
//
// apply_token_bitmask: a grammar's token bitmask (structured outputs, issue 14): -inf
// where a row's bit is 0. Bit j of word w is token 32 * w + j (xgrammar's layout). One pass
// that copies whole words of allowed (or banned) tokens at once; the torch reference (a byte
// table lookup and an add, kernels/sampling.py) makes an [N, V] float temporary and
// took 25 us for 32 x 1536, 50 ms for 256 x 49152 (timings: docs/performance.md).
#include <ATen/ATen.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include "cpu_pool.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <tuple>
#include <utility>

namespace {

constexpr int64_t kRowGrain = 16;  // rows below this run inline, no thread wake-up
constexpr uint32_t kNegInfBits = 0xff800000u;  // -inf as float32 bits

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kArgmaxGrain = 1 << 16;  // values per thread, at least: rows of a small
                                           // vocabulary run inline

int64_t argmax_row(const float* p, int64_t n) {
  constexpr int64_t W = Vec::size();
  int64_t i = 0;
  Vec acc(-std::numeric_limits<float>::infinity());
  for (; i + W <= n; i += W) acc = at::vec::maximum(acc, Vec::loadu(p + i));  // NaN propagates
  float m = at::vec::vec_reduce_all<float>(
      [](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, acc);
  for (; i < n; ++i)
    if (std::isnan(p[i]) || p[i] > m) m = p[i];
  if (std::isnan(m)) {
    for (int64_t j = 0; j < n; ++j)
      if (std::isnan(p[j])) return j;
  }
  const Vec target(m);
  for (i = 0; i + W <= n; i += W) {
    // (x == m) is all ones where equal; zero_mask() has the bits of the lanes that are not.
    const uint64_t equal = ~static_cast<uint64_t>((Vec::loadu(p + i) == target).zero_mask()) &
                           ((uint64_t{1} << W) - 1);
    if (equal != 0) return i + __builtin_ctzll(equal);
  }
  for (; i < n; ++i)
    if (p[i] == m) return i;
  return 0;  // unreachable: m is one of the row's values
}

at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.size(1) > 0,
              "logits: [N, V] float32, V > 0");
  const at::Tensor x = logits.contiguous();
  at::Tensor out = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  const int64_t n = x.size(1);
  const float* src = x.data_ptr<float>();
  int64_t* dst = out.data_ptr<int64_t>();
  pool::parallel_for(0, x.size(0), std::max<int64_t>(1, kArgmaxGrain / n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) dst[r] = argmax_row(src + r * n, n);
  });
  return out;
}

// (log-sum-exp, values above p[token]) of one row; NaN lanes count nowhere.
std::pair<float, int64_t> lse_and_rank_row(const float* p, int64_t n, int64_t token) {
  constexpr int64_t W = Vec::size();
  const float ninf = -std::numeric_limits<float>::infinity();
  int64_t i = 0;
  Vec vmax(ninf);
  for (; i + W <= n; i += W) vmax = at::vec::maximum(vmax, Vec::loadu(p + i));
  float m = at::vec::vec_reduce_all<float>(
      [](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, vmax);
  for (; i < n; ++i) m = std::max(m, p[i]);
  if (m == ninf || std::isnan(m)) return {m, 0};  // nothing finite to normalize by
  const float own = p[token];
  const Vec vm(m), vown(own), one(1.0f);
  Vec sum(0.0f), above(0.0f);  // float counts are exact up to 2^24: vocabularies are smaller
  for (i = 0; i + W <= n; i += W) {
    const Vec x = Vec::loadu(p + i);
    sum = sum + (x - vm).exp();
    above = above + (one & (x > vown));
  }
  float total = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, sum);
  int64_t count = static_cast<int64_t>(
      at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, above));
  for (; i < n; ++i) {
    total += std::exp(p[i] - m);
    count += p[i] > own;
  }
  return {m + std::log(total), count};
}

std::tuple<at::Tensor, at::Tensor> lse_and_ranks(const at::Tensor& logits, const at::Tensor& tokens) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.size(1) > 0,
              "logits: [N, V] float32, V > 0");
  TORCH_CHECK(tokens.dim() == 1 && tokens.scalar_type() == at::kLong && tokens.size(0) == logits.size(0),
              "tokens: [N] int64");
  const at::Tensor x = logits.contiguous();
  const at::Tensor t = tokens.contiguous();
  const int64_t rows = x.size(0), n = x.size(1);
  at::Tensor lse = at::empty({rows}, x.options());
  at::Tensor ranks = at::empty({rows}, x.options().dtype(at::kLong));
  const float* src = x.data_ptr<float>();
  const int64_t* tok = t.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK(tok[r] >= 0 && tok[r] < n, "token ", tok[r], " outside the vocabulary of ", n);
  float* lse_out = lse.data_ptr<float>();
  int64_t* rank_out = ranks.data_ptr<int64_t>();
  pool::parallel_for(0, rows, std::max<int64_t>(1, kArgmaxGrain / n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const auto [value, above] = lse_and_rank_row(src + r * n, n, tok[r]);
      lse_out[r] = value;
      rank_out[r] = above + 1;
    }
  });
  return {lse, ranks};
}

at::Tensor apply_token_bitmask(const at::Tensor& logits, const at::Tensor& bitmask) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat, "logits: [N, V] float32");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == at::kInt &&
                  bitmask.size(0) == logits.size(0) && bitmask.size(1) * 32 >= logits.size(1),
              "bitmask: [N, ceil(V / 32)] int32");
  const at::Tensor x = logits.contiguous();
  const at::Tensor bits = bitmask.contiguous();
  at::Tensor out = at::empty_like(x);
  const int64_t vocab = x.size(1), words = bits.size(1);
  const float* src = x.data_ptr<float>();
  const int32_t* mask = bits.data_ptr<int32_t>();
  float* dst = out.data_ptr<float>();
  const float ninf = -std::numeric_limits<float>::infinity();
  static_assert(sizeof(float) == sizeof(uint32_t));
  pool::parallel_for(0, x.size(0), kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* s = src + r * vocab;
      const int32_t* m = mask + r * words;
      float* d = dst + r * vocab;
      for (int64_t w = 0; w * 32 < vocab; ++w) {
        const int64_t base = w * 32, n = std::min<int64_t>(32, vocab - base);
        const uint32_t word = static_cast<uint32_t>(m[w]);
        if (word == 0xffffffffu) {
          std::memcpy(d + base, s + base, n * sizeof(float));
        } else if (word == 0) {
          std::fill(d + base, d + base + n, ninf);
        } else {  // branch-free, so that it vectorizes: random bits defeat a branch predictor
          const uint32_t* sb = reinterpret_cast<const uint32_t*>(s + base);
          uint32_t* db = reinterpret_cast<uint32_t*>(d + base);
          for (int64_t j = 0; j < n; ++j) {
            const uint32_t keep = 0u - ((word >> j) & 1u);  // all ones where allowed
            db[j] = (sb[j] & keep) | (kNegInfBits & ~keep);
          }
        }
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(flagserve_cpu, m) {
  m.def("apply_token_bitmask(Tensor logits, Tensor bitmask) -> Tensor");
  m.def("argmax_rows(Tensor logits) -> Tensor");
  m.def("lse_and_ranks(Tensor logits, Tensor tokens) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(flagserve_cpu, CPU, m) {
  m.impl("apply_token_bitmask", &apply_token_bitmask);
  m.impl("argmax_rows", &argmax_rows);
  m.impl("lse_and_ranks", &lse_and_ranks);
}
