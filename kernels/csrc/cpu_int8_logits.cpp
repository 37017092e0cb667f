// Approximate logits for the greedy LM head (cpu_greedy_head.cpp) in integer arithmetic: each
// weight row quantized to int8 with its own scale, each input row to int16 with its own, and
// the dot products summed exactly in int32 by AVX512-VNNI's vpdpwssd (two int16 products per
// 32-bit lane). Where a CPU has no AMX, its bfloat16 dot product (vdpbf16ps) makes half as
// many products per cycle as float32 FMAs, so bf16 logits cost more than the float32 head;
// vpdpwssd issues at the FMA's rate with twice its products, and the weights are a quarter of
// float32's bytes (docs/performance.md, CPU).
//
// What the greedy head needs is a bound on |approx - float32 logit|, per row m and token v:
// with x = t qx + eps (the row's scale t, |qx| <= Q) and w_v = s_v qw_v + eta_v (|qw| <= 127),
//   x . w_v - t s_v (qx . qw_v) = x . eta_v + eps . w_v - eps . eta_v,
// at most |eta_v| (|x| + |eps|) + |eps| |w_v| (Cauchy-Schwarz). The int32 sum is exact (Q is
// chosen so that K Q 127 < 2^31), then float(I) * s_v * t rounds three times and bf16 once.
// This file returns |eps| per row (x_err) and the packing |eta_v| per token (eta_norms); the
// greedy head adds the float32 chain's own error and the roundings.
#include <ATen/ATen.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include "cpu_pool.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <utility>
#include <vector>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#define FLAGSERVE_VNNI 1
#endif

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kCols = 32;  // a tile: 32 tokens, two vectors of 16 int32 lanes
constexpr int64_t kRows = 12;  // rows summed at once: 24 accumulators, 2 weights, 1 broadcast
constexpr int64_t kGrain = 8;  // tiles a thread takes at a time
// Each k pair's 64 bytes ask for the line this far ahead (into the next tile at a tile's end:
// mostly the same thread's next). The hardware's prefetcher alone left a step of a few rows,
// which streams the whole packing from memory once, at a fraction of the memory's rate.
constexpr int64_t kAheadBytes = 2048;

int64_t pairs(int64_t K) { return (K + 1) / 2; }

// The largest |qx| that keeps every int32 sum exact: K Q 127 < 2^31 (15 bits up to K 1,032).
int64_t x_levels(int64_t K) {
  return std::min<int64_t>(16383, ((int64_t{1} << 31) - 1) / (2 * pairs(K) * 127));
}

// One int32 sum of a row's int16 pairs against a tile column's int8 pairs: the fallback's
// arithmetic (the vector path's sums are the same, exact).
int32_t dot_pairs(const int32_t* xp, const int8_t* tile, int64_t P, int64_t col) {
  int32_t sum = 0;
  for (int64_t p = 0; p < P; ++p) {
    int16_t x2[2];
    std::memcpy(x2, xp + p, sizeof(x2));
    const int8_t* w = tile + p * 2 * kCols + 2 * col;
    sum += int32_t(x2[0]) * w[0] + int32_t(x2[1]) * w[1];
  }
  return sum;
}

// float(I) * s * t, rounded to bfloat16 (nearest even): the fallback's; tile_rows computes the
// same in vectors.
inline at::BFloat16 logit(int32_t sum, float s, float t) {
  return at::BFloat16(static_cast<float>(sum) * s * t);
}

// A row's scale, its largest |value| over `levels`; NaN where a value is not finite: its
// logits are then NaN, which leaves every row to the float32 logits (and no NaN reaches an
// integer cast).
float row_scale(const float* row, int64_t K, float levels) {
  float most = 0.f;
  bool finite = true;
  for (int64_t k = 0; k < K; ++k) {
    most = std::max(most, std::abs(row[k]));  // a NaN is skipped here: `finite` sees it
    finite = finite && std::isfinite(row[k]);
  }
  return finite ? most / levels : std::numeric_limits<float>::quiet_NaN();
}

