// Paged decode attention on CPU, reading K/V straight from the paged cache (issue 16).
//
// The torch reference gathers every sequence's blocks into a dense copy and then calls SDPA:
// on a decode step of 64 sequences of ~300 tokens that copy is ~900 MB per step for
// SmolLM2 (more than its weights), read once, written once and read again. Here each cached
// row is read once for all the query heads that share it (GQA), with an exact two-pass
// softmax in float32. A task is one sequence's every KV head when the batch has enough
// sequences to share out, else one (sequence, KV head): a task that reads a block's whole
// rows reads one contiguous run, which the hardware prefetcher follows; one head's slice of
// each row is a strided walk it does not (64 sequences of 100-400 tokens, SmolLM2's cache:
// ~20 vs ~12 GB/s read, docs/performance.md, CPU).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include "cpu_paged_blocks.h"
#include "cpu_ops.h"
#include "cpu_pool.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define FLAGSERVE_QK8 1
#endif

namespace {

using paged::for_blocks;
using Vec = at::vec::Vectorized<float>;

struct Layout {
  int64_t block_size, block_stride, token_stride;  // cache strides, in elements
  int64_t groups, head_dim;                        // query heads per KV head, head size
  float scale;
};

// A cached row as float32: the row itself, or converted into `tmp` (16-bit caches).
template <typename T>
inline const float* as_float(const T* row, int64_t n, float* tmp) {
  for (int64_t i = 0; i < n; ++i) tmp[i] = static_cast<float>(row[i]);
  return tmp;
}
template <>
inline const float* as_float<float>(const float* row, int64_t, float*) { return row; }

inline float dot(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  Vec acc(0.f);
  for (; i + Vec::size() <= n; i += Vec::size()) acc = at::vec::fmadd(Vec::loadu(a + i), Vec::loadu(b + i), acc);
  float s = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, acc);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

inline void axpy(float p, const float* x, float* y, int64_t n) {
  int64_t i = 0;
  const Vec pv(p);
  for (; i + Vec::size() <= n; i += Vec::size()) at::vec::fmadd(pv, Vec::loadu(x + i), Vec::loadu(y + i)).store(y + i);
  for (; i < n; ++i) y[i] += p * x[i];
}

// exp(x - m) in place (the exp torch's own flash attention uses); returns the sum.
inline float exp_sum(float* x, int64_t n, float m) {
  int64_t i = 0;
  const Vec mv(m);
  Vec acc(0.f);
  for (; i + Vec::size() <= n; i += Vec::size()) {
    Vec e = (Vec::loadu(x + i) - mv).exp_u20();
    e.store(x + i);
    acc = acc + e;
  }
  float s = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, acc);
  for (; i < n; ++i) s += (x[i] = std::exp(x[i] - m));
  return s;
}

// f(t, offset of row t in the cache) for t in [0, len), block by block: a division per
// token (t / block_size with a runtime block size) cost as much as the row's dot product.
template <typename F, typename T = float>
inline void for_rows(const int32_t* table, int64_t len, const Layout& l, F&& f,
                     const T* head = nullptr) {
  for_blocks(table, len, l, [&](int64_t start, int64_t base, int64_t n) {
    for (int64_t j = 0; j < n; ++j) f(start + j, base + j * l.token_stride);
  }, head);
}

#ifdef FLAGSERVE_QK8
// Lane i = the sum of a[i]'s lanes: one reduction for 8 dot products. A horizontal sum per
// dot product cost more than the dot itself at head_dim 32-64 (AVX2).
inline __m256 sum8(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}

// scores[g * len + t + i] = q[g] . K[row0 + i * stride] for 8 cached rows of one block
// (head_dim a multiple of 8). The rows as one pointer and a stride: an array of 8 row offsets
// was reloaded from the stack for every load of K (17 loads per 8 FMAs).
inline void qk8(const float* q, const float* row0, int64_t stride, const Layout& l,
                float* scores, int64_t len, int64_t t) {
  for (int64_t g = 0; g < l.groups; ++g) {
    const float* qg = q + g * l.head_dim;
    __m256 a[8];
    for (int i = 0; i < 8; ++i) a[i] = _mm256_setzero_ps();
    for (int64_t d = 0; d < l.head_dim; d += 8) {
      const __m256 qv = _mm256_loadu_ps(qg + d);
      for (int i = 0; i < 8; ++i) a[i] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(row0 + i * stride + d), a[i]);
    }
    _mm256_storeu_ps(scores + g * len + t, sum8(a));
  }
}
#endif

