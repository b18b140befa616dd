// Scatter-add of update rows into a table, in place, for apply_updates:
//   optax_sparse_adam_v9_scatter_add  (table, keys, values, row_begin) -> table
// table[keys[i]] += values[i] in entry order (the order of XLA's scatter-add,
// so the sums are bitwise the same); keys outside [0, num_rows) are padding,
// and only the rows [row_begin, row_begin + table rows) are held (a row shard).
// Attribute `unique`: 2 for keys the library made distinct, 1 for keys the
// user promised distinct (checked: keys that repeat take the split by key),
// 0 otherwise. Distinct keys are split over the threads by position, into
// parts of about equal numbers of held rows (ParallelForOwned), with nothing
// hashed; others by key (ForEachKeyPart), so that each row is one thread's.
//   optax_sparse_adam_v9_add_rows_half  (table, keys, values, row_begin) -> table
// apply_updates' sum into a bfloat16 or float16 table: keys the library made
// distinct (the duplicates summed before), float32 update rows, each touched
// element (p + u).astype(p.dtype) as optax forms it, widened, added in
// float32 and rounded once to nearest even (rows.h's Bf16 and F16), where
// XLA:CPU gathers the rows, adds them and sets them back in three passes.
//   optax_sparse_adam_v9_add_rows_half_stochastic  (table, keys, values, seeds, row_begin) -> table
// apply_updates_stochastic's: the same sums rounded stochastically, each row's draws those of _draws (rows.h's
// HalfParams: murmur3's finalizer over the row's id and the leaf's two seeds, seeds[0] and seeds[1]; seeds[2]
// added to the ids, the draws' row offset inside shard_map).
#include <cstdint>

