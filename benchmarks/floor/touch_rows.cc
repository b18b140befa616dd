// The memory floor of a sparse step, for the benchmarks only (not part of the
// library; built and registered by benchmarks/floor.py):
//   osa_bench_touch_rows  (keys, values, tables...) -> (tables...)
// reads and writes the row of every table (p and each table-shaped part of an
// optimizer's state: p, mu and nu for Adam; p and one float a row for
// row-wise Adagrad) at every in-range key, adding the gradient row (its first
// entries for a narrower table) so the work cannot be skipped, and does
// nothing else: no coalescing, no optimizer arithmetic. A step that moves
// those tables cannot cost less than this. It
// splits rows over threads as the step kernels do (rows.h, the library's
// header in optax_sparse_adam/csrc/, found on the include path).
#include <cstdint>
#include <vector>

#include "rows.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace optax_sparse_adam {
namespace {

constexpr int kPrefetchDistance = 4;

// A table the step reads and writes a row of per touched key: `width` floats a
// row (the parameter's width for p and element-wise moments, 1 for a row-wise
// accumulator or a per-row count).
struct Table {
  float* data;
  int64_t width;
};

OSA_TARGET_CLONES void TouchRows(const int32_t* entries, int64_t count, const int32_t* keys, const float* values,
                                 const std::vector<Table>& tables, int64_t width) {
  for (int64_t n = 0; n < count; ++n) {
    if (n + kPrefetchDistance < count) {
      const int64_t r = keys[entries[n + kPrefetchDistance]];
      for (const Table& t : tables) PrefetchRow(t.data + r * t.width, t.width);
    }
    const int64_t i = entries[n];
    const int64_t r = keys[i];
    const float* __restrict g = values + i * width;
    for (const Table& t : tables) {
      float* __restrict row = t.data + r * t.width;
      for (int64_t j = 0; j < t.width; ++j) row[j] += g[j];
    }
  }
}

ffi::Error TouchImpl(ffi::ThreadPool pool, ffi::BufferR1<ffi::S32> keys, ffi::Buffer<ffi::F32> values,
                     ffi::RemainingArgs ins, ffi::RemainingRets outs, int64_t threads) {
  const auto k = static_cast<int64_t>(keys.element_count());
  auto vdims = values.dimensions();
  if (vdims.size() < 1 || vdims[0] != k) return ffi::Error::InvalidArgument("values must have one row per key");
  const int64_t width = RowWidth(vdims);
  if (ins.size() != outs.size() || ins.size() == 0) return ffi::Error::InvalidArgument("one result per table");
  std::vector<Table> tables;
  int64_t num_rows = -1;
  for (size_t t = 0; t < ins.size(); ++t) {
    auto in = ins.get<ffi::Buffer<ffi::F32>>(t);
    auto out = outs.get<ffi::Buffer<ffi::F32>>(t);
    if (in.has_error()) return in.error();
    if (out.has_error()) return out.error();
    auto dims = in->dimensions();
    if (dims.size() < 1) return ffi::Error::InvalidArgument("tables must have at least one dimension");
    if (num_rows >= 0 && dims[0] != num_rows) return ffi::Error::InvalidArgument("tables must have one row count");
    num_rows = dims[0];
    const int64_t w = RowWidth(dims);
    if (w > width) return ffi::Error::InvalidArgument("a table row is wider than the gradient rows");
    CopyIfNotAliased((*out)->typed_data(), in->typed_data(), in->element_count());
    tables.push_back(Table{(*out)->typed_data(), w});
  }
  const int32_t* key = keys.typed_data();
  ForEachKeyPart(pool, key, k, Shard{num_rows, 0, num_rows}, threads, [&](const int32_t* entries, int64_t count) {
    TouchRows(entries, count, key, values.typed_data(), tables, width);
  });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace optax_sparse_adam

XLA_FFI_DEFINE_HANDLER_SYMBOL(OptaxSparseAdamTouchRows, optax_sparse_adam::TouchImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::BufferR1<ffi::S32>>()  // keys
                                  .Arg<ffi::Buffer<ffi::F32>>()     // values
                                  .RemainingArgs()                  // the tables
                                  .RemainingRets()                  // the tables, updated
                                  .Attr<int64_t>("threads"));