// scores[g, t] = q[g] . K[t] (q pre-scaled) for t in [0, len), a row at a time (16-bit caches
// and head sizes the float32 path below does not take).
template <typename T>
inline void qk_scores(const float* qf, const T* k, const int32_t* table, int64_t len,
                      const Layout& l, float* scores, float* tmp) {
  const int64_t D = l.head_dim, G = l.groups;
  for_rows(table, len, l, [&](int64_t t, int64_t row) {
    const float* kr = as_float<T>(k + row, D, tmp);
    for (int64_t g = 0; g < G; ++g) scores[g * len + t] = dot(qf + g * D, kr, D);
  }, k);
}

// For each of G query heads g: acc[g * acc_stride, NV vectors) += sum over the n rows of
// p[g * p_stride + j] * V[j] (rows `stride` apart), U rows at a time into U sets of NV sums
// in registers: NV x U = 8 independent FMA chains, which keep both FMA pipes busy through
// the chains' 4 cycles of latency (4 chains ran at half speed). Each V row is loaded once
// for the G heads that share it (one call per head loaded it G times: the loads, not the
// FMAs, bounded the kernel). With U = 1 each output is one FMA chain over the rows in order,
// block after block; G does not change any output's order.
template <int NV, int U, int G>
void weighted_block(const float* v, int64_t stride, int64_t n, const float* p, int64_t p_stride,
                    float* acc, int64_t acc_stride) {
  Vec a[U][G][NV];
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < NV; ++i) {
      a[0][g][i] = Vec::loadu(acc + g * acc_stride + i * Vec::size());
      for (int u = 1; u < U; ++u) a[u][g][i] = Vec(0.f);
    }
  auto add = [&](int u, int64_t j) {
    Vec row[NV];
    for (int i = 0; i < NV; ++i) row[i] = Vec::loadu(v + j * stride + i * Vec::size());
    for (int g = 0; g < G; ++g) {
      const Vec pv(p[g * p_stride + j]);
      for (int i = 0; i < NV; ++i) a[u][g][i] = at::vec::fmadd(pv, row[i], a[u][g][i]);
    }
  };
  int64_t j = 0;
  for (; j + U <= n; j += U)
    for (int u = 0; u < U; ++u) add(u, j + u);
  for (; j < n; ++j) add(0, j);
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < NV; ++i) {
      Vec sum = a[0][g][i];
      for (int u = 1; u < U; ++u) sum = sum + a[u][g][i];
      sum.store(acc + g * acc_stride + i * Vec::size());
    }
}

using WeightedBlock = void (*)(const float*, int64_t, int64_t, const float*, int64_t, float*,
                               int64_t);

// The widest weighted_block<.., .., G> whose chunk divides head_dim (that chunk's width in
// floats into `width`); null where head_dim is not whole vectors or G heads of it would not
// fit the registers.
template <int G>
WeightedBlock weighted_block_for(int64_t head_dim, int64_t& width) {
  constexpr int64_t V = Vec::size();
  const std::pair<int64_t, WeightedBlock> choices[] = {
      {8, weighted_block<8, 1, G>}, {4, weighted_block<4, 2, G>}, {2, weighted_block<2, 4, G>},
      {1, weighted_block<1, 8, G>}};
  // U x G x NV sums, NV row vectors and a broadcast: 32 vector registers with AVX-512.
  constexpr int64_t registers = V == 16 ? 32 : 16;
  for (const auto& [nv, fn] : choices) {
    if (head_dim % (nv * V) == 0 && (G == 1 || 8 * G + nv + 1 <= registers)) {
      width = nv * V;
      return fn;
    }
  }
  return nullptr;
}

