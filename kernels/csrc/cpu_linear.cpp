// The float32 linear layers on CPU (issue 16; chosen in flagserve/layers/cpu_matmul.py).
//
// oneDNN's packed matmul read a decode step's weights at well under the memory's bandwidth
// when the step had a few rows (docs/performance.md, CPU). Here the weight is packed once
// into tiles of kTile output columns, [N / kTile][K][kTile], so a tile is one contiguous
// stream; the kernel keeps
// kRows x kTile outputs in registers and, per k, loads the tile's row once and multiplies it
// by kRows broadcast inputs: no horizontal sums, each weight byte read from memory once per
// call. Numerics: each output is one float32 FMA chain over k in order.
//
// A weight whose values are all bfloat16 (a bf16 checkpoint run in float32) may be packed in
// bfloat16, the same layout at half the bytes (float16 likewise: an fp16 checkpoint): the
// kernel widens each weight vector to float32 as it loads it (exact), so the products and
// sums are the same bits, and a decode step, which streams its weights from memory once,
// reads half as many (docs/performance.md, CPU).
//
// A weight whose values are a GGUF file's Q4_1 or Q8_0 blocks (flagserve/layers/
// cpu_quantized.py) may be packed as those blocks, 5 or 8.5 bits a weight: the kernel computes
// each weight from its block to the bit as gguf's numpy does (cpu_gguf_blocks.h), so again the
// outputs are the same. A step of a few rows widens them in registers; more rows widen a tile
// once into a scratch tile that every row block then reads as float32 (the caller keeps the
// float32 packing for prefills, where widening per row chunk costs more than the bytes save).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include "cpu_gguf_blocks.h"
#include "cpu_ops.h"
#include "cpu_pool.h"
#include "cpu_silu.h"
#include "cpu_tile.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include <unistd.h>

