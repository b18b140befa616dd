// Whether a float32 array holds only finite numbers, as an XLA FFI handler for the CPU:
//   optax_sparse_adam_v9_all_finite  (x) -> 1 where every element is finite, else 0
// (osa.apply_if_finite's check of a gradient, where XLA's reduction of
// sum(x * 0) read a batch's gradient rows on one thread). An element is not
// finite where its exponent field is all ones (rows.h's IsFinite). The
// array is split over the threads; each part ORs its elements' flags without
// branching (the loop vectorizes), and stops early only between blocks.
#include <algorithm>
#include <atomic>
#include <cstdint>

#include "rows.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace optax_sparse_adam {
namespace {

// Whether x[lo, hi) holds an infinity or a NaN, in blocks of kBlock elements (a block holding one ends it).
OSA_TARGET_CLONES bool AnyNonFinite(const float* x, int64_t lo, int64_t hi) {
  constexpr int64_t kBlock = 4096;
  for (int64_t b = lo; b < hi; b += kBlock) {
    const int64_t end = std::min(hi, b + kBlock);
    uint32_t bad = 0;
    for (int64_t i = b; i < end; ++i) bad |= static_cast<uint32_t>(!IsFinite(x[i]));
    if (bad != 0) return true;
  }
  return false;
}

ffi::Error AllFiniteImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::ResultBufferR0<ffi::S32> finite,
                         int64_t threads) {
  const auto n = static_cast<int64_t>(x.element_count());
  const float* data = x.typed_data();
  // A thread is worth its scheduling past some 64K elements (a quarter of a megabyte).
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(threads, n / 65536));
  std::atomic<bool> bad{false};
  ParallelFor(pool, n, parts, [&](int64_t lo, int64_t hi) {
    if (AnyNonFinite(data, lo, hi)) bad.store(true, std::memory_order_relaxed);
  });
  *finite->typed_data() = bad.load() ? 0 : 1;
  return ffi::Error::Success();
}

}  // namespace
}  // namespace optax_sparse_adam

XLA_FFI_DEFINE_HANDLER_SYMBOL(OptaxSparseAdamAllFinite, optax_sparse_adam::AllFiniteImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()    // x, any shape
                                  .Ret<ffi::BufferR0<ffi::S32>>()  // 1: every element finite; 0: not
                                  .Attr<int64_t>("threads"));