// put(k, q) for each value's nearest multiple of s, q in [-levels, levels] (0 where s is 0 or
// NaN); returns |row - s q|, rounded up (NaN with s).
template <typename Put>
float quantize_row(const float* row, int64_t K, float s, float levels, Put&& put) {
  double squares = 0;
  for (int64_t k = 0; k < K; ++k) {
    const float q = s > 0.f ? std::clamp(std::nearbyint(row[k] / s), -levels, levels) : 0.f;
    put(k, q);
    const double err = double(row[k]) - double(s) * q;  // exact: s q has at most 39 bits
    squares += err * err;
  }
  return static_cast<float>(std::sqrt(squares) * (1 + 1e-6));  // up, past float's rounding
}

#ifdef FLAGSERVE_VNNI
// 16 int32 lanes. The accumulators are of this type, not __m512i (8 int64 lanes): with
// __m512i, GCC 12 kept them on the stack or copied each between registers on every sum (66
// moves per 24 sums); with int32 lanes the loop is the 24 sums, 12 broadcasts and 2 loads.
typedef int32_t I32x16 __attribute__((vector_size(64)));

// Rows [0, R) of one tile. The tile stores, per k pair, 32 columns x 2 int8: its two 32-byte
// halves widen to the two vectors' int16 pairs.
template <int R>
void tile_rows(const int32_t* x, int64_t P, const int8_t* tile, const float* s, const float* t,
               at::BFloat16* out, int64_t ldo, int64_t cols) {
  I32x16 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = I32x16{};
  for (int64_t p = 0; p < P; ++p) {
    const int8_t* w = tile + p * 2 * kCols;
    __builtin_prefetch(w + kAheadBytes, 0, 3);
    const auto* half = reinterpret_cast<const __m256i*>(w);
    const __m512i w0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256(half));
    const __m512i w1 = _mm512_cvtepi8_epi16(_mm256_loadu_si256(half + 1));
    for (int r = 0; r < R; ++r) {
      const __m512i xb = _mm512_set1_epi32(x[r * P + p]);
      acc[r][0] = (I32x16)_mm512_dpwssd_epi32((__m512i)acc[r][0], xb, w0);
      acc[r][1] = (I32x16)_mm512_dpwssd_epi32((__m512i)acc[r][1], xb, w1);
    }
  }
  const Vec s0 = Vec::loadu(s), s1 = Vec::loadu(s + 16);
  for (int r = 0; r < R; ++r) {
    const Vec tr(t[r]);
    const auto scaled = [&](int j, const Vec& sj) {  // float(I) * s * t, the order of logit()
      return Vec(_mm512_cvtepi32_ps((__m512i)acc[r][j])) * sj * tr;
    };
    // rounded to nearest even as at::BFloat16 does; the last tile of a vocabulary that is not
    // a multiple of 32 stores its `cols`
    at::vec::convert_from_float<at::BFloat16>(scaled(0, s0), scaled(1, s1)).store(out + r * ldo, cols);
  }
}

template <int... Rs>
void rows_block(int rows, std::integer_sequence<int, Rs...>, const int32_t* x, int64_t P,
                const int8_t* tile, const float* s, const float* t, at::BFloat16* out,
                int64_t ldo, int64_t cols) {
  ((rows == Rs + 1 ? tile_rows<Rs + 1>(x, P, tile, s, t, out, ldo, cols) : void()), ...);
}
#endif

void one_tile(const int32_t* x, int64_t M, int64_t P, const int8_t* tile, const float* s,
              const float* t, at::BFloat16* out, int64_t ldo, int64_t cols) {
  for (int64_t m0 = 0; m0 < M; m0 += kRows) {
    const int rows = static_cast<int>(std::min(kRows, M - m0));
#ifdef FLAGSERVE_VNNI
    rows_block(rows, std::make_integer_sequence<int, kRows>(), x + m0 * P, P, tile, s, t + m0,
               out + m0 * ldo, ldo, cols);
#else
    for (int r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c)
        out[(m0 + r) * ldo + c] = logit(dot_pairs(x + (m0 + r) * P, tile, P, c), s[c], t[m0 + r]);
#endif
  }
}