namespace {

using cpu_tile::kTile;
using cpu_tile::kVecs;
using cpu_tile::Vec;
// A tile row is two registers, and kRows rows of it are summed at once: with AVX-512 12 x 32
// (24 accumulators, 2 weight vectors and a broadcast of 32 registers), with AVX2 the classic
// 6 x 16 (12 + 2 + 1 of 16). More rows per block read the tile from L2 fewer times (12 beat 8
// from 64 rows up; 10 and 14 did no better); AVX2 had 2 x 32 before, 8 accumulators for 6
// loads per k, slower than 6 x 16 at every row count (docs/performance.md, CPU).
constexpr int64_t kRows = Vec::size() == 16 ? 12 : 6;
// Rows of x in chunks of about chunk_bytes() (chunk_rows): a chunk stays in L2 while every
// tile's weights stream past it (prefetched, below), where all of a prefill's rows were read
// from L3 once per tile. (Before the prefetch, chunks paid only from 4,096 rows on.) Half the
// core's L2, between 256 KB and 1 MB: a decode step of ~100 rows of a 1,536-wide down_proj
// (614 KB) in one chunk reads its weights once, not three times (docs/performance.md, CPU).
constexpr int64_t kMinChunkBytes = 256 * 1024, kMaxChunkBytes = 1024 * 1024;
// A tile's first row block reads its weights from memory and runs at the memory's pace, the
// other blocks from L2 at the FMAs' pace. So while the other blocks run, they prefetch the
// next tile into L2, a line every kPrefetchEvery k, and its first block finds it there. A
// thread takes kGrainTiles tiles at a time so that it knows its next tile (a thread that
// loses its core holds up at most that many). The first block also prefetches its own rows
// kAheadRows k ahead into L1: the hardware's prefetcher alone kept fewer reads in flight
// (the one block of a 4-8 row step waited on them). Measured in docs/performance.md, CPU.
constexpr int64_t kPrefetchEvery = 2, kGrainTiles = 4, kAheadRows = 16;
constexpr int64_t kAheadBytes = kAheadRows * int64_t(sizeof(float));  // per tile column

// A tile row (kTile weights at w) as float32 vectors. bfloat16 tiles are stored with the
// columns of the two vectors interleaved (pack_linear_weight): 32-bit word i holds column i
// in its low half and column Vec::size() + i in its high half, so one load and two integer
// ops widen both vectors (exact: a bfloat16 is the top half of its float32).
inline void load_row(const float* w, Vec* wv) {
  for (int64_t j = 0; j < kVecs; ++j) wv[j] = Vec::loadu(w + j * Vec::size());
}

inline void load_row(const at::BFloat16* w, Vec* wv) {
  static_assert(kVecs == 2, "two vectors interleaved in 32-bit words");
#if defined(CPU_CAPABILITY_AVX512)
  const __m512i words = _mm512_loadu_si512(w);
  wv[0] = Vec(_mm512_castsi512_ps(_mm512_slli_epi32(words, 16)));
  wv[1] = Vec(_mm512_castsi512_ps(_mm512_and_si512(words, _mm512_set1_epi32(int(0xFFFF0000u)))));
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  wv[0] = Vec(_mm256_castsi256_ps(_mm256_slli_epi32(words, 16)));
  wv[1] = Vec(_mm256_castsi256_ps(_mm256_and_si256(words, _mm256_set1_epi32(int(0xFFFF0000u)))));
#else
  float wide[kTile];
  for (int64_t i = 0; i < Vec::size(); ++i) {
    wide[i] = static_cast<float>(w[2 * i]);
    wide[Vec::size() + i] = static_cast<float>(w[2 * i + 1]);
  }
  for (int64_t j = 0; j < kVecs; ++j) wv[j] = Vec::loadu(wide + j * Vec::size());
#endif
}

// float16 tiles are stored as float32 ones are, column by column.
inline void load_row(const at::Half* w, Vec* wv) {
  for (int64_t j = 0; j < kVecs; ++j) wv[j] = cpu_tile::load_halves(w + j * Vec::size());
}

// A step of up to two row blocks widens GGUF blocks in registers, each block its own; more
// rows widen a tile once into a float32 tile that every block reads, which costs what ~5
// rows' FMAs do but is paid once (measured: docs/performance.md, CPU).
constexpr int64_t kQRegisterRows = 2 * kRows;
// The one row block's prefetch runs this far ahead in blocks: a float32 tile's kAheadBytes per
// column.
constexpr int64_t kQAhead = kAheadBytes * kTile;

// How a row block prefetches while it runs (see above): its own tile kAheadRows k ahead
// (a tile's first block), or `npf` cache lines of the next tile from `pf` (the others).
enum class Prefetch { kAhead, kNextTile };

// A row block's sums start at the tile's kTile bias values (init), or at zero where null.
template <int64_t R>
inline void start_sums(Vec (&acc)[R][kVecs], const float* init) {
  for (int64_t r = 0; r < R; ++r)
    for (int64_t j = 0; j < kVecs; ++j)
      acc[r][j] = init == nullptr ? Vec(0.f) : Vec::loadu(init + j * Vec::size());
}

// ... and leave as rows of `cols` outputs, ldo apart.
template <int64_t R>
inline void store_sums(Vec (&acc)[R][kVecs], float* out, int64_t ldo, int64_t cols) {
  for (int64_t r = 0; r < R; ++r) {
    if (cols == kTile) {
      for (int64_t j = 0; j < kVecs; ++j) acc[r][j].store(out + r * ldo + j * Vec::size());
      continue;
    }
    float row[kTile];  // the last tile of an N that is not a multiple of kTile
    for (int64_t j = 0; j < kVecs; ++j) acc[r][j].store(row + j * Vec::size());
    std::copy(row, row + cols, out + r * ldo);
  }
}

// Rows [0, R) of one tile: out = init + x . w (init: the tile's kTile bias values, or null for
// zeros), the sums in registers from the first k to the last.
template <int64_t R, Prefetch P, typename W>
void tile_rows(const float* x, int64_t ldx, const W* w, int64_t K, const float* init,
               float* out, int64_t ldo, int64_t cols, const char* pf, int64_t npf) {
  Vec acc[R][kVecs];
  start_sums<R>(acc, init);
  const auto step = [&](int64_t k) __attribute__((always_inline)) {
    Vec wv[kVecs];
    load_row(w + k * kTile, wv);
    for (int64_t r = 0; r < R; ++r) {
      const Vec xb(x[r * ldx + k]);
      for (int64_t j = 0; j < kVecs; ++j) acc[r][j] = at::vec::fmadd(xb, wv[j], acc[r][j]);
    }
  };
  // Loops this simple and no test per k: GCC keeps the accumulators in registers only then
  // (a prefetch added to the plain loop once moved them to the stack).
  int64_t k = 0;
  if constexpr (P == Prefetch::kAhead) {
    // Past the tile's end this reads on into the next tile (the same thread's, mostly).
    for (; k < K; ++k) {
      // The same bytes ahead either way: bf16 rows ahead at a float32 row's distance were 8-9%
      // slower at 1-4 rows (docs/performance.md, CPU).
      const char* ahead = reinterpret_cast<const char*>(w + (k + kAheadBytes / sizeof(W)) * kTile);
      for (int64_t line = 0; line < kTile * int64_t(sizeof(W)); line += 64)
        __builtin_prefetch(ahead + line, 0, 3);
      step(k);
    }
  } else {
    for (int64_t i = 0; i < npf && k + kPrefetchEvery <= K; ++i) {
      __builtin_prefetch(pf + i * 64, 0, 2);
#pragma GCC unroll 4
      for (int64_t u = 0; u < kPrefetchEvery; ++u) step(k + u);
      k += kPrefetchEvery;
    }
  }
  for (; k < K; ++k) step(k);
  store_sums<R>(acc, out, ldo, cols);
}

// Rows [0, R) of one tile of GGUF blocks in format F (a row block of a step of few rows), each
// weight widened in registers as it streams past; otherwise as tile_rows with Prefetch::kAhead.
template <int64_t R, typename F>
void blocks_tile_rows(const float* x, int64_t ldx, const uint8_t* w, int64_t K, const float* init,
                      float* out, int64_t ldo, int64_t cols) {
  using namespace gguf_blocks;
  Vec acc[R][kVecs];
  start_sums<R>(acc, init);
  for (int64_t k0 = 0; k0 < K; k0 += kBlock, w += kBytes<F>) {
    for (int64_t line = 0; line < kBytes<F>; line += 64)
      __builtin_prefetch(w + kQAhead + line, 0, 3);
    alignas(64) float d[kTile], m[kTile];
    load_scales<F>(w, d, m);
    const uint8_t* q = w + F::kScales * kHalves;
    // Unrolled: with a loop here GCC stored every accumulator to the stack at every k.
#pragma GCC unroll 32
    for (int64_t k = 0; k < kBlock; ++k) {
      Vec wv[kVecs];
      F::row(q + k * F::kRow, d, m, wv);
      for (int64_t r = 0; r < R; ++r) {
        const Vec xb(x[r * ldx + k0 + k]);
        for (int64_t j = 0; j < kVecs; ++j) acc[r][j] = at::vec::fmadd(xb, wv[j], acc[r][j]);
      }
    }
  }
  store_sums<R>(acc, out, ldo, cols);
}

// A tile of GGUF blocks in format F widened to a float32 one ([K][kTile] at wide), for a
// step's many row blocks.
template <typename F>
void widen_blocks(const uint8_t* w, int64_t K, float* wide) {
  using namespace gguf_blocks;
  for (int64_t k0 = 0; k0 < K; k0 += kBlock, w += kBytes<F>) {
    alignas(64) float d[kTile], m[kTile];
    load_scales<F>(w, d, m);
    for (int64_t k = 0; k < kBlock; ++k) {
      Vec wv[kVecs];
      F::row(w + F::kScales * kHalves + k * F::kRow, d, m, wv);
      for (int64_t j = 0; j < kVecs; ++j) wv[j].store(wide + (k0 + k) * kTile + j * Vec::size());
    }
  }
}

// f(std::integral_constant<int64_t, rows>()) for rows in [1, kRows]: a row block's kernel
// compiled for its row count.
template <int64_t R = kRows, typename F>
void with_rows(int64_t rows, const F& f) {
  if constexpr (R > 1) {
    if (rows < R) return with_rows<R - 1>(rows, f);
  }
  f(std::integral_constant<int64_t, R>());
}

template <Prefetch P, typename W>
void rows_of_tile(int64_t rows, const float* x, int64_t ldx, const W* w, int64_t K,
                  const float* init, float* out, int64_t ldo, int64_t cols, const char* pf,
                  int64_t npf) {
  with_rows(rows, [&](auto r) {
    tile_rows<decltype(r)::value, P, W>(x, ldx, w, K, init, out, ldo, cols, pf, npf);
  });
}

// One tile's weights and bias (or null), and what its row blocks after the first prefetch:
// the tile after it (`next`, null for none), a share of its cache lines each.
template <typename W>
struct Tile {
  const W* w;
  const float* init;
  const char* next;
  int64_t share, lines;

