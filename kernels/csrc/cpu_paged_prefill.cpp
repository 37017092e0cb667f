// Paged prefill / extend attention on CPU for float32, over the paged cache (issue 16).
//
// The torch reference (kernels/prefill_attention.py) gathers each sequence's K/V into a dense
// copy and calls SDPA once per sequence; at head_dim 64 SDPA's tiles are GEMMs with an inner
// dimension of 64, and it ran at ~60 GFLOP/s here where vLLM's CPU kernel runs ~150. Here a
// task is one query head and a tile of as many query rows as a vector has lanes (16 with
// AVX-512), and a row of the tile lives in a lane:
//   scores: S[t] (a vector: token t's score for each row) = sum over d of Q^T[d] * K[t][d],
//           with Q^T transposed once per tile and K[t][d] broadcast from the cache in place;
//   softmax: exact, two passes (max, then exp and sum), every step a lane-wise vector op,
//           the causal mask a lane-wise compare of t with each row's position;
//   output: O[r] = sum over t of P[t][r] * V[t], row blocks of accumulators in registers.
// Tasks run longest first from a shared counter: a causal tile's work grows with its position.
#include <ATen/ATen.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include "cpu_ops.h"
#include "cpu_paged_blocks.h"
#include "cpu_pool.h"

#include <algorithm>
#include <limits>
#include <numeric>
#include <vector>

namespace {

using paged::for_blocks;
using Vec = at::vec::Vectorized<float>;
constexpr int64_t R = Vec::size();                 // query rows per tile: one per lane
constexpr int64_t RB = Vec::size() == 16 ? 4 : 2;  // rows per register block of the output pass

struct Cache {
  const float *k, *v;
  int64_t block_size, block_stride, token_stride, head_dim;
};

struct Tile {
  int64_t seq, first, rows;  // sequence, its first query row in the tile, rows in the tile
  int64_t ctx;               // cached positions the tile's last row attends to
};

// s[t] = sum over d of qt[d] * K[t][d] for N cached rows t, in one pass over qt
// (independent accumulators: an FMA's latency is several of its issue slots).
template <int64_t N>
inline void scores_rows(const float* qt, const float* k0, int64_t ts, int64_t D, float* out) {
  Vec a[N];
  for (int64_t j = 0; j < N; ++j) a[j] = Vec(0.f);
  for (int64_t d = 0; d < D; ++d) {
    const Vec q = Vec::loadu(qt + d * R);
    for (int64_t j = 0; j < N; ++j) a[j] = at::vec::fmadd(q, Vec(k0[j * ts + d]), a[j]);
  }
  for (int64_t j = 0; j < N; ++j) a[j].store(out + j * R);
}

inline void scores(const float* qt, const float* k, const int32_t* table, int64_t len,
                   const Cache& c, float* s) {
  const int64_t D = c.head_dim, ts = c.token_stride;
  for_blocks(table, len, c, [&](int64_t start, int64_t base, int64_t n) {
    int64_t j = 0;
    for (; j + 4 <= n; j += 4) scores_rows<4>(qt, k + base + j * ts, ts, D, s + (start + j) * R);
    for (; j < n; ++j) scores_rows<1>(qt, k + base + j * ts, ts, D, s + (start + j) * R);
  });
}

// Scores of positions a row may not see become -inf; then every lane's s[t] becomes
// exp(s[t] - max) and the lane sums are returned.
inline Vec softmax_numerators(float* s, int64_t len, int64_t first_pos) {
  const Vec neg_inf(-std::numeric_limits<float>::infinity());
  float lanes[R];  // lane r: the position of row r
  for (int64_t r = 0; r < R; ++r) lanes[r] = static_cast<float>(first_pos + r);
  const Vec pos = Vec::loadu(lanes);
  for (int64_t t = std::max<int64_t>(first_pos + 1, 0); t < len; ++t) {
    const Vec st = Vec::loadu(s + t * R);
    Vec::blendv(st, neg_inf, Vec(static_cast<float>(t)) > pos).store(s + t * R);
  }
  Vec m = neg_inf;
  for (int64_t t = 0; t < len; ++t) m = at::vec::maximum(m, Vec::loadu(s + t * R));
  Vec sum(0.f);
  for (int64_t t = 0; t < len; ++t) {
    const Vec e = (Vec::loadu(s + t * R) - m).exp_u20();
    e.store(s + t * R);
    sum = sum + e;
  }
  return sum;
}

// acc[r][w] = sum over t of p[t][r0 + r] * V[t][c + w] for RB rows and W = 4 vectors of columns.
template <int64_t W>
inline void weighted_block(const float* v, const int32_t* table, int64_t len, const Cache& c,
                           const float* p, int64_t r0, int64_t col, Vec (&acc)[RB][W]) {
  for (int64_t r = 0; r < RB; ++r)
    for (int64_t w = 0; w < W; ++w) acc[r][w] = Vec(0.f);
  for_blocks(table, len, c, [&](int64_t start, int64_t base, int64_t n) {
    for (int64_t j = 0; j < n; ++j) {
      const float* vr = v + base + j * c.token_stride + col;
      const float* pt = p + (start + j) * R + r0;
      Vec x[W];
      for (int64_t w = 0; w < W; ++w) x[w] = Vec::loadu(vr + w * Vec::size());
      for (int64_t r = 0; r < RB; ++r) {
        const Vec pr(pt[r]);
        for (int64_t w = 0; w < W; ++w) acc[r][w] = at::vec::fmadd(pr, x[w], acc[r][w]);
      }
    }
  });
}

// out[r] = (sum over t of p[t][r] * V[t]) / sums[r] for the tile's rows (row stride out_row).
void weighted_rows(const float* v, const int32_t* table, int64_t len, const Cache& c,
                   const float* p, const float* sums, int64_t rows, float* out, int64_t out_row) {
  const int64_t D = c.head_dim, VS = Vec::size();
  for (int64_t r0 = 0; r0 < rows; r0 += RB) {
    auto emit = [&](auto& acc, int64_t col, int64_t width) {
      for (int64_t r = 0; r < RB && r0 + r < rows; ++r)
        for (int64_t w = 0; w < width; ++w)
          (acc[r][w] * Vec(1.f / sums[r0 + r])).store(out + (r0 + r) * out_row + col + w * VS);
    };
    int64_t col = 0;
    for (; col + 4 * VS <= D; col += 4 * VS) {
      Vec acc[RB][4];
      weighted_block<4>(v, table, len, c, p, r0, col, acc);
      emit(acc, col, 4);
    }
    for (; col + VS <= D; col += VS) {
      Vec acc[RB][1];
      weighted_block<1>(v, table, len, c, p, r0, col, acc);
      emit(acc, col, 1);
    }
    for (; col < D; ++col)  // a head_dim that is not a multiple of the vector size
      for (int64_t r = r0; r < std::min(rows, r0 + RB); ++r) {
        float a = 0.f;
        for_blocks(table, len, c, [&](int64_t start, int64_t base, int64_t n) {
          for (int64_t j = 0; j < n; ++j) a += p[(start + j) * R + r] * v[base + j * c.token_stride + col];
        });
        out[r * out_row + col] = a / sums[r];
      }
  }
}

// Every sequence's query rows cut into tiles of R rows.
std::vector<Tile> make_tiles(const int32_t* cu_q, const int32_t* lens, int64_t B) {
  std::vector<Tile> tiles;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t q_len = cu_q[b + 1] - cu_q[b], first_pos = lens[b] - q_len;
    for (int64_t i = 0; i < q_len; i += R) {
      const int64_t rows = std::min(R, q_len - i);
      tiles.push_back({b, i, rows, first_pos + i + rows});
    }
  }
  return tiles;
}

}  // namespace

