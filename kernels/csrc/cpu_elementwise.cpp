// The elementwise ops between a CPU decoder's matmuls, each one pass over its rows
// (issue 16): RMSNorm, residual add + RMSNorm, SiLU-and-mul, and rotary + KV-cache store.
// The torch reference runs each as 5-15 separate ops, every one reading and writing the
// activations and paying torch's dispatch; here each is one call. Rows go to threads only
// past a grain that is worth waking them for (a decode batch runs on the calling thread).
// Numerics: the reference's roundings (RMSNorm in float32 then rounded, rotary rounded per
// op in the activation dtype), sums in another order.
#include <ATen/ATen.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include "cpu_ops.h"
#include "cpu_pool.h"
#include "cpu_silu.h"

#include <algorithm>
#include <cmath>
#include <tuple>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kRowGrain = 64;  // rows below this run inline, no thread wake-up

template <typename T>
inline float f(T x) { return static_cast<float>(x); }

inline float sum_squares(const float* x, int64_t n) {
  int64_t i = 0;
  Vec acc(0.f);
  for (; i + Vec::size() <= n; i += Vec::size()) {
    Vec v = Vec::loadu(x + i);
    acc = at::vec::fmadd(v, v, acc);
  }
  float s = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, acc);
  for (; i < n; ++i) s += x[i] * x[i];
  return s;
}

// out = weight * round_T(x * rsqrt(mean(x^2) + eps)), x already float32 in `xf`.
template <typename T>
inline void norm_row(const float* xf, const T* w, int64_t n, float eps, T* out) {
  const float r = 1.f / std::sqrt(sum_squares(xf, n) / n + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<T>(f(w[i]) * f(static_cast<T>(xf[i] * r)));
}

template <typename T>
void rms_norm_rows(const at::Tensor& x, const at::Tensor& res, const at::Tensor& w, double eps,
                   at::Tensor& out, at::Tensor* res_out) {
  const int64_t rows = x.size(0), n = x.size(1);
  pool::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    std::vector<float> xf(n);
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x.data_ptr<T>() + r * x.stride(0);
      if (res_out != nullptr) {
        const T* rr = res.data_ptr<T>() + r * res.stride(0);
        T* ro = res_out->data_ptr<T>() + r * n;
        for (int64_t i = 0; i < n; ++i) {
          ro[i] = static_cast<T>(f(xr[i]) + f(rr[i]));
          xf[i] = f(ro[i]);
        }
      } else {
        for (int64_t i = 0; i < n; ++i) xf[i] = f(xr[i]);
      }
      norm_row<T>(xf.data(), w.data_ptr<T>(), n, static_cast<float>(eps), out.data_ptr<T>() + r * n);
    }
  });
}

void check_rows(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x: [rows, hidden], rows contiguous");
  TORCH_CHECK(w.dim() == 1 && w.is_contiguous() && w.size(0) == x.size(1) &&
              w.scalar_type() == x.scalar_type(), "weight: [hidden], the activations' dtype");
}

template <typename T>
void silu_mul_rows(const at::Tensor& x, at::Tensor& out) {
  const int64_t rows = x.size(0), half = x.size(1) / 2;
  pool::parallel_for(0, rows, kRowGrain / 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = x.data_ptr<T>() + r * x.stride(0);
      const T* u = g + half;
      T* o = out.data_ptr<T>() + r * half;
      int64_t i = 0;
      if constexpr (std::is_same_v<T, float>) {
        for (; i + Vec::size() <= half; i += Vec::size())
          cpu_ops::silu_mul(Vec::loadu(g + i), Vec::loadu(u + i)).store(o + i);
      }
      // 16-bit: silu rounded to T before the product, as the reference's two ops.
      for (; i < half; ++i) o[i] = static_cast<T>(f(static_cast<T>(f(g[i]) / (1.f + std::exp(-f(g[i]))))) * f(u[i]));
    }
  });
}

// Neox rotary of one head in place: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin). Every
// product and sum rounded to T, as the reference's separate 16-bit ops (no-ops for float).
template <typename T>
inline T r(float x) { return static_cast<T>(x); }

template <typename T>
inline void rotate(T* x, const float* cos, const float* sin, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = f(x[i]), x2 = f(x[i + half]), c = f(r<T>(cos[i])), s = f(r<T>(sin[i]));
    x[i] = r<T>(f(r<T>(x1 * c)) - f(r<T>(x2 * s)));
    x[i + half] = r<T>(f(r<T>(x2 * c)) + f(r<T>(x1 * s)));
  }
}

