// GGUF's block-quantized weights in the native linear's tiles (cpu_linear.cpp).
//
// A GGUF block holds kBlock consecutive k of one output column as small integers q and
// float16 scales. Packed per tile and block: the tile's kTile scales (d, then m where the
// format has one), then a row of F::kRow bytes per k. A format's `row` widens one such row to
// float32 exactly as gguf's numpy dequantizes it, so the outputs are float32's bit for bit
// (tests/kernels/test_cpu_linear.py). Which weights hold such values:
// flagserve/layers/cpu_quantized.py.
#pragma once

#include <ATen/ATen.h>

#include "cpu_tile.h"

namespace gguf_blocks {

using cpu_tile::kTile;
using cpu_tile::kVecs;
using cpu_tile::Vec;

constexpr int64_t kBlock = 32;  // k per block
constexpr int64_t kHalves = kTile * int64_t(sizeof(at::Half));  // a float16 per column

// kTile float16 values at p as float32 at out
inline void load_halves(const uint8_t* p, float* out) {
  for (int64_t j = 0; j < kVecs; ++j)
    cpu_tile::load_halves(reinterpret_cast<const at::Half*>(p) + j * Vec::size())
        .store(out + j * Vec::size());
}

// Vec::size() integers from Vec::size() bytes at p: unsigned (Q4_1's pairs of nibbles) or
// signed (Q8_0's q)
template <bool Signed>
inline Vec load_bytes(const uint8_t* p, int shift = 0, int mask = 255) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  __m512i v = Signed ? _mm512_cvtepi8_epi32(raw) : _mm512_cvtepu8_epi32(raw);
  if (shift != 0) v = _mm512_srli_epi32(v, shift);
  if (mask != 255) v = _mm512_and_si512(v, _mm512_set1_epi32(mask));
  return Vec(_mm512_cvtepi32_ps(v));
#elif defined(CPU_CAPABILITY_AVX2)
  const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  __m256i v = Signed ? _mm256_cvtepi8_epi32(raw) : _mm256_cvtepu8_epi32(raw);
  if (shift != 0) v = _mm256_srli_epi32(v, shift);
  if (mask != 255) v = _mm256_and_si256(v, _mm256_set1_epi32(mask));
  return Vec(_mm256_cvtepi32_ps(v));
#else
  float wide[Vec::size()];
  for (int64_t i = 0; i < Vec::size(); ++i)
    wide[i] = Signed ? float(int8_t(p[i])) : float((p[i] >> shift) & mask);
  return Vec::loadu(wide);
#endif
}

// Q4_1: w = d * q + m, q in [0, 16). Byte i of a row holds column i in its low nibble and
// column Vec::size() + i in its high one. gguf rounds the product and then the sum; one FMA
// is the same number, as a float16 (11 significant bits) times 4 bits is exact in float32.
struct Q4_1 {
  static constexpr int64_t kScales = 2, kRow = kTile / 2;
  static void row(const uint8_t* q, const float* d, const float* m, Vec* wv) {
    static_assert(kVecs == 2, "two columns a byte");
    const int64_t V = Vec::size();
    wv[0] = at::vec::fmadd(Vec::loadu(d), load_bytes<false>(q, 0, 15), Vec::loadu(m));
    wv[1] = at::vec::fmadd(Vec::loadu(d + V), load_bytes<false>(q, 4), Vec::loadu(m + V));
  }
};

// Q8_0: w = d * q, q an int8 (exact in float32: 11 significant bits times 8). A row holds the
// columns in order.
struct Q8_0 {
  static constexpr int64_t kScales = 1, kRow = kTile;
  static void row(const uint8_t* q, const float* d, const float*, Vec* wv) {
    for (int64_t j = 0; j < kVecs; ++j)
      wv[j] = Vec::loadu(d + j * Vec::size()) * load_bytes<true>(q + j * Vec::size());
  }
};

template <typename F>
constexpr int64_t kBytes = F::kScales * kHalves + kBlock * F::kRow;  // per tile and block

// A block's scales as float32, kTile each (m only where F has one)
template <typename F>
inline void load_scales(const uint8_t* w, float* d, float* m) {
  load_halves(w, d);
  if constexpr (F::kScales == 2) load_halves(w + kHalves, m);
}

// Q4_1 blocks (q [N, K] uint8 in [0, 16); d, m [N, K / kBlock] float16) -> [ceil(N / kTile),
// K / kBlock, kBytes<Q4_1>] uint8, the columns past N zero.
at::Tensor pack_q4_1(const at::Tensor& q, const at::Tensor& d, const at::Tensor& m);
// Q8_0 blocks (q [N, K] int8; d [N, K / kBlock] float16) -> [ceil(N / kTile), K / kBlock,
// kBytes<Q8_0>] uint8, the columns past N zero.
at::Tensor pack_q8_0(const at::Tensor& q, const at::Tensor& d);

}  // namespace gguf_blocks
