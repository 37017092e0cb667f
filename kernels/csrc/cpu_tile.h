// The native linear's packed tile (cpu_linear.cpp): kTile output columns, stored per k as one
// row of kTile weights, read as kVecs vectors.
#pragma once

#include <ATen/cpu/vec/vec.h>

#include <cstdint>

namespace cpu_tile {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kVecs = 2;
constexpr int64_t kTile = kVecs * Vec::size();  // output columns per packed tile: 32 or 16

}  // namespace cpu_tile