  Tile(const W* w, const float* init, const void* next, int64_t blocks, int64_t lines)
      : w(w), init(init), next(static_cast<const char*>(next)),
        share(next != nullptr ? (lines + blocks - 2) / (blocks - 1) : 0), lines(lines) {}

  // Row block b (rows rows of x from xb): out (ldo apart) = init + x . w.
  void block(int64_t b, int64_t rows, const float* xb, int64_t ldx, int64_t K, float* out,
             int64_t ldo, int64_t cols) const {
    if (b == 0)
      return rows_of_tile<Prefetch::kAhead>(rows, xb, ldx, w, K, init, out, ldo, cols, nullptr, 0);
    const int64_t first = (b - 1) * share, npf = std::clamp<int64_t>(lines - first, 0, share);
    rows_of_tile<Prefetch::kNextTile>(rows, xb, ldx, w, K, init, out, ldo, cols,
                                      next + first * 64, npf);
  }
};

// A tile of GGUF blocks in format F, as Tile: a step of up to kQRegisterRows rows widens it in
// registers in each row block; more rows widen it once into `wide` ([K][kTile] floats), and
// every block reads that as float32.
template <typename F>
struct BlocksTile {
  const uint8_t* w;
  Tile<float> widened;
  bool in_registers;

  BlocksTile(const uint8_t* w, const float* init, const void* next, int64_t blocks,
             int64_t lines, int64_t K, float* wide, bool in_registers)
      : w(w), widened(wide, init, next, blocks, lines), in_registers(in_registers) {
    if (!in_registers) widen_blocks<F>(w, K, wide);
  }

