// Adam's row update, shared by the handlers of sparse_adam.cc and catch_up_adam.cc.
//
// Numerics follow what XLA:CPU compiles the XLA path to, operation by
// operation (see sparse_adam.cc).
#ifndef OPTAX_SPARSE_ADAM_CSRC_ADAM_ROW_H_
#define OPTAX_SPARSE_ADAM_CSRC_ADAM_ROW_H_

#include <cmath>
#include <cstdint>

#include "rows.h"
#include "xla/ffi/api/ffi.h"

namespace optax_sparse_adam {
namespace {

// Order of the scalars operand, as _adam.kernel_scalars stacks it.
struct Scalars {
  float b1, one_minus_b1, b2, one_minus_b2, eps, eps_root, bc1, bc2, torch_scale, neg_lr;
  float weight_decay = 0.0f;  // an eleventh scalar, for the AdamW handlers only
  const float* params = nullptr;  // the AdamW rows handler's parameters (local rows), read only
  Clip clip = {};             // two more, for the apply handlers: each summed gradient row clipped before the step
};
constexpr int64_t kNumScalars = 10;
constexpr int kPrefetchDistance = 4;

struct Options {
  bool torch_eps, maximize;
  int64_t unique;  // 0: keys may repeat; 1: distinct by the user's promise, checked; 2: known distinct
  int64_t threads;
};

// One row: m and v updated in place from the gradient row g; the step times
// neg_lr written to `out`, or with kApply added times neg_lr to the parameter row `out`
// (with kDecay, the step plus weight_decay times the parameter, as AdamW: the parameter row `p` without kApply).
// With kAmsgrad, AMSGrad's rule (optax's placement): vm, the largest
// bias-corrected v, rises to v' / bc2, and the step divides by its root.
template <bool kTorch, bool kMaximize, bool kApply, bool kDecay = false, bool kAmsgrad = false>
OSA_ROW_INLINE void UpdateRow(const Scalars& s, const float* __restrict g, float* __restrict m, float* __restrict v,
                              float* __restrict out, int64_t width, float* __restrict vm = nullptr,
                              const float* __restrict p = nullptr) {
  // Locals, not loads through `s`: the rows written might alias it, which
  // would keep the compiler from vectorizing the loop.
  const float b1 = s.b1, one_minus_b1 = s.one_minus_b1, b2 = s.b2, one_minus_b2 = s.one_minus_b2;
  const float eps = s.eps, eps_root = s.eps_root, torch_scale = s.torch_scale, neg_lr = s.neg_lr;
  const float weight_decay = s.weight_decay;
  const float inv_bc1 = 1.0f / s.bc1;
  const float inv_bc2 = 1.0f / s.bc2;
  for (int64_t j = 0; j < width; ++j) {
    const float gj = g[j];
    const float mn = kMaximize ? std::fma(b1, m[j], -(one_minus_b1 * gj)) : std::fma(one_minus_b1, gj, b1 * m[j]);
    const float vn = std::fma(one_minus_b2, gj * gj, b2 * v[j]);
    float step;
    if constexpr (kAmsgrad) {
      // XLA's maximum: NaN if either is.
      const float vc = vn * inv_bc2, old = vm[j];
      const float vmn = (old >= vc || std::isnan(old)) ? old : vc;
      vm[j] = vmn;
      step = (mn * inv_bc1) / (std::sqrt(vmn + eps_root) + eps);
    } else if constexpr (kTorch) {
      step = (torch_scale * mn) / (std::sqrt(vn + eps_root) + eps);
    } else {
      step = (mn * inv_bc1) / (std::sqrt(vn * inv_bc2 + eps_root) + eps);
    }
    m[j] = mn;
    v[j] = vn;
    if constexpr (kApply && kDecay) {
      out[j] = out[j] + neg_lr * std::fma(weight_decay, out[j], step);
    } else if constexpr (kApply) {
      out[j] = out[j] + neg_lr * step;
    } else if constexpr (kDecay) {
      out[j] = neg_lr * std::fma(weight_decay, p[j], step);  // sparse_adamw's update: (step + weight_decay p) (-lr)
    } else {
      out[j] = neg_lr * step;  // the step times a scale: 1, or sparse_adam's learning rate (a product, exact at 1)
    }
  }
}

inline Scalars ReadScalars(const xla::ffi::BufferR1<xla::ffi::F32>& b) {
  const float* x = b.typed_data();
  return Scalars{x[0], x[1], x[2], x[3], x[4], x[5], x[6], x[7], x[8], x[9]};
}

}  // namespace
}  // namespace optax_sparse_adam

#endif  // OPTAX_SPARSE_ADAM_CSRC_ADAM_ROW_H_
