// The greedy LM head (issue 16): the token the argmax of a float32 LM head picks, found from
// bfloat16 logits and a float32 recompute of the few tokens that could be it.
//
// A greedy row needs only the argmax of its logits, and the LM head is a large share of a
// decode step (SmolLM2's [49152, 576] is a fifth of its weights and FLOPs). A cheaper product
// gives every logit to within a bound: oneDNN's bfloat16 matmul where AMX runs it, int8
// weights and int16 inputs where AVX512-VNNI does (cpu_int8_logits.cpp), either faster than
// the float32 kernel (docs/performance.md, CPU). Every token whose logit plus its bound
// reaches the row's best lower bound is a candidate; the others are provably below the
// float32 maximum. Each candidate is recomputed exactly as packed_linear computes it (one
// float32 FMA chain over k in order, from zero: cpu_linear.cpp), and the first largest of
// those is the token the full float32 argmax (argmax_rows) would pick: the same token, not
// an approximation.
//
// The bound. a = the bf16 logit, e = the float32 chain's, S = sum_k |x_k w_k| <= |x| |w|
// (Cauchy-Schwarz), u = 2^-8 (bf16's unit roundoff), g = K 2^-24 / (1 - K 2^-24) (a float32
// sum of K terms). x and w rounded to bf16 move each product by at most (2u + u^2)|x_k w_k|;
// bf16 products are exact in float32 and their float32 sum is within g (1 + u)^2 S; that sum
// rounded to bf16 moves by at most u |a| / (1 - u); the chain is within g S of the true sum.
// So |a - e| <= 2^-7 |a| + (2^-7 + 2^-15 + 3g) S, plus what flushing denormals can move
// (under K 2^-126 (|x| + |w|)). A row with a logit that is not finite gets -1: the caller
// computes its full logits.
//
// Or the logits come from int8 weights and int16 inputs (cpu_int8_logits.cpp, which derives
// its bound): then |a - e| <= |eta_v| (|x| + |eps|) + (|eps| + g |x|) |w_v| plus a's roundings,
// (2^-8 + 2^-22) |a| / (1 - 2^-8), with |eta_v| per token (eta_norms) and |eps| per row
// (x_err) as that file returns them.
#include <ATen/ATen.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include "cpu_pool.h"

#include <cmath>
#include <limits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr size_t kChains = 8;  // candidates recomputed at once: FMA chains in flight
constexpr int64_t kSpan = 256;  // tokens per span of the candidates' second pass

struct Bound {
  float per_norm;  // times |w_v|: (2^-7 + 2^-15 + 3g) |x| (bf16), |eps| + g |x| (int8)
  float per_logit;  // times |a_v|
  float flat;  // denormals
  float per_eta = 0.f;  // times |eta_v| (int8): |x| + |eps|
};

// x_err: the row's |eps| for int8 logits, negative for bf16 ones. Every factor rounded up.
Bound row_bound(const float* x, int64_t K, float max_norm, float x_err) {
  double squares = 0;
  for (int64_t k = 0; k < K; ++k) squares += double(x[k]) * x[k];
  const double norm = std::sqrt(squares) * (1 + 1e-6), up = 1 + 1e-5;
  const double g = K * 0x1p-24 / (1 - K * 0x1p-24);
  const auto flat = float(K * 0x1p-110 * (1 + norm + max_norm));
  if (x_err < 0) return {float((0x1p-7 + 0x1p-15 + 3 * g) * norm * up), 0x1p-7f, flat};
  return {float((x_err + g * norm) * up), float((0x1p-8 + 0x1p-22) / (1 - 0x1p-8) * up), flat,
          float((norm + x_err) * up)};
}

// The candidates of one row, ascending; false when a logit is not finite. The first pass
// finds the best lower bound and each span's highest upper bound; the second looks again
// only at spans whose upper bound reaches it (a few of a vocabulary's hundreds).
template <bool Eta>
bool candidates(const at::BFloat16* a, const float* norms, const float* eta, int64_t n,
                const Bound& b, std::vector<float>& span_top, std::vector<int64_t>& out) {
  constexpr int64_t W = Vec::size();
  const Vec per_norm(b.per_norm), per_logit(b.per_logit), flat(b.flat), per_eta(b.per_eta);
  const auto bounds = [&](int64_t v, Vec& av) __attribute__((always_inline)) {
    at::vec::load_to_float(a + v, av);
    const Vec r = at::vec::fmadd(per_norm, Vec::loadu(norms + v), at::vec::fmadd(per_logit, av.abs(), flat));
    if constexpr (Eta) return at::vec::fmadd(per_eta, Vec::loadu(eta + v), r);
    return r;
  };
  const auto max_of = [](const Vec& x) {
    return at::vec::vec_reduce_all<float>([](Vec& p, Vec& q) { return at::vec::maximum(p, q); }, x);
  };
  const int64_t whole = n / W * W, spans = (whole + kSpan - 1) / kSpan;
  span_top.resize(spans);
  Vec lo(-std::numeric_limits<float>::infinity()), most(0.f);
  for (int64_t s = 0; s < spans; ++s) {
    Vec top(-std::numeric_limits<float>::infinity());
    for (int64_t v = s * kSpan; v < std::min(whole, (s + 1) * kSpan); v += W) {
      Vec av;
      const Vec reach = bounds(v, av);
      lo = at::vec::maximum(lo, av - reach);
      top = at::vec::maximum(top, av + reach);
      most = at::vec::maximum(most, av.abs());  // NaN propagates
    }
    span_top[s] = max_of(top);
  }
  float low = max_of(lo), top = max_of(most);
  const auto reach = [&](int64_t i) {
    const float r = b.per_norm * norms[i] + (b.per_logit * std::abs(float(a[i])) + b.flat);
    return Eta ? r + b.per_eta * eta[i] : r;
  };
  for (int64_t i = whole; i < n; ++i) {
    low = std::max(low, float(a[i]) - reach(i));
    top = std::isnan(float(a[i])) ? float(a[i]) : std::max(top, std::abs(float(a[i])));
  }
  if (!(top <= std::numeric_limits<float>::max())) return false;
  const Vec vlow(low);
  for (int64_t s = 0; s < spans; ++s) {
    if (!(span_top[s] >= low)) continue;
    for (int64_t v = s * kSpan; v < std::min(whole, (s + 1) * kSpan); v += W) {
      Vec av;
      const Vec reach_v = bounds(v, av);
      uint64_t hit = ~static_cast<uint64_t>(((av + reach_v) >= vlow).zero_mask()) & ((uint64_t{1} << W) - 1);
      for (; hit != 0; hit &= hit - 1) out.push_back(v + __builtin_ctzll(hit));
    }
  }
  for (int64_t i = whole; i < n; ++i)
    if (float(a[i]) + reach(i) >= low) out.push_back(i);
  return true;
}

