// The memory floor of a sparse step, for the benchmarks only (not part of the
// library; built and registered by benchmarks/floor.py):
//   osa_bench_touch_rows  (p, mu, nu, keys, values) -> (p, mu, nu)
// reads and writes the row of p, mu and nu of every in-range key (adding the
// gradient row, so the work cannot be skipped) and does nothing else: no
// coalescing, no Adam arithmetic. A step cannot cost less than this. It
// splits rows over threads as the step kernels do (rows.h, the library's
// header in optax_sparse_adam/csrc/, found on the include path).
#include <cstdint>

#include "rows.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace optax_sparse_adam {
namespace {

constexpr int kPrefetchDistance = 4;

OSA_TARGET_CLONES void TouchRows(const int32_t* entries, int64_t count, const int32_t* keys, const float* values,
                                 float* p, float* m, float* v, int64_t width) {
  for (int64_t n = 0; n < count; ++n) {
    if (n + kPrefetchDistance < count) {
      const int64_t r = keys[entries[n + kPrefetchDistance]];
      PrefetchRow(p + r * width, width);
      PrefetchRow(m + r * width, width);
      PrefetchRow(v + r * width, width);
    }
    const int64_t i = entries[n];
    const int64_t r = keys[i];
    const float* __restrict g = values + i * width;
    float* __restrict pr = p + r * width;
    float* __restrict mr = m + r * width;
    float* __restrict vr = v + r * width;
    for (int64_t j = 0; j < width; ++j) {
      pr[j] += g[j];
      mr[j] += g[j];
      vr[j] += g[j];
    }
  }
}

ffi::Error TouchImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> p, ffi::Buffer<ffi::F32> mu, ffi::Buffer<ffi::F32> nu,
                     ffi::BufferR1<ffi::S32> keys, ffi::Buffer<ffi::F32> values, ffi::ResultBuffer<ffi::F32> p_out,
                     ffi::ResultBuffer<ffi::F32> mu_out, ffi::ResultBuffer<ffi::F32> nu_out, int64_t threads) {
  auto dims = p.dimensions();
  if (dims.size() < 1) return ffi::Error::InvalidArgument("tables must have at least one dimension");
  const int64_t num_rows = dims[0];
  const int64_t width = RowWidth(dims);
  const auto k = static_cast<int64_t>(keys.element_count());
  if (mu.element_count() != p.element_count() || nu.element_count() != p.element_count())
    return ffi::Error::InvalidArgument("p, mu and nu must have one shape");
  if (static_cast<int64_t>(values.element_count()) != k * width)
    return ffi::Error::InvalidArgument("values must have one row per key");
  float* outs[3] = {p_out->typed_data(), mu_out->typed_data(), nu_out->typed_data()};
  const float* ins[3] = {p.typed_data(), mu.typed_data(), nu.typed_data()};
  for (int t = 0; t < 3; ++t) CopyIfNotAliased(outs[t], ins[t], p.element_count());
  const int32_t* key = keys.typed_data();
  ForEachKeyPart(pool, key, k, Shard{num_rows, 0, num_rows}, threads, [&](const int32_t* entries, int64_t count) {
    TouchRows(entries, count, key, values.typed_data(), outs[0], outs[1], outs[2], width);
  });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace optax_sparse_adam

XLA_FFI_DEFINE_HANDLER_SYMBOL(OptaxSparseAdamTouchRows, optax_sparse_adam::TouchImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()     // p
                                  .Arg<ffi::Buffer<ffi::F32>>()     // mu
                                  .Arg<ffi::Buffer<ffi::F32>>()     // nu
                                  .Arg<ffi::BufferR1<ffi::S32>>()  // keys
                                  .Arg<ffi::Buffer<ffi::F32>>()     // values
                                  .Ret<ffi::Buffer<ffi::F32>>()     // p
                                  .Ret<ffi::Buffer<ffi::F32>>()     // mu
                                  .Ret<ffi::Buffer<ffi::F32>>()     // nu
                                  .Attr<int64_t>("threads"));
