// Lazy Adam with exact catch-up (sparse_adam(catch_up=True)) and its
// application, as an XLA FFI handler for the CPU:
//   optax_sparse_adam_v1_catch_up_adam_apply
//     (p, mu, nu, keys, values, scalars, coefficients, idle, limits) -> (p, mu, nu, flags)
// Each touched row first takes the `idle` steps it sat out in the closed form
// of _catch_up.replay, from coefficients the XLA side computed per entry from
// the row's last step (the row's C_0..C_{T-1} of the series in
// z = eps / sqrt(v), then b1**idle and b2**idle), then Adam's step as
// sparse_adam.cc takes it (the XLA side records the step). A row holding an element the series does not reach
// float32 resolution for (z * limits[0] > limits[1]: tiny or zero v) is left
// as it is and flagged in every entry it has; the XLA path then takes those
// rows one idle step at a time. Tables are aliased to results.
//
//   i = 1 / sqrt(v), z = eps i, S = C_{T-1}, S = C_j - z S for j = T-2 .. 0
//   p = p + (-(m i)) S,  m = m b1**idle,  v = v b2**idle
//   then Adam's step from (m, v) and p += neg_lr step (adam_row.h).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "adam_row.h"
#include "rows.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace optax_sparse_adam {
namespace {

constexpr int64_t kTerms = 8;  // _catch_up._TERMS
constexpr int64_t kCoefficients = kTerms + 2;

// The row's idle steps in closed form, in place, where the series takes every element of the row
// (z * binv <= ratio, as the XLA path tests it; false for NaN); false, and nothing written, where it does not.
// `work` holds 2 * width floats.
inline bool CatchUpRow(const float* __restrict c, float eps, float binv, float ratio, float* __restrict p,
                       float* __restrict m, float* __restrict v, float* __restrict work, int64_t width) {
  float* __restrict inv = work;
  float* __restrict z = work + width;
  bool takes = true;
  for (int64_t j = 0; j < width; ++j) {
    inv[j] = 1.0f / std::sqrt(v[j]);
    z[j] = eps * inv[j];
    takes &= z[j] * binv <= ratio;
  }
  if (!takes) return false;
  const float decay1 = c[kTerms], decay2 = c[kTerms + 1];
  for (int64_t j = 0; j < width; ++j) {
    float series = c[kTerms - 1];
    for (int64_t i = kTerms - 2; i >= 0; --i) series = c[i] - z[j] * series;
    p[j] = p[j] + (-(m[j] * inv[j])) * series;
    m[j] = m[j] * decay1;
    v[j] = v[j] * decay2;
  }
  return true;
}

struct CatchUp {
  const float* coefficients;  // (k, kCoefficients)
  const int32_t* idle;        // (k,)
  float binv, ratio;
  int32_t* flags;  // (k,)
};

// One row whose gradient is g, entry `slot` standing for it; returns false (nothing written) for a flagged row.
template <bool kTorch, bool kMaximize>
inline bool Row(const Scalars& s, const CatchUp& cu, int64_t slot, const float* g, float* p, float* m, float* v,
                float* work, int64_t width) {
  if (cu.idle[slot] > 0 &&
      !CatchUpRow(cu.coefficients + slot * kCoefficients, s.eps, cu.binv, cu.ratio, p, m, v, work, width)) {
    return false;
  }
  UpdateRow<kTorch, kMaximize, true>(s, g, m, v, p, width);
  return true;
}

template <bool kTorch, bool kMaximize>
OSA_TARGET_CLONES void CoalescedRows(const Scalars& s, const CatchUp& cu, const Coalesced& c, const Shard& shard,
                                     const float* values, float* q, float* m, float* v, int64_t width, int64_t lo,
                                     int64_t hi) {
  std::vector<float> g(static_cast<size_t>(width)), work(2 * static_cast<size_t>(width));
  for (int64_t d = lo; d < hi; ++d) {
    if (d + kPrefetchDistance < hi && shard.Owns(c.row[d + kPrefetchDistance])) {
      const int64_t r = shard.Local(c.row[d + kPrefetchDistance]);
      PrefetchRow(m + r * width, width);
      PrefetchRow(v + r * width, width);
      PrefetchRow(q + r * width, width);
    }
    if (!shard.Owns(c.row[d])) continue;
    const int64_t r = shard.Local(c.row[d]);
    const int32_t first = c.first[d];
    const float* row = values + static_cast<int64_t>(first) * width;
    for (int64_t j = 0; j < width; ++j) g[j] = 0.0f + row[j];
    for (int32_t e = c.next[first]; e >= 0; e = c.next[e]) {
      const float* ge = values + static_cast<int64_t>(e) * width;
      for (int64_t j = 0; j < width; ++j) g[j] += ge[j];
    }
    if (!Row<kTorch, kMaximize>(s, cu, first, g.data(), q + r * width, m + r * width, v + r * width, work.data(),
                                 width)) {
      for (int32_t e = first; e >= 0; e = c.next[e]) cu.flags[e] = 1;
    }
  }
}

template <bool kTorch, bool kMaximize>
OSA_TARGET_CLONES void UniqueRows(const Scalars& s, const CatchUp& cu, const int32_t* keys, const Shard& shard,
                                  const float* values, float* q, float* m, float* v, int64_t width, int64_t lo,
                                  int64_t hi) {
  std::vector<float> work(2 * static_cast<size_t>(width));
  for (int64_t i = lo; i < hi; ++i) {
    if (i + kPrefetchDistance < hi && shard.Owns(keys[i + kPrefetchDistance])) {
      const int64_t r = shard.Local(keys[i + kPrefetchDistance]);
      PrefetchRow(m + r * width, width);
      PrefetchRow(v + r * width, width);
      PrefetchRow(q + r * width, width);
    }
    if (!shard.Owns(keys[i])) continue;
    const int64_t r = shard.Local(keys[i]);
    if (!Row<kTorch, kMaximize>(s, cu, i, values + i * width, q + r * width, m + r * width, v + r * width,
                                 work.data(), width)) {
      cu.flags[i] = 1;
    }
  }
}

template <bool kTorch, bool kMaximize>
void Run(ffi::ThreadPool& pool, const Scalars& s, const Options& o, const CatchUp& cu, const int32_t* keys, int64_t k,
         const Shard& shard, const float* values, float* q, float* m, float* v, int64_t width) {
  if (o.unique == 2 || (o.unique == 1 && !HasDuplicate(keys, k, shard.num_rows))) {
    ParallelForOwned(pool, keys, k, shard, o.threads, [&](int64_t lo, int64_t hi) {
      UniqueRows<kTorch, kMaximize>(s, cu, keys, shard, values, q, m, v, width, lo, hi);
    });
    return;
  }
  Coalesced c;
  Coalesce(keys, k, shard.begin + shard.local_rows, shard.begin, c);
  ParallelFor(pool, c.size, std::min<int64_t>(o.threads, c.size / 32 + 1), [&](int64_t lo, int64_t hi) {
    CoalescedRows<kTorch, kMaximize>(s, cu, c, shard, values, q, m, v, width, lo, hi);
  });
}

ffi::Error ApplyImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> p, ffi::Buffer<ffi::F32> mu, ffi::Buffer<ffi::F32> nu,
                     ffi::BufferR1<ffi::S32> keys, ffi::Buffer<ffi::F32> values, ffi::BufferR1<ffi::F32> scalars,
                     ffi::BufferR2<ffi::F32> coefficients, ffi::BufferR1<ffi::S32> idle,
                     ffi::BufferR1<ffi::F32> limits, ffi::BufferR0<ffi::S32> row_begin,
                     ffi::ResultBuffer<ffi::F32> p_out, ffi::ResultBuffer<ffi::F32> mu_out,
                     ffi::ResultBuffer<ffi::F32> nu_out, ffi::ResultBufferR1<ffi::S32> flags, int64_t num_rows,
                     int64_t torch_eps, int64_t maximize, int64_t unique, int64_t threads) {
  const int64_t k = static_cast<int64_t>(keys.element_count());
  Shard shard{num_rows, *row_begin.typed_data(), 0};
  const auto dims = p.dimensions();
  if (dims.size() < 1) return ffi::Error::InvalidArgument("tables must have at least one dimension");
  shard.local_rows = dims[0];
  if (!shard.Valid()) return ffi::Error::InvalidArgument("row range outside a table of at most 2**31 - 1 rows");
  const int64_t width = RowWidth(dims);
  if (mu.element_count() != p.element_count() || nu.element_count() != p.element_count())
    return ffi::Error::InvalidArgument("mu and nu must have the parameter's shape");
  if (static_cast<int64_t>(values.element_count()) != k * width)
    return ffi::Error::InvalidArgument("values must have one row per key");
  if (static_cast<int64_t>(scalars.element_count()) != kNumScalars)
    return ffi::Error::InvalidArgument("scalars must hold 10 values");
  if (static_cast<int64_t>(coefficients.element_count()) != k * kCoefficients ||
      static_cast<int64_t>(idle.element_count()) != k || static_cast<int64_t>(flags->element_count()) != k)
    return ffi::Error::InvalidArgument("coefficients, idle and flags must have one row per key");
  if (limits.element_count() != 2) return ffi::Error::InvalidArgument("limits must hold 2 values");
  float* q = p_out->typed_data();
  float* m = mu_out->typed_data();
  float* v = nu_out->typed_data();
  CopyIfNotAliased(q, p.typed_data(), p.element_count());
  CopyIfNotAliased(m, mu.typed_data(), mu.element_count());
  CopyIfNotAliased(v, nu.typed_data(), nu.element_count());
  std::memset(flags->typed_data(), 0, sizeof(int32_t) * static_cast<size_t>(k));
  const CatchUp cu{coefficients.typed_data(), idle.typed_data(), limits.typed_data()[0], limits.typed_data()[1],
                   flags->typed_data()};
  const Scalars s = ReadScalars(scalars);
  const Options o{torch_eps != 0, maximize != 0, unique, threads};
  auto run = [&](auto torch_eps, auto maximize) {
    Run<decltype(torch_eps)::value, decltype(maximize)::value>(pool, s, o, cu, keys.typed_data(), k, shard,
                                                               values.typed_data(), q, m, v, width);
  };
  using T = std::true_type;
  using F = std::false_type;
  if (o.torch_eps) {
    o.maximize ? run(T{}, T{}) : run(T{}, F{});
  } else {
    o.maximize ? run(F{}, T{}) : run(F{}, F{});
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace optax_sparse_adam

XLA_FFI_DEFINE_HANDLER_SYMBOL(OptaxSparseAdamCatchUpApply, optax_sparse_adam::ApplyImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()     // p
                                  .Arg<ffi::Buffer<ffi::F32>>()     // mu
                                  .Arg<ffi::Buffer<ffi::F32>>()     // nu
                                  .Arg<ffi::BufferR1<ffi::S32>>()  // keys
                                  .Arg<ffi::Buffer<ffi::F32>>()     // values
                                  .Arg<ffi::BufferR1<ffi::F32>>()   // scalars
                                  .Arg<ffi::BufferR2<ffi::F32>>()   // coefficients: per key
                                  .Arg<ffi::BufferR1<ffi::S32>>()  // idle: per key
                                  .Arg<ffi::BufferR1<ffi::F32>>()   // limits: binv, ratio
                                  .Arg<ffi::BufferR0<ffi::S32>>()   // row_begin: first row held
                                  .Ret<ffi::Buffer<ffi::F32>>()     // p
                                  .Ret<ffi::Buffer<ffi::F32>>()     // mu
                                  .Ret<ffi::Buffer<ffi::F32>>()     // nu
                                  .Ret<ffi::BufferR1<ffi::S32>>()  // flags: per key
                                  .Attr<int64_t>("num_rows")
                                  .Attr<int64_t>("torch_eps")
                                  .Attr<int64_t>("maximize")
                                  .Attr<int64_t>("unique")
                                  .Attr<int64_t>("threads"));