// The grouped weighted_block for `groups` query heads per KV head where one fits (into
// `per_call`, the heads one call sums), else the one-head one.
inline WeightedBlock weighted_for(int64_t head_dim, int64_t groups, int64_t& width,
                                  int64_t& per_call) {
  WeightedBlock fn = nullptr;
  per_call = groups;
  if (groups == 2) fn = weighted_block_for<2>(head_dim, width);
  if (groups == 3) fn = weighted_block_for<3>(head_dim, width);
  if (fn != nullptr) return fn;
  per_call = 1;
  return weighted_block_for<1>(head_dim, width);
}

inline float max_of(const float* x, int64_t n) {
  int64_t i = 0;
  float m = -std::numeric_limits<float>::infinity();
  if (n >= Vec::size()) {
    Vec mv = Vec::loadu(x);
    for (i = Vec::size(); i + Vec::size() <= n; i += Vec::size()) mv = at::vec::maximum(mv, Vec::loadu(x + i));
    m = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, mv);
  }
  for (; i < n; ++i) m = std::max(m, x[i]);
  return m;
}

// Each of the `rows` rows of scores (len each) becomes exp(s - max); inv[r] = 1 / its sum.
inline void softmax_rows(float* scores, int64_t rows, int64_t len, float* inv) {
  for (int64_t r = 0; r < rows; ++r) {
    float* sr = scores + r * len;
    inv[r] = 1.f / exp_sum(sr, len, max_of(sr, len));
  }
}

// Attends the `groups` query heads in `qf` (float32, pre-scaled, [groups, head_dim]) to
// cached positions [0, len) of one KV head, a row at a time (16-bit caches, and head sizes
// attend_rows does not take); writes [groups, head_dim] at `out` (head stride `out_stride`).
// `scores` holds groups * len floats, `acc` and `tmp` groups * head_dim, `inv` groups.
template <typename T>
void attend(const float* qf, const T* k, const T* v, const int32_t* table, int64_t len,
            const Layout& l, float* scores, float* acc, float* tmp, float* inv, T* out,
            int64_t out_stride) {
  const int64_t D = l.head_dim, G = l.groups;
  qk_scores<T>(qf, k, table, len, l, scores, tmp);
  softmax_rows(scores, G, len, inv);
  std::fill(acc, acc + G * D, 0.f);
  for_rows(table, len, l, [&](int64_t t, int64_t row) {
    const float* vr = as_float<T>(v + row, D, tmp);
    for (int64_t g = 0; g < G; ++g) axpy(scores[g * len + t], vr, acc + g * D, D);
  }, v);
  for (int64_t g = 0; g < G; ++g)
    for (int64_t d = 0; d < D; ++d) out[g * out_stride + d] = static_cast<T>(acc[g * D + d] * inv[g]);
}

#ifdef FLAGSERVE_QK8
// The float32 path: one sequence's KV heads [h0, h0 + heads), block by block, a block's rows
// read once per pass for every query head of these KV heads. `qf` is [heads * groups,
// head_dim] (pre-scaled), `k` and `v` point at head h0 of the cache, `out` at the first
// query head's output row (rows contiguous); `scores` holds heads * groups * len floats,
// `acc` and `inv` heads * groups * head_dim and heads * groups.
void attend_rows(const float* qf, const float* k, const float* v, const int32_t* table,
                 int64_t len, const Layout& l, int64_t heads, WeightedBlock weighted,
                 int64_t width, int64_t per_call, float* scores, float* acc, float* inv,
                 float* out) {
  const int64_t D = l.head_dim, G = l.groups, ts = l.token_stride, rows = heads * G;
  Layout span = l;  // the part of each cached row this task reads: what to read ahead
  span.head_dim = heads * D;
  for_blocks(table, len, span, [&](int64_t start, int64_t base, int64_t n) {
    int64_t j = 0;
    for (; j + 8 <= n; j += 8)
      for (int64_t h = 0; h < heads; ++h)
        qk8(qf + h * G * D, k + base + j * ts + h * D, ts, l, scores + h * G * len, len, start + j);
    for (; j < n; ++j)
      for (int64_t r = 0; r < rows; ++r)
        scores[r * len + start + j] = dot(qf + r * D, k + base + j * ts + r / G * D, D);
  }, k);
  softmax_rows(scores, rows, len, inv);
  std::fill(acc, acc + rows * D, 0.f);
  for_blocks(table, len, span, [&](int64_t start, int64_t base, int64_t n) {
    for (int64_t r = 0; r < rows; r += per_call)  // per_call divides G: one KV head a call
      for (int64_t c = 0; c < D; c += width)
        weighted(v + base + r / G * D + c, ts, n, scores + r * len + start, len, acc + r * D + c,
                 D);
  }, v);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t d = 0; d < D; ++d) out[r * D + d] = acc[r * D + d] * inv[r];
}
#endif

