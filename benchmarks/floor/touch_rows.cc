// The memory floors of a sparse step, for the benchmarks only (not part of the
// library; built and registered by benchmarks/floor.py):
//   osa_bench_touch_rows  (keys, values, tables...) -> (tables...)
// reads and writes the row of every table (p and each table-shaped part of an
// optimizer's state: p, mu and nu for Adam; p and one float a row for
// row-wise Adagrad) at every in-range key, adding the gradient row (its first
// entries for a narrower table) so the work cannot be skipped, and does
// nothing else: no coalescing, no optimizer arithmetic. A step that moves
// those tables cannot cost less than this.
//   osa_bench_sum_touch_rows  (keys, offsets, order, values, tables...) -> (tables...)
// is the same for a batch with duplicate ids: `keys` are its distinct ids and
// the entries of keys[j] are values[order[offsets[j]:offsets[j + 1]]] (the
// grouping computed beforehand); it reads every entry once, summing a key's
// entries, and then each table's row of the key once, adding the sum. A step
// on the batch reads those bytes too; what it costs above this is finding the
// grouping and the optimizer's arithmetic.
// Both split rows over threads as the step kernels do (rows.h, the library's
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

// Sums each key's entries (values[order[offsets[j]:offsets[j + 1]]]) into one row, then adds it to the key's
// row of every table.
OSA_TARGET_CLONES void SumTouchRows(const int32_t* entries, int64_t count, const int32_t* keys,
                                    const int32_t* offsets, const int32_t* order, const float* values,
                                    const std::vector<Table>& tables, int64_t width) {
  std::vector<float> sum(static_cast<size_t>(width));
  for (int64_t n = 0; n < count; ++n) {
    if (n + kPrefetchDistance < count) {
      const int64_t r = keys[entries[n + kPrefetchDistance]];
      for (const Table& t : tables) PrefetchRow(t.data + r * t.width, t.width);
    }
    const int64_t j = entries[n];
    float* __restrict s = sum.data();
    for (int64_t c = 0; c < width; ++c) s[c] = 0.0f;
    for (int32_t e = offsets[j]; e < offsets[j + 1]; ++e) {
      const float* __restrict g = values + static_cast<int64_t>(order[e]) * width;
      for (int64_t c = 0; c < width; ++c) s[c] += g[c];
    }
    const int64_t r = keys[j];
    for (const Table& t : tables) {
      float* __restrict row = t.data + r * t.width;
      for (int64_t c = 0; c < t.width; ++c) row[c] += s[c];
    }
  }
}

// Checks the tables (one row count, none wider than the gradient rows), copies them into the results where they
// are not aliased, and calls `touch(entries, count, tables)` on each thread's share of the keys.
template <typename F>
ffi::Error TouchEachPart(ffi::ThreadPool& pool, ffi::BufferR1<ffi::S32> keys, ffi::RemainingArgs ins,
                         ffi::RemainingRets outs, int64_t width, int64_t threads, F touch) {
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
  const auto k = static_cast<int64_t>(keys.element_count());
  ForEachKeyPart(pool, keys.typed_data(), k, Shard{num_rows, 0, num_rows}, threads,
                 [&](const int32_t* entries, int64_t count) { touch(entries, count, tables); });
  return ffi::Error::Success();
}

ffi::Error TouchImpl(ffi::ThreadPool pool, ffi::BufferR1<ffi::S32> keys, ffi::Buffer<ffi::F32> values,
                     ffi::RemainingArgs ins, ffi::RemainingRets outs, int64_t threads) {
  const auto k = static_cast<int64_t>(keys.element_count());
  auto vdims = values.dimensions();
  if (vdims.size() < 1 || vdims[0] != k) return ffi::Error::InvalidArgument("values must have one row per key");
  const int64_t width = RowWidth(vdims);
  return TouchEachPart(pool, keys, ins, outs, width, threads,
                       [&](const int32_t* entries, int64_t count, const std::vector<Table>& tables) {
                         TouchRows(entries, count, keys.typed_data(), values.typed_data(), tables, width);
                       });
}

ffi::Error SumTouchImpl(ffi::ThreadPool pool, ffi::BufferR1<ffi::S32> keys, ffi::BufferR1<ffi::S32> offsets,
                        ffi::BufferR1<ffi::S32> order, ffi::Buffer<ffi::F32> values, ffi::RemainingArgs ins,
                        ffi::RemainingRets outs, int64_t threads) {
  const auto k = static_cast<int64_t>(keys.element_count());
  const auto n = static_cast<int64_t>(order.element_count());
  auto vdims = values.dimensions();
  if (vdims.size() < 1 || vdims[0] != n) return ffi::Error::InvalidArgument("values must have one row per entry");
  if (static_cast<int64_t>(offsets.element_count()) != k + 1)
    return ffi::Error::InvalidArgument("offsets must have one more element than keys");
  const int32_t* off = offsets.typed_data();
  const int32_t* ord = order.typed_data();
  for (int64_t j = 0; j < k; ++j) {
    if (off[j] < 0 || off[j] > off[j + 1] || off[j + 1] > n)
      return ffi::Error::InvalidArgument("offsets must rise within the entries");
  }
  for (int64_t e = 0; e < n; ++e) {
    if (ord[e] < 0 || ord[e] >= n) return ffi::Error::InvalidArgument("order must index the entries");
  }
  const int64_t width = RowWidth(vdims);
  return TouchEachPart(pool, keys, ins, outs, width, threads,
                       [&](const int32_t* entries, int64_t count, const std::vector<Table>& tables) {
                         SumTouchRows(entries, count, keys.typed_data(), off, ord, values.typed_data(), tables, width);
                       });
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(OptaxSparseAdamSumTouchRows, optax_sparse_adam::SumTouchImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::BufferR1<ffi::S32>>()  // keys: the batch's distinct ids
                                  .Arg<ffi::BufferR1<ffi::S32>>()  // offsets: keys[j]'s entries in order
                                  .Arg<ffi::BufferR1<ffi::S32>>()  // order: the entries grouped by key
                                  .Arg<ffi::Buffer<ffi::F32>>()     // values: one row per entry
                                  .RemainingArgs()                  // the tables
                                  .RemainingRets()                  // the tables, updated
                                  .Attr<int64_t>("threads"));