  void block(int64_t b, int64_t rows, const float* xb, int64_t ldx, int64_t K, float* out,
             int64_t ldo, int64_t cols) const {
    if (!in_registers) return widened.block(b, rows, xb, ldx, K, out, ldo, cols);
    with_rows(rows, [&](auto r) {
      blocks_tile_rows<decltype(r)::value, F>(xb, ldx, w, K, widened.init, out, ldo, cols);
    });
  }
};

// Rows of x per work item: all of them up to chunk_bytes() of x (a decode step: the threads
// split the tiles), else chunks of about chunk_bytes() (a prefill: the threads split the rows
// and the tiles).
int64_t chunk_bytes() {
  static const int64_t bytes = [] {
#ifdef _SC_LEVEL2_CACHE_SIZE
    const int64_t l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);  // 0 or -1 where unknown
#else
    const int64_t l2 = 0;
#endif
    return std::clamp<int64_t>(l2 / 2, kMinChunkBytes, kMaxChunkBytes);
  }();
  return bytes;
}

int64_t chunk_rows(int64_t M, int64_t K) {
  const int64_t x_bytes = M * K * int64_t(sizeof(float)), most = chunk_bytes();
  if (x_bytes <= most) return M;
  const int64_t chunks = (x_bytes + most - 1) / most;
  return ((M + chunks - 1) / chunks + kRows - 1) / kRows * kRows;
}

// [N, K] -> [ceil(N / kTile), K, kTile], the columns past N zero; float32, or bfloat16 / float16
// for a weight whose values are all such (the caller's to know: flagserve/layers/cpu_matmul.py).
at::Tensor pack_linear_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && (weight.scalar_type() == at::kFloat ||
                                    weight.scalar_type() == at::kBFloat16 ||
                                    weight.scalar_type() == at::kHalf),
              "weight: [N, K] float32, bfloat16 or float16");
  const int64_t N = weight.size(0), K = weight.size(1), tiles = (N + kTile - 1) / kTile;
  at::Tensor padded = at::zeros({tiles * kTile, K}, weight.options());
  padded.narrow(0, 0, N).copy_(weight);
  at::Tensor packed = padded.view({tiles, kTile, K}).transpose(1, 2);  // [tiles, K, kTile]
  if (weight.scalar_type() == at::kBFloat16)  // the two vectors' columns interleaved (load_row)
    packed = packed.reshape({tiles, K, kVecs, Vec::size()}).transpose(2, 3);
  return packed.contiguous().view({tiles, K, kTile});
}

