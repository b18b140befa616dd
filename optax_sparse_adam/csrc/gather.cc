// Gathering table rows, for take_rows (the lookups, and the row engine's reads on the XLA-path rules):
//   optax_sparse_adam_v9_gather  (table, keys, row_begin) -> rows
// rows[i] = table[key] for key = keys[i], a negative key counted from the end
// (key + num_rows, as jax's indexing wraps it); rows of keys outside
// [0, num_rows) after that, and of rows this call does not hold (a row shard
// holds rows [row_begin, row_begin + table rows)), are zeros, so that the
// shards' results sum to the whole gather. Rows are copied as bytes, so any
// dtype of whole bytes gathers bitwise as XLA's gather does (the caller keeps
// sub-byte dtypes, which XLA packs, on XLA's gather; they are refused here).
#include <cstdint>
#include <cstring>

#include "rows.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace optax_sparse_adam {
namespace {

constexpr int64_t kPrefetchDistance = 16;  // rows ahead: a random row is a trip to memory

inline int64_t Wrapped(int32_t key, int64_t num_rows) { return key < 0 ? int64_t{key} + num_rows : int64_t{key}; }

void GatherRange(const char* table, const int32_t* keys, const Shard& shard, int64_t row_bytes, char* out, int64_t lo,
                 int64_t hi) {
  for (int64_t i = lo; i < hi; ++i) {
    if (i + kPrefetchDistance < hi) {
      const int64_t ahead = Wrapped(keys[i + kPrefetchDistance], shard.num_rows);
      if (ahead >= shard.begin && ahead < shard.begin + shard.local_rows)
        for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(table + (ahead - shard.begin) * row_bytes + b);
    }
    const int64_t key = Wrapped(keys[i], shard.num_rows);
    char* dst = out + i * row_bytes;
    if (key >= shard.begin && key < shard.begin + shard.local_rows) {
      std::memcpy(dst, table + (key - shard.begin) * row_bytes, static_cast<size_t>(row_bytes));
    } else {
      std::memset(dst, 0, static_cast<size_t>(row_bytes));
    }
  }
}

ffi::Error GatherImpl(ffi::ThreadPool pool, ffi::AnyBuffer table, ffi::BufferR1<ffi::S32> keys,
                      ffi::BufferR0<ffi::S32> row_begin, ffi::Result<ffi::AnyBuffer> rows, int64_t num_rows,
                      int64_t threads) {
  auto dims = table.dimensions();
  if (dims.size() < 1) return ffi::Error::InvalidArgument("the table must have at least one dimension");
  const Shard shard{num_rows, *row_begin.typed_data(), dims[0]};
  if (!shard.Valid()) return ffi::Error::InvalidArgument("row range outside a table of at most 2**31 - 1 rows");
  if (rows->element_type() != table.element_type())
    return ffi::Error::InvalidArgument("rows must be of the table's dtype");
  switch (table.element_type()) {  // packed several to a byte, where ByteWidth counts one byte each
    case ffi::DataType::S1:
    case ffi::DataType::S2:
    case ffi::DataType::S4:
    case ffi::DataType::U1:
    case ffi::DataType::U2:
    case ffi::DataType::U4:
    case ffi::DataType::F4E2M1FN:
    case ffi::DataType::TOKEN:
      return ffi::Error::InvalidArgument("the gather copies whole bytes: no dtype narrower than a byte");
    default:
      break;
  }
  const auto k = static_cast<int64_t>(keys.element_count());
  const int64_t row_bytes = dims[0] > 0 ? static_cast<int64_t>(table.size_bytes()) / dims[0] : 0;
  if (static_cast<int64_t>(rows->size_bytes()) != k * row_bytes)
    return ffi::Error::InvalidArgument("rows must hold one table row per key");
  const char* src = static_cast<const char*>(table.untyped_data());
  char* out = static_cast<char*>(rows->untyped_data());
  // A part is worth its scheduling past a few hundred rows. The parts are claimed as threads come free, and
  // there are several per thread: a lookup's distinct ids come first and its padding after, so equal halves
  // would leave one thread every trip to memory and the other the zeros.
  const int64_t parts = std::min<int64_t>(threads > 1 ? 8 * threads : 1, k / 256 + 1);
  ParallelFor(pool, k, parts, [&](int64_t lo, int64_t hi) {
    GatherRange(src, keys.typed_data(), shard, row_bytes, out, lo, hi);
  });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace optax_sparse_adam

XLA_FFI_DEFINE_HANDLER_SYMBOL(OptaxSparseAdamGather, optax_sparse_adam::GatherImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()           // table
                                  .Arg<ffi::BufferR1<ffi::S32>>()  // keys
                                  .Arg<ffi::BufferR0<ffi::S32>>()  // row_begin: first row held
                                  .Ret<ffi::AnyBuffer>()           // rows
                                  .Attr<int64_t>("num_rows")
                                  .Attr<int64_t>("threads"));