// The first largest float32 logit among the candidates: kChains chains at a time, each the
// linear kernel's sum (fma(x_k, w_k, acc) from +0, k in order).
int64_t exact_argmax(const float* x, int64_t K, const float* w, const std::vector<int64_t>& cand) {
  float best = -std::numeric_limits<float>::infinity();
  int64_t token = cand.front();
  for (size_t i = 0; i < cand.size(); i += kChains) {
    const float* rows[kChains];
    for (size_t j = 0; j < kChains; ++j)  // a short last group repeats its last candidate
      rows[j] = w + cand[std::min(i + j, cand.size() - 1)] * K;
    float acc[kChains] = {};
    for (int64_t k = 0; k < K; ++k)
      for (size_t j = 0; j < kChains; ++j) acc[j] = std::fma(x[k], rows[j][k], acc[j]);
    for (size_t j = 0; j < kChains && i + j < cand.size(); ++j)
      if (acc[j] > best) best = acc[j], token = cand[i + j];
  }
  return token;
}

// eta_norms and x_err: with int8 logits (cpu_int8_logits.cpp), none with bf16 ones.
at::Tensor greedy_lm_head(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& approx,
                          const at::Tensor& norms, double max_norm,
                          const c10::optional<at::Tensor>& eta_norms,
                          const c10::optional<at::Tensor>& x_err) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat, "x: [M, K] float32");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.scalar_type() == at::kFloat &&
              weight.size(1) == x.size(1), "weight: [V, K] float32, contiguous");
  TORCH_CHECK(norms.dim() == 1 && norms.is_contiguous() && norms.scalar_type() == at::kFloat &&
              norms.size(0) <= weight.size(0) && norms.size(0) > 0, "norms: [n <= V] float32");
  TORCH_CHECK(approx.dim() == 2 && approx.stride(1) == 1 && approx.scalar_type() == at::kBFloat16 &&
              approx.size(0) == x.size(0) && approx.size(1) >= norms.size(0), "approx: [M, >= n] bfloat16");
  TORCH_CHECK(eta_norms.has_value() == x_err.has_value(), "eta_norms and x_err go together");
  const bool int8 = eta_norms.has_value();
  TORCH_CHECK(!int8 || (eta_norms->is_contiguous() && eta_norms->scalar_type() == at::kFloat &&
                        eta_norms->numel() >= norms.size(0)), "eta_norms: [>= n] float32");
  TORCH_CHECK(!int8 || (x_err->is_contiguous() && x_err->scalar_type() == at::kFloat &&
                        x_err->numel() == x.size(0)), "x_err: [M] float32");
  const int64_t M = x.size(0), K = x.size(1), n = norms.size(0);
  at::Tensor out = at::empty({M}, x.options().dtype(at::kLong));
  const float* ep = int8 ? eta_norms->data_ptr<float>() : nullptr;
  const float* xe = int8 ? x_err->data_ptr<float>() : nullptr;
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  const float* np = norms.data_ptr<float>();
  const auto* ap = approx.data_ptr<at::BFloat16>();
  int64_t* op = out.data_ptr<int64_t>();
  const int64_t lda = approx.stride(0);
  pool::parallel_for(0, M, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<int64_t> cand;
    thread_local std::vector<float> span_top;
    for (int64_t m = begin; m < end; ++m) {
      const float* row = xp + m * K;
      cand.clear();
      const Bound b = row_bound(row, K, float(max_norm), int8 ? xe[m] : -1.f);
      const bool finite = int8 ? candidates<true>(ap + m * lda, np, ep, n, b, span_top, cand)
                               : candidates<false>(ap + m * lda, np, ep, n, b, span_top, cand);
      op[m] = finite ? exact_argmax(row, K, wp, cand) : -1;
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(flagserve_cpu, m) {
  m.def("greedy_lm_head(Tensor x, Tensor weight, Tensor approx, Tensor norms, float max_norm, "
        "Tensor? eta_norms=None, Tensor? x_err=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(flagserve_cpu, CPU, m) {
  m.impl("greedy_lm_head", &greedy_lm_head);
}