// The run length in [1, most] whose turns (run i to thread i % threads) leave the busiest
// thread the fewest of `items`; the longest such.
int64_t even_run(int64_t items, int64_t threads, int64_t most) {
  int64_t best = most, best_load = std::numeric_limits<int64_t>::max();
  for (int64_t run = most; run >= 1; --run) {
    const int64_t runs = (items + run - 1) / run, short_by = runs * run - items;
    int64_t load = 0;
    for (int64_t t = 0; t < std::min(threads, runs); ++t) {  // thread t: runs t, t + threads, ...
      const int64_t mine = (runs - t + threads - 1) / threads * run;
      load = std::max(load, mine - ((runs - 1) % threads == t ? short_by : 0));
    }
    if (load < best_load) best = run, best_load = load;
  }
  return best;
}

enum class Storage { kFloat, kBFloat16, kFloat16, kQ4_1, kQ8_0 };

// The checks and shapes both linears share: x [M, K] float32 (rows contiguous) against a
// pack_linear_weight(_q4_1 | _q8_0) of an [N, K] weight, and an optional [N] bias.
struct Problem {
  int64_t M, K, tiles, ldx, chunk, chunks, tile_bytes, lines;
  // The op's threads (the pool's), read here on the caller: a pool helper asking ATen would
  // start OpenMP's lazy setup on its own thread (in a forked child, a stray OpenMP thread).
  int64_t threads;
  Storage storage;
  const float *x, *bias;
  const void* w;
  at::Tensor b;  // the contiguous bias that `bias` points into

  Problem(const at::Tensor& xt, const at::Tensor& packed, int64_t N,
          const c10::optional<at::Tensor>& bias_opt) {
    TORCH_CHECK(xt.dim() == 2 && xt.stride(1) == 1 && xt.scalar_type() == at::kFloat,
                "x: [M, K] float32, rows contiguous");
    TORCH_CHECK(packed.dim() == 3, "packed: pack_linear_weight(_q4_1 | _q8_0) of an [N, K] weight");
    M = xt.size(0), K = xt.size(1), tiles = packed.size(0), ldx = xt.stride(0);
    threads = std::max<int64_t>(at::get_num_threads(), 1);
    using gguf_blocks::kBlock, gguf_blocks::kBytes;
    const bool blocks = packed.scalar_type() == at::kByte;
    storage = blocks && packed.size(2) == kBytes<gguf_blocks::Q4_1>   ? Storage::kQ4_1
              : blocks && packed.size(2) == kBytes<gguf_blocks::Q8_0> ? Storage::kQ8_0
              : packed.scalar_type() == at::kBFloat16                  ? Storage::kBFloat16
              : packed.scalar_type() == at::kHalf                      ? Storage::kFloat16
                                                                       : Storage::kFloat;
    TORCH_CHECK(packed.is_contiguous() && tiles == (N + kTile - 1) / kTile &&
                (blocks ? packed.size(1) * kBlock == K && storage != Storage::kFloat
                        : packed.size(1) == K && packed.size(2) == kTile &&
                          (packed.scalar_type() == at::kFloat ||
                           packed.scalar_type() == at::kBFloat16 ||
                           packed.scalar_type() == at::kHalf)),
                "packed: pack_linear_weight(_q4_1 | _q8_0) of an [N, K] weight");
    if (bias_opt.has_value() && bias_opt->defined()) {
      TORCH_CHECK(bias_opt->dim() == 1 && bias_opt->size(0) == N &&
                  bias_opt->scalar_type() == at::kFloat, "bias: [N] float32");
      b = bias_opt->contiguous();
    }
    chunk = M == 0 ? 0 : chunk_rows(M, K);  // (chunk_rows would divide by zero)
    chunks = M == 0 ? 0 : (M + chunk - 1) / chunk;
    tile_bytes = packed.size(1) * packed.size(2) * int64_t(packed.element_size());
    lines = tile_bytes / 64;
    x = xt.data_ptr<float>(), w = packed.data_ptr();
    bias = b.defined() ? b.data_ptr<float>() : nullptr;
  }

