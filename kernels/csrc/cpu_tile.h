// The native linear's packed tile (cpu_linear.cpp): kTile output columns, stored per k as one
// row of kTile weights, read as kVecs vectors.
#pragma once

#include <ATen/ATen.h>
#include <ATen/cpu/vec/vec.h>

#include <cstdint>

namespace cpu_tile {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kVecs = 2;
constexpr int64_t kTile = kVecs * Vec::size();  // output columns per packed tile: 32 or 16

// Vec::size() float16 values at p as float32 (exact: every float16 is a float32, subnormals
// included)
inline Vec load_halves(const at::Half* p) {
#if defined(CPU_CAPABILITY_AVX512)
  return Vec(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
#elif defined(CPU_CAPABILITY_AVX2)
  return Vec(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else
  float wide[Vec::size()];
  for (int64_t i = 0; i < Vec::size(); ++i) wide[i] = static_cast<float>(p[i]);
  return Vec::loadu(wide);
#endif
}

}  // namespace cpu_tile
