// A step's decoder layers in one call (issue 16): the same kernels in the same order as the
// Python layers (flagserve/models/decoder.py, flagserve/layers/attention.py), called from C++.
//
// Between a step's kernels the Python path runs its own code and torch's dispatcher, and
// every kernel before it has just streamed megabytes of weights or KV cache through L2: that
// code runs cold, 30-100 us per op where it takes 2-10 us warm, ~12% of a 4-row decode step
// (docs/performance.md, CPU). Called from here the same kernels pay none of it. The outputs
// are the Python path's exactly (tests/test_native_layers.py).
#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <torch/library.h>

#include "cpu_ops.h"

namespace {

// Each kernel under its op's name in a torch profile, as on the Python path (a check of a
// flag when no profiler runs).
#define KERNEL(name, call) \
  [&] { RECORD_FUNCTION("flagserve_cpu::" name, std::vector<c10::IValue>()); return call; }()

constexpr int64_t kPerLayer = 8;  // weights per layer, in order (see decoder_layers)
constexpr int64_t kBiasesPerLayer = 4;

// Where the step's rows attend in the paged cache (AttentionMetadata): the first num_decodes
// rows are decodes, one per sequence; the prefill chunks follow.
struct Step {
  const at::Tensor& block_tables;
  const at::Tensor& seq_lens;
  const at::Tensor& cu_seqlens_q;
  int64_t num_decodes;
  double scale;
};

// PagedAttention.forward after the cache store: decodes and chunks each by its own kernel,
// into one output.
at::Tensor attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const Step& s) {
  const int64_t T = q.size(0), nd = s.num_decodes, B = s.seq_lens.size(0);
  const auto decode = [&](const at::Tensor& rows) {
    return KERNEL("paged_decode_attention",
                  cpu_ops::paged_decode_attention(rows, k_cache, v_cache,
                                                  s.block_tables.narrow(0, 0, nd),
                                                  s.seq_lens.narrow(0, 0, nd), s.scale));
  };
  const auto prefill = [&](const at::Tensor& rows) {
    return KERNEL("paged_prefill_attention",
                  cpu_ops::paged_prefill_attention(rows, k_cache, v_cache,
                                                   s.block_tables.narrow(0, nd, B - nd),
                                                   s.cu_seqlens_q, s.seq_lens.narrow(0, nd, B - nd),
                                                   s.scale));
  };
  if (nd == T) return decode(q);
  if (nd == 0) return prefill(q);
  at::Tensor out = at::empty(q.sizes(), q.options());
  out.narrow(0, 0, nd).copy_(decode(q.narrow(0, 0, nd)));
  out.narrow(0, nd, T - nd).copy_(prefill(q.narrow(0, nd, T - nd)));
  return out;
}

// weights, per layer: input norm, qkv (packed), o (packed), post-attention norm, gate_up
// (packed), down (packed), K cache, V cache; biases, per layer: qkv, o, gate_up, down (each
// may be None). keep: the rows the last layer returns (all when None; the others still write
// their K/V). Returns (hidden, residual) after the last layer, as DecoderLayer does.
std::tuple<at::Tensor, at::Tensor> decoder_layers(
    const at::Tensor& hidden, const c10::optional<at::Tensor>& residual_in,
    const at::Tensor& positions, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
    const at::Tensor& seq_lens, const at::Tensor& cu_seqlens_q, int64_t num_decodes,
    const c10::optional<at::Tensor>& keep, const at::Tensor& cos_sin_cache,
    at::TensorList weights, const c10::List<c10::optional<at::Tensor>>& biases,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t intermediate, double eps,
    double scale) {
  TORCH_CHECK(weights.size() % kPerLayer == 0 &&
              biases.size() == weights.size() / kPerLayer * kBiasesPerLayer,
              "decoder_layers: 8 weights and 4 biases per layer");
  const Step step{block_tables, seq_lens, cu_seqlens_q, num_decodes, scale};
  const int64_t T = hidden.size(0), H = hidden.size(1), layers = weights.size() / kPerLayer;
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  at::Tensor h = hidden;
  at::Tensor residual = residual_in.has_value() ? *residual_in : at::Tensor();
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor* w = weights.data() + l * kPerLayer;
    const auto bias = [&](int64_t i) { return biases.get(l * kBiasesPerLayer + i); };
    at::Tensor x;
    if (residual.defined()) {
      std::tie(x, residual) =
          KERNEL("fused_add_rms_norm", cpu_ops::fused_add_rms_norm(h, residual, w[0], eps));
    } else {
      x = KERNEL("rms_norm", cpu_ops::rms_norm(h, w[0], eps));
      residual = h;
    }
    at::Tensor qkv =
        KERNEL("packed_linear", cpu_ops::packed_linear(x, w[1], q_size + 2 * kv_size, bias(0)));
    at::Tensor q = qkv.narrow(1, 0, q_size).view({T, num_heads, head_dim});
    at::Tensor k = qkv.narrow(1, q_size, kv_size).view({T, num_kv_heads, head_dim});
    at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({T, num_kv_heads, head_dim});
    KERNEL("rotary_store_kvcache", cpu_ops::rotary_store_kvcache(positions, q, k, v, w[6], w[7],
                                                                 slot_mapping, cos_sin_cache));
    at::Tensor attn = attention(q, w[6], w[7], step);
    if (keep.has_value() && l == layers - 1) {
      attn = attn.index_select(0, *keep);
      residual = residual.index_select(0, *keep);
    }
    h = KERNEL("packed_linear",
               cpu_ops::packed_linear(attn.view({attn.size(0), q_size}), w[2], H, bias(1)));
    std::tie(x, residual) =
        KERNEL("fused_add_rms_norm", cpu_ops::fused_add_rms_norm(h, residual, w[3], eps));
    at::Tensor act = KERNEL("packed_linear_silu",
                            cpu_ops::packed_linear_silu(x, w[4], 2 * intermediate, bias(2)));
    h = KERNEL("packed_linear", cpu_ops::packed_linear(act, w[5], H, bias(3)));
  }
  return {h, residual};
}

#undef KERNEL

}  // namespace

TORCH_LIBRARY_FRAGMENT(flagserve_cpu, m) {
  m.def("decoder_layers(Tensor hidden, Tensor? residual, Tensor positions, Tensor slot_mapping, "
        "Tensor block_tables, Tensor seq_lens, Tensor cu_seqlens_q, int num_decodes, "
        "Tensor? keep, Tensor cos_sin_cache, Tensor[] weights, Tensor?[] biases, int num_heads, "
        "int num_kv_heads, int head_dim, int intermediate, float eps, float scale) "
        "-> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(flagserve_cpu, CPU, m) {
  m.impl("decoder_layers", &decoder_layers);
}