// weight [N, K] float32 -> (packed [ceil(N / 32), ceil(K / 2), 64] int8, scales [32 ceil(N /
// 32)] float32, eta_norms [N] float32 rounded up). Row v's scale is max |w_v| / 127, its
// values rounded to the nearest multiple; padding (columns, the odd k) is zero.
std::tuple<at::Tensor, at::Tensor, at::Tensor> pack_int8_rows(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat, "weight: [N, K] float32");
  const at::Tensor w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1), P = pairs(K), tiles = (N + kCols - 1) / kCols;
  at::Tensor packed = at::zeros({tiles, P, 2 * kCols}, w.options().dtype(at::kChar));
  at::Tensor scales = at::zeros({tiles * kCols}, w.options());
  at::Tensor eta = at::empty({N}, w.options());
  const float* wp = w.data_ptr<float>();
  int8_t* pp = packed.data_ptr<int8_t>();
  float* sp = scales.data_ptr<float>();
  float* ep = eta.data_ptr<float>();
  pool::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    for (int64_t v = begin; v < end; ++v) {
      const float* row = wp + v * K;
      int8_t* col = pp + (v / kCols) * P * 2 * kCols + 2 * (v % kCols);
      sp[v] = row_scale(row, K, 127.f);
      ep[v] = quantize_row(row, K, sp[v], 127.f, [&](int64_t k, float q) {
        col[(k / 2) * 2 * kCols + k % 2] = static_cast<int8_t>(q);
      });
    }
  });
  return {packed, scales, eta};
}

// Each row of x [M, K] as int16 pairs (xq, [M][ceil(K / 2)] words) at its own scale t, and
// |eps| of its rounding (err, rounded up); a row that is not finite gets t = err = NaN.
void quantize_rows(const float* x, int64_t M, int64_t K, int64_t Q, int32_t* xq, float* t,
                   float* err) {
  const int64_t P = pairs(K);
  std::vector<int16_t> q(2 * P, 0);  // the odd K's last pair ends in a zero
  for (int64_t m = 0; m < M; ++m) {
    const float* row = x + m * K;
    t[m] = row_scale(row, K, float(Q));
    err[m] = quantize_row(row, K, t[m], float(Q), [&](int64_t k, float v) { q[k] = int16_t(v); });
    std::memcpy(xq + m * P, q.data(), P * sizeof(int32_t));
  }
}

// x [M, K] float32 against pack_int8_rows' packing -> (approx [M, n] bfloat16, x_err [M]
// float32: quantize_rows' err).
std::tuple<at::Tensor, at::Tensor> int8_logits(const at::Tensor& x, const at::Tensor& packed,
                                               const at::Tensor& scales, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat,
              "x: [M, K] float32");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kChar && packed.is_contiguous() &&
              packed.size(1) == pairs(x.size(1)) && packed.size(2) == 2 * kCols,
              "packed: pack_int8_rows(weight [N, K])");
  TORCH_CHECK(scales.numel() == packed.size(0) * kCols && scales.scalar_type() == at::kFloat,
              "scales: pack_int8_rows'");
  TORCH_CHECK(n > 0 && n <= packed.size(0) * kCols, "n: the tokens to compute, at most the packing's");
  const int64_t M = x.size(0), K = x.size(1), P = pairs(K);
  std::vector<int32_t> xq(M * P);
  std::vector<float> t(M);
  at::Tensor err = at::empty({M}, x.options());
  quantize_rows(x.data_ptr<float>(), M, K, x_levels(K), xq.data(), t.data(), err.data_ptr<float>());
  at::Tensor out = at::empty({M, n}, x.options().dtype(at::kBFloat16));
  const int8_t* pp = packed.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  const int64_t tiles = (n + kCols - 1) / kCols;
  pool::parallel_for(0, tiles, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t tile = begin; tile < end; ++tile)
      one_tile(xq.data(), M, P, pp + tile * P * 2 * kCols, sp + tile * kCols, t.data(),
               op + tile * kCols, n, std::min(kCols, n - tile * kCols));
  });
  return {out, err};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(flagserve_cpu, m) {
  m.def("pack_int8_rows(Tensor weight) -> (Tensor, Tensor, Tensor)");
  m.def("int8_logits(Tensor x, Tensor packed, Tensor scales, int n) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(flagserve_cpu, CPU, m) {
  m.impl("pack_int8_rows", &pack_int8_rows);
  m.impl("int8_logits", &int8_logits);
}