template <typename T>
void decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
            const at::Tensor& tables, const at::Tensor& lens, double scale, at::Tensor& out) {
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = k_cache.size(2);
  const Layout l{k_cache.size(1), k_cache.stride(0), k_cache.stride(1), Hq / Hkv, D,
                 static_cast<float>(scale)};
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int32_t* tp = tables.data_ptr<int32_t>();
  const int32_t* lp = lens.data_ptr<int32_t>();
  const int64_t q_row = q.stride(0), q_head = q.stride(1), width = tables.stride(0);
  int64_t max_len = 1;
  for (int64_t b = 0; b < B; ++b) max_len = std::max<int64_t>(max_len, lp[b]);
  WeightedBlock weighted = nullptr;
  int64_t chunk = 0;
#ifdef FLAGSERVE_QK8
  int64_t per_call = 1;
  if (std::is_same<T, float>::value && D % 8 == 0)
    weighted = weighted_for(D, l.groups, chunk, per_call);
#endif
  // KV heads per task: all of a sequence's where there are tasks enough for every thread
  // to take several (the pool shares them out as they finish), else one.
  const int64_t heads = weighted != nullptr && B >= 4 * at::get_num_threads() ? Hkv : 1;
  const int64_t tasks_per_seq = Hkv / heads, rows = heads * l.groups;
  pool::parallel_for(0, B * tasks_per_seq, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(rows * max_len), acc(rows * D), qf(rows * D), tmp(D), inv(rows);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / tasks_per_seq, h0 = task % tasks_per_seq * heads;
      for (int64_t r = 0; r < rows; ++r) {
        const T* qr = qp + b * q_row + (h0 * l.groups + r) * q_head;
        for (int64_t d = 0; d < D; ++d) qf[r * D + d] = static_cast<float>(qr[d]) * l.scale;
      }
      T* o = op + (b * Hq + h0 * l.groups) * D;
#ifdef FLAGSERVE_QK8
      if constexpr (std::is_same<T, float>::value) {
        if (weighted != nullptr) {
          attend_rows(qf.data(), kp + h0 * D, vp + h0 * D, tp + b * width, lp[b], l, heads,
                      weighted, chunk, per_call, scores.data(), acc.data(), inv.data(), o);
          continue;
        }
      }
#endif
      attend<T>(qf.data(), kp + h0 * D, vp + h0 * D, tp + b * width, lp[b], l, scores.data(),
                acc.data(), tmp.data(), inv.data(), o, D);
    }
  });
}

}  // namespace

at::Tensor cpu_ops::paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                           const at::Tensor& v_cache, const at::Tensor& block_tables,
                                           const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q: [batch, heads, head_dim], rows contiguous");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "block_tables and seq_lens must be int32");
  TORCH_CHECK(block_tables.stride(1) == 1, "block_tables rows must be contiguous");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "query heads must be a multiple of KV heads");
  auto tables = block_tables;
  auto lens = seq_lens.contiguous();
  auto out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    decode<scalar_t>(q, k_cache, v_cache, tables, lens, scale, out);
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(flagserve_cpu, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor seq_lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(flagserve_cpu, CPU, m) {
  m.impl("paged_decode_attention", &cpu_ops::paged_decode_attention);
}