template <typename T>
void rotary_store_rows(const at::Tensor& pos, at::Tensor& q, at::Tensor& k, const at::Tensor& v,
                       at::Tensor& kc, at::Tensor& vc, const at::Tensor& slots, const at::Tensor& cs) {
  const int64_t tokens = q.size(0), hq = q.size(1), hkv = k.size(1), d = q.size(2), half = d / 2;
  // Pointers and strides read once: the tensors' accessors are calls the loops cannot hoist.
  const int64_t* pp = pos.data_ptr<int64_t>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const float* csp = cs.data_ptr<float>();
  T *qp = q.data_ptr<T>(), *kp = k.data_ptr<T>(), *kcp = kc.data_ptr<T>(), *vcp = vc.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), ks0 = k.stride(0), ks1 = k.stride(1);
  const int64_t vs0 = v.stride(0), vs1 = v.stride(1), cs_stride = cs.stride(0);
  const int64_t block_size = kc.size(1), block_stride = kc.stride(0), slot_stride = kc.stride(1);
  pool::parallel_for(0, tokens, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* cos = csp + pp[t] * cs_stride;
      const float* sin = cos + half;
      T* qt = qp + t * qs0;
      T* kt = kp + t * ks0;
      for (int64_t h = 0; h < hq; ++h) rotate<T>(qt + h * qs1, cos, sin, half);
      for (int64_t h = 0; h < hkv; ++h) rotate<T>(kt + h * ks1, cos, sin, half);
      if (sp[t] < 0) continue;  // a padding row: never written
      const int64_t off = sp[t] / block_size * block_stride + sp[t] % block_size * slot_stride;
      const T* vt = vp + t * vs0;
      for (int64_t h = 0; h < hkv; ++h) {
        std::copy(kt + h * ks1, kt + h * ks1 + d, kcp + off + h * d);
        std::copy(vt + h * vs1, vt + h * vs1 + d, vcp + off + h * d);
      }
    }
  });
}

}  // namespace

at::Tensor cpu_ops::rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, weight);
  auto out = at::empty(x.sizes(), x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_norm_rows<scalar_t>(x, x, weight, eps, out, nullptr);
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> cpu_ops::fused_add_rms_norm(const at::Tensor& x,
                                                               const at::Tensor& residual,
                                                               const at::Tensor& weight, double eps) {
  check_rows(x, weight);
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.stride(1) == 1 &&
              residual.scalar_type() == x.scalar_type(), "residual: like x");
  auto out = at::empty(x.sizes(), x.options());
  auto res_out = at::empty(x.sizes(), x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    rms_norm_rows<scalar_t>(x, residual, weight, eps, out, &res_out);
  });
  return {out, res_out};
}

at::Tensor cpu_ops::silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) % 2 == 0, "x: [rows, 2 * width]");
  auto out = at::empty({x.size(0), x.size(1) / 2}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "silu_and_mul", [&] {
    silu_mul_rows<scalar_t>(x, out);
  });
  return out;
}

void cpu_ops::rotary_store_kvcache(const at::Tensor& positions, at::Tensor q, at::Tensor k,
                                   const at::Tensor& v, at::Tensor k_cache, at::Tensor v_cache,
                                   const at::Tensor& slot_mapping, const at::Tensor& cos_sin_cache) {
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1, "heads' rows contiguous");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(positions.scalar_type() == at::kLong && slot_mapping.scalar_type() == at::kLong &&
              positions.is_contiguous() && slot_mapping.is_contiguous(), "int64 positions, slots");
  TORCH_CHECK(cos_sin_cache.scalar_type() == at::kFloat && cos_sin_cache.stride(1) == 1 &&
              cos_sin_cache.size(1) == q.size(2), "cos_sin_cache: float32 [positions, head_dim]");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "rotary_store", [&] {
    rotary_store_rows<scalar_t>(positions, q, k, v, k_cache, v_cache, slot_mapping, cos_sin_cache);
  });
}

TORCH_LIBRARY_FRAGMENT(flagserve_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("fused_add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("rotary_store_kvcache(Tensor positions, Tensor(a!) q, Tensor(b!) k, Tensor v, "
        "Tensor(c!) k_cache, Tensor(d!) v_cache, Tensor slot_mapping, Tensor cos_sin_cache) -> ()");
}

TORCH_LIBRARY_IMPL(flagserve_cpu, CPU, m) {
  m.impl("rms_norm", &cpu_ops::rms_norm);
  m.impl("fused_add_rms_norm", &cpu_ops::fused_add_rms_norm);
  m.impl("silu_and_mul", &cpu_ops::silu_and_mul);
  m.impl("rotary_store_kvcache", &cpu_ops::rotary_store_kvcache);
}