#include "rows.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace optax_sparse_adam {
namespace {

constexpr int kPrefetchDistance = 4;

// The entries `entries[0, count)`, all of rows this shard holds.
OSA_TARGET_CLONES void AddRows(const int32_t* entries, int64_t count, const int32_t* keys, const Shard& shard,
                               const float* values, float* table, int64_t width) {
  for (int64_t n = 0; n < count; ++n) {
    if (n + kPrefetchDistance < count)
      PrefetchRow(table + shard.Local(keys[entries[n + kPrefetchDistance]]) * width, width);
    const int64_t i = entries[n];
    float* __restrict row = table + shard.Local(keys[i]) * width;
    const float* __restrict u = values + i * width;
    for (int64_t j = 0; j < width; ++j) row[j] = row[j] + u[j];
  }
}

// float32 tables: their entries read and written as they are (the 16-bit formats are rows.h's Bf16 and F16).
struct F32Format {
  OSA_ROW_INLINE static float Widen(float x) { return x; }
  OSA_ROW_INLINE static float Nearest(float x) { return x; }
};

// The entries [lo, hi) of a batch whose keys are distinct, those of rows this shard holds, added into a table of
// format Format (entries of type T): each entry widened to float32, the update added, the sum rounded once.
template <class Format, typename T>
OSA_ROW_INLINE void AddDistinct(const int32_t* keys, const Shard& shard, const float* values, T* table,
                                int64_t width, int64_t lo, int64_t hi) {
  for (int64_t i = lo; i < hi; ++i) {
    if (i + kPrefetchDistance < hi && shard.Owns(keys[i + kPrefetchDistance]))
      PrefetchRow(table + shard.Local(keys[i + kPrefetchDistance]) * width, width);
    if (!shard.Owns(keys[i])) continue;
    T* __restrict row = table + shard.Local(keys[i]) * width;
    const float* __restrict u = values + i * width;
    for (int64_t j = 0; j < width; ++j) row[j] = Format::Nearest(Format::Widen(row[j]) + u[j]);
  }
}

OSA_TARGET_CLONES void AddRange(const int32_t* keys, const Shard& shard, const float* values, float* table,
                                int64_t width, int64_t lo, int64_t hi) {
  AddDistinct<F32Format>(keys, shard, values, table, width, lo, hi);
}

OSA_TARGET_CLONES void AddBf16Range(const int32_t* keys, const Shard& shard, const float* values, uint16_t* table,
                                    int64_t width, int64_t lo, int64_t hi) {
  AddDistinct<Bf16>(keys, shard, values, table, width, lo, hi);
}

OSA_TARGET_CLONES void AddF16Range(const int32_t* keys, const Shard& shard, const float* values, uint16_t* table,
                                   int64_t width, int64_t lo, int64_t hi) {
  AddDistinct<F16>(keys, shard, values, table, width, lo, hi);
}

// The entries [lo, hi) of a batch whose keys are distinct, those of rows this shard holds, added into a 16-bit
// table, each sum rounded once stochastically (`params`: rows.h's HalfParams, its draws by row id).
template <class Params>
OSA_ROW_INLINE void AddDistinctStochastic(const Params& params, const int32_t* keys, const Shard& shard,
                                          const float* values, uint16_t* table, int64_t width, int64_t lo,
                                          int64_t hi) {
  for (int64_t i = lo; i < hi; ++i) {
    if (i + kPrefetchDistance < hi && shard.Owns(keys[i + kPrefetchDistance]))
      PrefetchRow(table + shard.Local(keys[i + kPrefetchDistance]) * width, width);
    if (!shard.Owns(keys[i])) continue;
    const int64_t r = shard.Local(keys[i]);
    const uint32_t seed = params.RowSeed(r);
    uint16_t* __restrict row = table + r * width;
    const float* __restrict u = values + i * width;
    uint32_t draw = seed;
    for (int64_t j = 0; j < width; ++j, draw += kDrawStep) row[j] = params.Store(Params::Load(row[j]) + u[j], draw);
  }
}

OSA_TARGET_CLONES void AddBf16StochasticRange(const HalfParams<Bf16, true>& params, const int32_t* keys,
                                              const Shard& shard, const float* values, uint16_t* table, int64_t width,
                                              int64_t lo, int64_t hi) {
  AddDistinctStochastic(params, keys, shard, values, table, width, lo, hi);
}

OSA_TARGET_CLONES void AddF16StochasticRange(const HalfParams<F16, true>& params, const int32_t* keys,
                                             const Shard& shard, const float* values, uint16_t* table, int64_t width,
                                             int64_t lo, int64_t hi) {
  AddDistinctStochastic(params, keys, shard, values, table, width, lo, hi);
}

// The checks the 16-bit handlers share; the shard and the width, set.
ffi::Error CheckHalfTable(const ffi::AnyBuffer& table, ffi::Result<ffi::AnyBuffer>& table_out,
                          const ffi::BufferR1<ffi::S32>& keys, const ffi::Buffer<ffi::F32>& values,
                          const ffi::BufferR0<ffi::S32>& row_begin, int64_t num_rows, Shard& shard, int64_t& width) {
  auto dims = table.dimensions();
  if (dims.size() < 1) return ffi::Error::InvalidArgument("the table must have at least one dimension");
  shard = Shard{num_rows, *row_begin.typed_data(), dims[0]};
  if (!shard.Valid()) return ffi::Error::InvalidArgument("row range outside a table of at most 2**31 - 1 rows");
  const ffi::DataType type = table.element_type();
  if ((type != ffi::DataType::BF16 && type != ffi::DataType::F16) || table_out->element_type() != type)
    return ffi::Error::InvalidArgument("the 16-bit add kernels take bfloat16 and float16 tables");
  width = RowWidth(dims);
  if (static_cast<int64_t>(values.element_count()) != static_cast<int64_t>(keys.element_count()) * width)
    return ffi::Error::InvalidArgument("values must have one row per key");
  return ffi::Error::Success();
}

ffi::Error AddRowsHalfStochasticImpl(ffi::ThreadPool pool, ffi::AnyBuffer table, ffi::BufferR1<ffi::S32> keys,
                                     ffi::Buffer<ffi::F32> values, ffi::BufferR1<ffi::U32> seeds,
                                     ffi::BufferR0<ffi::S32> row_begin, ffi::Result<ffi::AnyBuffer> table_out,
                                     int64_t num_rows, int64_t threads) {
  Shard shard{};
  int64_t width = 0;
  if (ffi::Error e = CheckHalfTable(table, table_out, keys, values, row_begin, num_rows, shard, width); e.failure())
    return e;
  if (seeds.element_count() != 3)
    return ffi::Error::InvalidArgument("seeds must hold three values (two seeds, then the draws' row offset)");
  const auto k = static_cast<int64_t>(keys.element_count());
  auto* out = static_cast<uint16_t*>(table_out->untyped_data());
  CopyIfNotAliased(out, static_cast<const uint16_t*>(table.untyped_data()), table.element_count());
  const int32_t* key = keys.typed_data();
  const float* u = values.typed_data();
  const uint32_t* w = seeds.typed_data();
  const int64_t first_row = shard.begin + static_cast<int64_t>(w[2]);  // the id the draws give local row 0
  const bool bf16 = table.element_type() == ffi::DataType::BF16;
  // Split by position: the keys must be distinct (the caller sums their duplicates first).
  ParallelForOwned(pool, key, k, shard, threads, [&](int64_t lo, int64_t hi) {
    if (bf16) {
      AddBf16StochasticRange(HalfParams<Bf16, true>{w[0], w[1], first_row}, key, shard, u, out, width, lo, hi);
    } else {
      AddF16StochasticRange(HalfParams<F16, true>{w[0], w[1], first_row}, key, shard, u, out, width, lo, hi);
    }
  });
  return ffi::Error::Success();
}

ffi::Error AddRowsHalfImpl(ffi::ThreadPool pool, ffi::AnyBuffer table, ffi::BufferR1<ffi::S32> keys,
                           ffi::Buffer<ffi::F32> values, ffi::BufferR0<ffi::S32> row_begin,
                           ffi::Result<ffi::AnyBuffer> table_out, int64_t num_rows, int64_t threads) {
  Shard shard{};
  int64_t width = 0;
  if (ffi::Error e = CheckHalfTable(table, table_out, keys, values, row_begin, num_rows, shard, width); e.failure())
    return e;
  const ffi::DataType type = table.element_type();
  const auto k = static_cast<int64_t>(keys.element_count());
  auto* out = static_cast<uint16_t*>(table_out->untyped_data());
  CopyIfNotAliased(out, static_cast<const uint16_t*>(table.untyped_data()), table.element_count());
  const int32_t* key = keys.typed_data();
  const float* u = values.typed_data();
  // Split by position: the keys must be distinct (the caller, _apply.add_rows, sums their duplicates first).
  ParallelForOwned(pool, key, k, shard, threads, [&](int64_t lo, int64_t hi) {
    if (type == ffi::DataType::BF16) {
      AddBf16Range(key, shard, u, out, width, lo, hi);
    } else {
      AddF16Range(key, shard, u, out, width, lo, hi);
    }
  });
  return ffi::Error::Success();
}

ffi::Error ScatterAddImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> table, ffi::BufferR1<ffi::S32> keys,
                          ffi::Buffer<ffi::F32> values, ffi::BufferR0<ffi::S32> row_begin,
                          ffi::ResultBuffer<ffi::F32> table_out, int64_t num_rows, int64_t unique, int64_t threads) {
  auto dims = table.dimensions();
  if (dims.size() < 1) return ffi::Error::InvalidArgument("the table must have at least one dimension");
  const Shard shard{num_rows, *row_begin.typed_data(), dims[0]};
  if (!shard.Valid()) return ffi::Error::InvalidArgument("row range outside a table of at most 2**31 - 1 rows");
  const int64_t width = RowWidth(dims);
  const auto k = static_cast<int64_t>(keys.element_count());
  if (static_cast<int64_t>(values.element_count()) != k * width)
    return ffi::Error::InvalidArgument("values must have one row per key");
  float* out = table_out->typed_data();
  CopyIfNotAliased(out, table.typed_data(), table.element_count());
  const int32_t* key = keys.typed_data();
  if (unique == 2 || (unique == 1 && !HasDuplicate(key, k, num_rows))) {
    ParallelForOwned(pool, key, k, shard, threads, [&](int64_t lo, int64_t hi) {
      AddRange(key, shard, values.typed_data(), out, width, lo, hi);
    });
    return ffi::Error::Success();
  }
  ForEachKeyPart(pool, key, k, shard, threads, [&](const int32_t* entries, int64_t count) {
    AddRows(entries, count, key, shard, values.typed_data(), out, width);
  });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace optax_sparse_adam

XLA_FFI_DEFINE_HANDLER_SYMBOL(OptaxSparseAdamScatterAdd, optax_sparse_adam::ScatterAddImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()     // table
                                  .Arg<ffi::BufferR1<ffi::S32>>()  // keys
                                  .Arg<ffi::Buffer<ffi::F32>>()     // values
                                  .Arg<ffi::BufferR0<ffi::S32>>()   // row_begin: first row held
                                  .Ret<ffi::Buffer<ffi::F32>>()     // table
                                  .Attr<int64_t>("num_rows")
                                  .Attr<int64_t>("unique")
                                  .Attr<int64_t>("threads"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(OptaxSparseAdamAddRowsHalf, optax_sparse_adam::AddRowsHalfImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()           // table
                                  .Arg<ffi::BufferR1<ffi::S32>>()  // keys: distinct, the library's
                                  .Arg<ffi::Buffer<ffi::F32>>()    // values
                                  .Arg<ffi::BufferR0<ffi::S32>>()  // row_begin: first row held
                                  .Ret<ffi::AnyBuffer>()           // table
                                  .Attr<int64_t>("num_rows")
                                  .Attr<int64_t>("threads"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(OptaxSparseAdamAddRowsHalfStochastic, optax_sparse_adam::AddRowsHalfStochasticImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()           // table
                                  .Arg<ffi::BufferR1<ffi::S32>>()  // keys: distinct, the library's
                                  .Arg<ffi::Buffer<ffi::F32>>()    // values
                                  .Arg<ffi::BufferR1<ffi::U32>>()  // seeds: the leaf's two, the draws' row offset
                                  .Arg<ffi::BufferR0<ffi::S32>>()  // row_begin: first row held
                                  .Ret<ffi::AnyBuffer>()           // table
                                  .Attr<int64_t>("num_rows")
                                  .Attr<int64_t>("threads"));