  template <typename T>
  const T* tile(int64_t t) const {
    return reinterpret_cast<const T*>(static_cast<const char*>(w) + t * tile_bytes);
  }
  int64_t blocks(int64_t m0, int64_t m1) const { return (m1 - m0 + kRows - 1) / kRows; }
  // A thread takes this many items at a time (see kGrainTiles); one block: no prefetch. In a
  // step of one chunk (decode) the threads share a few dozen tiles, and whoever takes the
  // last run of kGrainTiles keeps the others waiting (o_proj's 18 tiles went 10 / 8): the
  // largest run up to kGrainTiles that shares them most evenly when the threads take turns.
  int64_t grain(int64_t tiles_per_item) const {
    if (std::min(M, chunk) <= kRows) return 1;
    const int64_t most = std::max<int64_t>(kGrainTiles / tiles_per_item, 1);
    return chunks > 1 ? most : even_run(tiles / tiles_per_item, threads, most);
  }
};

// f(W()) for the packed weight's element type W: float, at::BFloat16, at::Half, or a GGUF block
// format
template <typename F>
void by_storage(Storage storage, const F& f) {
  switch (storage) {
    case Storage::kFloat: return f(float());
    case Storage::kBFloat16: return f(at::BFloat16());
    case Storage::kFloat16: return f(at::Half());
    case Storage::kQ4_1: return f(gguf_blocks::Q4_1());
    case Storage::kQ8_0: return f(gguf_blocks::Q8_0());
  }
}

// This thread's float32 tile to widen GGUF blocks into (slot: the gate's or the up's)
float* wide_tile(int slot, int64_t K) {
  thread_local std::vector<float> wide[2];
  if (int64_t(wide[slot].size()) < K * kTile) wide[slot].resize(K * kTile);
  return wide[slot].data();
}

// Tile t of p (its row blocks prefetching tile `next`, where >= 0)
template <typename W>
auto tile_of(const Problem& p, int64_t t, const float* init, int64_t next, int64_t blocks, int slot) {
  const void* after = next >= 0 ? p.tile<char>(next) : nullptr;
  if constexpr (std::is_same_v<W, float> || std::is_same_v<W, at::BFloat16> ||
                std::is_same_v<W, at::Half>)
    return Tile<W>(p.tile<W>(t), init, after, blocks, p.lines);
  else
    return BlocksTile<W>(p.tile<uint8_t>(t), init, after, blocks, p.lines, p.K,
                         wide_tile(slot, p.K), p.M <= kQRegisterRows);
}

// The item this thread runs after `item` of its run [begin, end) of `items` (-1: none): the
// next of the run, else a guess, the first of its next run if the threads take runs in turn.
// Its tile is prefetched while this one's later row blocks run. Without the guess each run's
// first tile was read at the memory's pace: a decode step's runs are a few tiles, and one
// thread's run per thread instead (no guess needed) was as fast but lets a thread that loses
// its core hold up half the op (docs/performance.md, CPU: 100 rows 6% faster, 2,048 level).
// A wrong guess costs a prefetch the thread does not use.
int64_t next_item(int64_t item, int64_t begin, int64_t end, int64_t items, int64_t threads) {
  if (item + 1 < end) return item + 1;
  const int64_t guess = item + 1 + (threads - 1) * (end - begin);
  return guess < items ? guess : -1;
}

template <typename W>
void linear(const Problem& p, int64_t N, float* op) {
  // Work items are (row chunk, tile) pairs, chunk-major, so a thread's run of items is
  // consecutive tiles of one chunk (why chunks and runs: the constants above). Within a chunk
  // the rows go in blocks of kRows. (Chunks of k that every block ran before the next chunk,
  // to read each weight from L1, were slower: 0.7-0.9x.)
  pool::parallel_for(0, p.chunks * p.tiles, p.grain(1), [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = item % p.tiles, m0 = item / p.tiles * p.chunk;
      const int64_t m1 = std::min(p.M, m0 + p.chunk), cols = std::min(kTile, N - t * kTile);
      const float* init = p.bias == nullptr ? nullptr : p.bias + t * kTile;
      float padded[kTile];  // the last tile's bias, read as whole vectors
      if (init != nullptr && cols < kTile) {
        std::fill(std::copy(init, init + cols, padded), padded + kTile, 0.f);
        init = padded;
      }
      const int64_t blocks = p.blocks(m0, m1);
      const int64_t next = blocks > 1 ? next_item(item, begin, end, p.chunks * p.tiles, p.threads) : -1;
      const auto tile = tile_of<W>(p, t, init, next < 0 ? -1 : next % p.tiles, blocks, 0);
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t m = m0 + b * kRows;
        tile.block(b, std::min(kRows, m1 - m), p.x + m * p.ldx, p.ldx, p.K, op + m * N + t * kTile,
                   N, cols);
      }
    }
  });
}

