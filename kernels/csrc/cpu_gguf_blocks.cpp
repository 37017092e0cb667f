// Packing GGUF blocks into the native linear's tiles (the layout: cpu_gguf_blocks.h).
#include <torch/library.h>

#include "cpu_gguf_blocks.h"

#include <vector>

namespace gguf_blocks {
namespace {

// [N, ...] -> [tiles, kTile, ...], zero-padded to whole tiles
at::Tensor tiled(const at::Tensor& t) {
  const int64_t N = t.size(0), tiles = (N + kTile - 1) / kTile;
  std::vector<int64_t> shape = t.sizes().vec();
  shape[0] = tiles * kTile;
  at::Tensor padded = at::zeros(shape, t.options());
  padded.narrow(0, 0, N).copy_(t);
  shape[0] = kTile;
  shape.insert(shape.begin(), tiles);
  return padded.view(shape);
}

// [N, K / kBlock] float16 -> [tiles, K / kBlock, kHalves] bytes
at::Tensor scales(const at::Tensor& s) {
  return tiled(s).transpose(1, 2).contiguous().view(at::kByte);
}

// [N, K] q -> [tiles, K / kBlock, kBlock, kTile]: per block, a row of kTile per k
at::Tensor rows(const at::Tensor& q) {
  const int64_t N = q.size(0), K = q.size(1);
  return tiled(q.view({N, K / kBlock, kBlock})).permute({0, 2, 3, 1});
}

void check(const at::Tensor& q, at::ScalarType type, const std::vector<const at::Tensor*>& s) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == type && q.size(1) % kBlock == 0,
              "q: [N, K] ", type, ", K a multiple of 32");
  for (const at::Tensor* t : s)
    TORCH_CHECK(t->dim() == 2 && t->size(0) == q.size(0) && t->size(1) == q.size(1) / kBlock &&
                t->scalar_type() == at::kHalf, "scales: [N, K / 32] float16");
}

}  // namespace

at::Tensor pack_q4_1(const at::Tensor& q, const at::Tensor& d, const at::Tensor& m) {
  check(q, at::kByte, {&d, &m});
  const at::Tensor r = rows(q);
  const at::Tensor low = r.narrow(3, 0, Vec::size()), high = r.narrow(3, Vec::size(), Vec::size());
  const at::Tensor bytes = at::bitwise_or(low, at::bitwise_left_shift(high, 4)).contiguous();
  return at::cat({scales(d), scales(m), bytes.flatten(2)}, 2);
}

at::Tensor pack_q8_0(const at::Tensor& q, const at::Tensor& d) {
  check(q, at::kChar, {&d});
  return at::cat({scales(d), rows(q).contiguous().view(at::kByte).flatten(2)}, 2);
}

}  // namespace gguf_blocks

TORCH_LIBRARY_FRAGMENT(flagserve_cpu, m) {
  m.def("pack_linear_weight_q4_1(Tensor q, Tensor d, Tensor m) -> Tensor");
  m.def("pack_linear_weight_q8_0(Tensor q, Tensor d) -> Tensor");
}

TORCH_LIBRARY_IMPL(flagserve_cpu, CPU, m) {
  m.impl("pack_linear_weight_q4_1", &gguf_blocks::pack_q4_1);
  m.impl("pack_linear_weight_q8_0", &gguf_blocks::pack_q8_0);
}
