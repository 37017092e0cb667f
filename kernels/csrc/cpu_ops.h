// The native CPU kernels as C++ calls, for kernels that run others (cpu_decoder_layers.cpp)
// without a trip through Python and torch's dispatcher. Each is the registered op's own
// function (defined beside it, same checks, same numerics).
#pragma once

#include <ATen/ATen.h>

#include <tuple>

namespace cpu_ops {

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                         const c10::optional<at::Tensor>& bias);
// silu_and_mul(packed_linear(x, packed, n, bias)) for a gate-up weight [gate; up], n = 2 x
// intermediate: the same bits, in one pass where the intermediate is whole tiles.
at::Tensor packed_linear_silu(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                              const c10::optional<at::Tensor>& bias);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                      const at::Tensor& weight, double eps);
at::Tensor silu_and_mul(const at::Tensor& x);
void rotary_store_kvcache(const at::Tensor& positions, at::Tensor q, at::Tensor k,
                          const at::Tensor& v, at::Tensor k_cache, at::Tensor v_cache,
                          const at::Tensor& slot_mapping, const at::Tensor& cos_sin_cache);
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& block_tables,
                                  const at::Tensor& seq_lens, double scale);
at::Tensor paged_prefill_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                   const at::Tensor& v_cache, const at::Tensor& block_tables,
                                   const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens,
                                   double scale);

}  // namespace cpu_ops
