// The memory floors of a sparse step, for the benchmarks only (not part of the
// library; built and registered by benchmarks/floor.py):
//   osa_bench_touch_rows  (keys, values, tables...) -> (tables...)
// reads and writes the row of every table (p and each table-shaped part of an
// optimizer's state: p, mu and nu for Adam; p and one float a row for
// row-wise Adagrad) at every in-range key, adding the gradient row (its first
// entries for a narrower table) so the work cannot be skipped, and does
// nothing else: no coalescing, no optimizer arithmetic. A step that moves
// those tables cannot cost less than this.
//   osa_bench_sum_touch_rows  (keys, slots, values, tables...) -> (tables...)
// is the same for a batch with duplicate ids: `keys` are its distinct ids and
// entry i of the batch is keys[slots[i]]'s (slots[i] < 0: padding), the
// grouping computed beforehand. Each thread takes a range of the keys (split
// by their entries and rows, as the library's row loop splits them), reads
// the batch's entries in order, summing those of its keys, then each table's
// row of each of its keys once, adding the sum: every entry read, every
// touched row of every table read and written once. A step on the batch moves
// those bytes too; what it costs above this is finding the grouping and the
// optimizer's arithmetic.
// They split rows over threads as the step kernels do (rows.h and row_loop.h,
// the library's headers in optax_sparse_adam/csrc/, found on the include path).
#include <algorithm>
#include <cstdint>
#include <vector>

#include "row_loop.h"
#include "rows.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace optax_sparse_adam {
namespace {

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

// The keys [lo, hi): the entries of each (slots[i] == its index) summed, in entry order, then the sum added to the
// key's row of every table.
OSA_TARGET_CLONES void SumTouchRows(const int32_t* keys, const int32_t* slots, int64_t n, const float* values,
                                    const std::vector<Table>& tables, int64_t num_rows, int64_t width, int64_t lo,
                                    int64_t hi) {
  std::vector<float> sums(static_cast<size_t>((hi - lo) * width), 0.0f);
  SumEntries(slots, n, values, width, lo, hi, sums.data());
  for (int64_t d = lo; d < hi; ++d) {
    if (d + kPrefetchDistance < hi && InRange(keys[d + kPrefetchDistance], num_rows)) {
      const int64_t r = keys[d + kPrefetchDistance];
      for (const Table& t : tables) PrefetchRow(t.data + r * t.width, t.width);
    }
    if (!InRange(keys[d], num_rows)) continue;
    const int64_t r = keys[d];
    const float* __restrict s = sums.data() + (d - lo) * width;
    for (const Table& t : tables) {
      float* __restrict row = t.data + r * t.width;
      for (int64_t c = 0; c < t.width; ++c) row[c] += s[c];
    }
  }
}

// Checks the tables (one row count, none wider than the gradient rows), copies them into the results where they
// are not aliased, and lists them; sets their row count.
ffi::Error Tables(ffi::RemainingArgs ins, ffi::RemainingRets outs, int64_t width, std::vector<Table>& tables,
                  int64_t& num_rows) {
  if (ins.size() != outs.size() || ins.size() == 0) return ffi::Error::InvalidArgument("one result per table");
  num_rows = -1;
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
  return ffi::Error::Success();
}

ffi::Error TouchImpl(ffi::ThreadPool pool, ffi::BufferR1<ffi::S32> keys, ffi::Buffer<ffi::F32> values,
                     ffi::RemainingArgs ins, ffi::RemainingRets outs, int64_t threads) {
  const auto k = static_cast<int64_t>(keys.element_count());
  auto vdims = values.dimensions();
  if (vdims.size() < 1 || vdims[0] != k) return ffi::Error::InvalidArgument("values must have one row per key");
  const int64_t width = RowWidth(vdims);
  std::vector<Table> tables;
  int64_t num_rows;
  if (ffi::Error error = Tables(ins, outs, width, tables, num_rows); error.failure()) return error;
  const int32_t* key = keys.typed_data();
  ForEachKeyPart(pool, key, k, Shard{num_rows, 0, num_rows}, threads,
                 [&](const int32_t* entries, int64_t count) {
                   TouchRows(entries, count, key, values.typed_data(), tables, width);
                 });
  return ffi::Error::Success();
}

// What reading and writing a key's rows costs beside its entries, in gradient entries read: the weight the
// library's row loops gave a row when they split a coalesced batch's rows by work (a 1e6 x 64 step with 8,192 Zipf
// ids a step was flat around it, from 8 to 24).
constexpr int64_t kRowWork = 12;

ffi::Error SumTouchImpl(ffi::ThreadPool pool, ffi::BufferR1<ffi::S32> keys, ffi::BufferR1<ffi::S32> slots,
                        ffi::Buffer<ffi::F32> values, ffi::RemainingArgs ins, ffi::RemainingRets outs,
                        int64_t threads) {
  const auto k = static_cast<int64_t>(keys.element_count());
  const auto n = static_cast<int64_t>(slots.element_count());
  auto vdims = values.dimensions();
  if (vdims.size() < 1 || vdims[0] != n) return ffi::Error::InvalidArgument("values must have one row per entry");
  const int32_t* slot = slots.typed_data();
  for (int64_t i = 0; i < n; ++i) {
    if (slot[i] < -1 || slot[i] >= k) return ffi::Error::InvalidArgument("slots must index the keys, or be -1");
  }
  const int64_t width = RowWidth(vdims);
  std::vector<Table> tables;
  int64_t num_rows;
  if (ffi::Error error = Tables(ins, outs, width, tables, num_rows); error.failure()) return error;
  // The keys split over the threads by their work (each key weighing its entries and its rows, kRowWork); the keys
  // past the last one an entry falls in are padding.
  const int32_t* key = keys.typed_data();
  int64_t size = 0;
  for (int64_t i = 0; i < n; ++i) size = std::max<int64_t>(size, slot[i] + 1);
  ParallelForSlots(pool, slot, n, size, kRowWork, threads, [&](int64_t lo, int64_t hi) {
    SumTouchRows(key, slot, n, values.typed_data(), tables, num_rows, width, lo, hi);
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(OptaxSparseAdamSumTouchRows, optax_sparse_adam::SumTouchImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::BufferR1<ffi::S32>>()  // keys: the batch's distinct ids
                                  .Arg<ffi::BufferR1<ffi::S32>>()  // slots: each entry's key, or -1
                                  .Arg<ffi::Buffer<ffi::F32>>()     // values: one row per entry
                                  .RemainingArgs()                  // the tables
                                  .RemainingRets()                  // the tables, updated
                                  .Attr<int64_t>("threads"));