at::Tensor cpu_ops::paged_prefill_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                            const at::Tensor& v_cache,
                                            const at::Tensor& block_tables,
                                            const at::Tensor& cu_seqlens_q,
                                            const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat &&
              v_cache.scalar_type() == at::kFloat, "the native prefill attention is float32 only");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q: [tokens, heads, head_dim], rows contiguous");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.stride(1) == 1,
              "block_tables: int32, rows contiguous");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "query heads must be a multiple of KV heads");
  const auto cu = cu_seqlens_q.to(at::kInt).contiguous();
  const auto lens = seq_lens.to(at::kInt).contiguous();
  const int64_t B = lens.size(0), Hq = q.size(1), D = q.size(2), G = Hq / k_cache.size(2);
  const Cache c{k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), k_cache.size(1),
                k_cache.stride(0), k_cache.stride(1), D};
  const int32_t* cu_q = cu.data_ptr<int32_t>();
  auto out = at::empty({q.size(0), Hq, D}, q.options());
  const std::vector<Tile> tiles = make_tiles(cu_q, lens.data_ptr<int32_t>(), B);
  // Longest first, so the last tasks to start are short ones (causal tiles differ a lot).
  std::vector<int64_t> order(tiles.size() * Hq);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return tiles[a / Hq].ctx > tiles[b / Hq].ctx; });
  int64_t max_ctx = 1;
  for (const Tile& t : tiles) max_ctx = std::max(max_ctx, t.ctx);
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int32_t* tp = block_tables.data_ptr<int32_t>();
  const int64_t q_row = q.stride(0), q_head = q.stride(1), width = block_tables.stride(0);
  const float fscale = static_cast<float>(scale);
  pool::parallel_for(0, static_cast<int64_t>(order.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qt(D * R), s(max_ctx * R);
    for (int64_t i = begin; i < end; ++i) {
      const Tile& t = tiles[order[i] / Hq];
      const int64_t h = order[i] % Hq, kv = h / G;
      const int64_t row0 = cu_q[t.seq] + t.first;
      std::fill(qt.begin(), qt.end(), 0.f);
      for (int64_t r = 0; r < t.rows; ++r)
        for (int64_t d = 0; d < D; ++d) qt[d * R + r] = qp[(row0 + r) * q_row + h * q_head + d] * fscale;
      const int32_t* table = tp + t.seq * width;
      scores(qt.data(), c.k + kv * D, table, t.ctx, c, s.data());
      float sums[R];
      softmax_numerators(s.data(), t.ctx, t.ctx - t.rows).store(sums);
      weighted_rows(c.v + kv * D, table, t.ctx, c, s.data(), sums, t.rows,
                    op + (row0 * Hq + h) * D, Hq * D);
    }
  });
  return out;
}


TORCH_LIBRARY_FRAGMENT(flagserve_cpu, m) {
  m.def("paged_prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor cu_seqlens_q, Tensor seq_lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(flagserve_cpu, CPU, m) {
  m.impl("paged_prefill_attention", &cpu_ops::paged_prefill_attention);
}
