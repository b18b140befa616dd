// Setting table rows, in place, for scatter_rows' sets into 16-bit float tables:
//   optax_sparse_adam_v9_set_rows  (table, keys, values, row_begin) -> table
// table[key] = values[i] for key = keys[i], a negative key counted from the
// end (key + num_rows, as jax's indexing wraps it), the entries in order (a
// key given twice keeps its last row, as XLA:CPU's scatter leaves it); keys
// outside [0, num_rows) after that are dropped, and only the rows
// [row_begin, row_begin + table rows) are held (a row shard). Rows are copied
// as bytes, so the result is bitwise XLA's scatter. XLA:CPU itself scatters
// into a bfloat16 or float16 table by converting the whole table to float32
// and back (two passes over it and a temporary twice its size each step).
#include <cstdint>
#include <cstring>
#include <vector>

#include "rows.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace optax_sparse_adam {
namespace {

constexpr int64_t kPrefetchDistance = 16;  // rows ahead: a random row is a trip to memory

// The entries `entries[0, count)` (keys wrapped, all of rows this shard holds), in entry order.
void SetRows(const int32_t* entries, int64_t count, const int32_t* keys, const Shard& shard, const char* values,
             char* table, int64_t row_bytes) {
  for (int64_t n = 0; n < count; ++n) {
    if (n + kPrefetchDistance < count) {
      const char* ahead = table + shard.Local(keys[entries[n + kPrefetchDistance]]) * row_bytes;
      for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(ahead + b, 1);
    }
    const int64_t i = entries[n];
    std::memcpy(table + shard.Local(keys[i]) * row_bytes, values + i * row_bytes, static_cast<size_t>(row_bytes));
  }
}

ffi::Error SetRowsImpl(ffi::ThreadPool pool, ffi::AnyBuffer table, ffi::BufferR1<ffi::S32> keys,
                       ffi::AnyBuffer values, ffi::BufferR0<ffi::S32> row_begin, ffi::Result<ffi::AnyBuffer> table_out,
                       int64_t num_rows, int64_t threads) {
  auto dims = table.dimensions();
  if (dims.size() < 1) return ffi::Error::InvalidArgument("the table must have at least one dimension");
  const Shard shard{num_rows, *row_begin.typed_data(), dims[0]};
  if (!shard.Valid()) return ffi::Error::InvalidArgument("row range outside a table of at most 2**31 - 1 rows");
  if (values.element_type() != table.element_type() || table_out->element_type() != table.element_type())
    return ffi::Error::InvalidArgument("values must be of the table's dtype");
  if (ffi::ByteWidth(table.element_type()) != 2)
    return ffi::Error::InvalidArgument("set_rows takes tables of a 2-byte dtype");
  const auto k = static_cast<int64_t>(keys.element_count());
  const int64_t row_bytes = static_cast<int64_t>(RowWidth(dims)) * 2;
  if (static_cast<int64_t>(values.size_bytes()) != k * row_bytes)
    return ffi::Error::InvalidArgument("values must hold one table row per key");
  char* out = static_cast<char*>(table_out->untyped_data());
  CopyIfNotAliased(out, static_cast<const char*>(table.untyped_data()), table.size_bytes());
  std::vector<int32_t> wrapped(static_cast<size_t>(k));
  const int32_t* in = keys.typed_data();
  for (int64_t i = 0; i < k; ++i) {
    const int64_t key = in[i] < 0 ? int64_t{in[i]} + num_rows : int64_t{in[i]};
    wrapped[i] = key >= 0 && key < num_rows ? static_cast<int32_t>(key) : -1;
  }
  const char* src = static_cast<const char*>(values.untyped_data());
  ForEachKeyPart(pool, wrapped.data(), k, shard, threads, [&](const int32_t* entries, int64_t count) {
    SetRows(entries, count, wrapped.data(), shard, src, out, row_bytes);
  });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace optax_sparse_adam

XLA_FFI_DEFINE_HANDLER_SYMBOL(OptaxSparseAdamSetRows, optax_sparse_adam::SetRowsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()           // table
                                  .Arg<ffi::BufferR1<ffi::S32>>()  // keys
                                  .Arg<ffi::AnyBuffer>()           // values
                                  .Arg<ffi::BufferR0<ffi::S32>>()  // row_begin: first row held
                                  .Ret<ffi::AnyBuffer>()           // table
                                  .Attr<int64_t>("num_rows")
                                  .Attr<int64_t>("threads"));