template <typename W>
void linear_silu(const Problem& p, int64_t I, float* op) {
  const int64_t pairs = p.tiles / 2;  // gate tile t and up tile t + pairs: columns t and I + t
  // As linear, an item a pair of tiles; each row block runs its gate tile, then its up tile,
  // into registers' worth of scratch, and leaves as silu(gate) * up: the [M, 2 I] output and
  // silu_and_mul's pass over it are never written (docs/performance.md, CPU).
  pool::parallel_for(0, p.chunks * pairs, p.grain(2), [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = item % pairs, u = t + pairs, m0 = item / pairs * p.chunk;
      const int64_t m1 = std::min(p.M, m0 + p.chunk), blocks = p.blocks(m0, m1);
      const int64_t next = blocks > 1 ? next_item(item, begin, end, p.chunks * pairs, p.threads) : -1;
      const float* gate_bias = p.bias == nullptr ? nullptr : p.bias + t * kTile;
      const float* up_bias = p.bias == nullptr ? nullptr : p.bias + u * kTile;
      const auto gate = tile_of<W>(p, t, gate_bias, next < 0 ? -1 : next % pairs, blocks, 0);
      const auto up = tile_of<W>(p, u, up_bias, next < 0 ? -1 : next % pairs + pairs, blocks, 1);
      alignas(64) float g[kRows * kTile], v[kRows * kTile];
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t m = m0 + b * kRows, rows = std::min(kRows, m1 - m);
        const float* xb = p.x + m * p.ldx;
        gate.block(b, rows, xb, p.ldx, p.K, g, kTile, kTile);
        up.block(b, rows, xb, p.ldx, p.K, v, kTile, kTile);
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t j = 0; j < kTile; j += Vec::size())
            cpu_ops::silu_mul(Vec::loadu(g + r * kTile + j), Vec::loadu(v + r * kTile + j))
                .store(op + (m + r) * I + t * kTile + j);
      }
    }
  });
}

}  // namespace

at::Tensor cpu_ops::packed_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                                 const c10::optional<at::Tensor>& bias) {
  const Problem p(x, packed, N, bias);
  at::Tensor out = at::empty({p.M, N}, x.options());
  by_storage(p.storage, [&](auto w) { linear<decltype(w)>(p, N, out.data_ptr<float>()); });
  return out;
}

at::Tensor cpu_ops::packed_linear_silu(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                                      const c10::optional<at::Tensor>& bias) {
  const int64_t I = N / 2;
  TORCH_CHECK(N % 2 == 0, "N: the gate's and the up projection's widths, 2 x intermediate");
  if (I % kTile != 0)  // gate and up tiles would straddle: the two passes, same numbers
    return silu_and_mul(packed_linear(x, packed, N, bias));
  const Problem p(x, packed, N, bias);
  at::Tensor out = at::empty({p.M, I}, x.options());
  by_storage(p.storage, [&](auto w) { linear_silu<decltype(w)>(p, I, out.data_ptr<float>()); });
  return out;
}

TORCH_LIBRARY_FRAGMENT(flagserve_cpu, m) {
  m.def("pack_linear_weight(Tensor weight) -> Tensor");
  m.def("packed_linear(Tensor x, Tensor packed, int n, Tensor? bias) -> Tensor");
  m.def("packed_linear_silu(Tensor x, Tensor packed, int n, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(flagserve_cpu, CPU, m) {
  m.impl("pack_linear_weight", &pack_linear_weight);
  m.impl("packed_linear", &cpu_ops::packed_linear);
  m.impl("packed_linear_silu", &cpu_ops::packed_linear_silu);
}
