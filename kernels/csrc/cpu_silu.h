// SiLU(g) * u on a vector of float32 lanes: silu_and_mul's formula (cpu_elementwise.cpp), and
// the gate-up linear's fused epilogue (cpu_linear.cpp), which must give the same bits.
#pragma once

#include <ATen/cpu/vec/vec.h>

namespace cpu_ops {

inline at::vec::Vectorized<float> silu_mul(const at::vec::Vectorized<float>& g,
                                           const at::vec::Vectorized<float>& u) {
  return g / (at::vec::Vectorized<float>(1.f) + g.neg().exp_u20()) * u;
}

}  // namespace cpu_ops
