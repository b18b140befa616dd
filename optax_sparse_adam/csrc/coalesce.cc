// Summing a batch's duplicate keys, and finding its distinct keys, as XLA FFI handlers for the CPU:
//   optax_sparse_adam_v9_coalesce          (keys, values) -> (keys, values)
//   optax_sparse_adam_v9_coalesce_squares  (keys, values) -> (keys, values, sum of squares)
//   optax_sparse_adam_v9_sum_squares       (keys, values) -> sum of squares
//   optax_sparse_adam_v9_distinct          (keys) -> (keys, inverse)
// Each distinct key in [0, num_rows) once, in order of first occurrence, in
// the leading slots, its entries' values summed from 0 in entry order (the
// order of XLA's scatter-add, so each sum is bitwise the XLA path's); the
// slots after the last distinct key hold the padding key num_rows and zeros.
// The XLA path (_coalesce.pack_distinct) packs the same keys and sums in
// another slot order. `distinct` packs the keys alike (for the lookups,
// _row_grad.distinct_ids) and gives each entry its key's slot, the last slot
// (k - 1) for a padding entry. `coalesce_squares` also returns the sum of
// the squares of the summed values (sparse_aware's global-norm clipping: a
// fused optimizer kernel then clips the summed rows itself): each row's
// squares summed in double, eight lanes of elements apart, the rows' sums
// added in slot order in double (so the result does not depend on the
// threads), rounded once to float32. `sum_squares` is that sum alone, bitwise,
// without writing the summed values (where a fused optimizer kernel sums the
// rows again and clips them as it reads them); given `unique` (keys the library
// made distinct, or the user promised are), it takes each entry as its own row
// without coalescing, as the XLA side takes such a leaf's norm (rows.h's
// EntrySquares: the same sum, bitwise, where the keys are distinct; a promise
// is not checked here, as the XLA side does not check it for the norm).
#include <cstdint>
#include <cstring>
#include <vector>

#include "rows.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace optax_sparse_adam {
namespace {

// The distinct keys [lo, hi) of a coalesced batch (or part of one): each one's entries summed into its slot
// (Coalesced::Slot); with `squares`, each slot's sum of squares.
OSA_TARGET_CLONES void SumRows(const Coalesced& c, const float* values, float* out, double* squares, int64_t width,
                               int64_t lo, int64_t hi) {
  for (int64_t d = lo; d < hi; ++d) {
    float* __restrict row = out + c.Slot(d) * width;
    const float* first = values + static_cast<int64_t>(c.first[d]) * width;
    for (int64_t j = 0; j < width; ++j) row[j] = 0.0f + first[j];
    for (int32_t e = c.next[c.first[d]]; e >= 0; e = c.next[e]) {
      const float* __restrict u = values + static_cast<int64_t>(e) * width;
      for (int64_t j = 0; j < width; ++j) row[j] = row[j] + u[j];
    }
    if (squares != nullptr) squares[c.Slot(d)] = RowSquares(row, width);
  }
}

// Checks a batch of k keys with their values (one row each) for a table of num_rows rows; sets the row width.
ffi::Error CheckBatch(int64_t k, ffi::Span<const int64_t> dims, int64_t num_rows, int64_t& width) {
  if (num_rows < 0 || num_rows > INT32_MAX) return ffi::Error::InvalidArgument("at most 2**31 - 1 rows");
  if (dims.size() < 1 || dims[0] != k) return ffi::Error::InvalidArgument("values must have one row per key");
  width = RowWidth(dims);
  return ffi::Error::Success();
}

// Coalesces (keys, values) into (keys_out, values_out); with `sum_of_squares`, also the sum of their squares.
ffi::Error CoalesceInto(ffi::ThreadPool& pool, ffi::BufferR1<ffi::S32> keys, ffi::Buffer<ffi::F32> values,
                        ffi::ResultBufferR1<ffi::S32>& keys_out, ffi::ResultBuffer<ffi::F32>& values_out,
                        float* sum_of_squares, int64_t num_rows, int64_t threads) {
  const auto k = static_cast<int64_t>(keys.element_count());
  int64_t width = 0;
  if (ffi::Error e = CheckBatch(k, values.dimensions(), num_rows, width); e.failure()) return e;
  if (keys_out->element_count() != keys.element_count() || values_out->element_count() != values.element_count())
    return ffi::Error::InvalidArgument("results must have the shapes of keys and values");
  const auto pad = static_cast<int32_t>(num_rows);
  // The keys coalesced in parts, each part's rows summed at their slots on its thread, squares[slot] the row's sum
  // of squares (sized for every slot, before the number of distinct rows is known; only theirs are added).
  std::vector<double> squares(sum_of_squares != nullptr ? static_cast<size_t>(k) : 0);
  const int64_t size = ForEachCoalescedPartInOrder(
      pool, keys.typed_data(), k, num_rows, threads, values_out->typed_data(), width, keys_out->typed_data(), pad,
      [&](const Coalesced& c) {
        SumRows(c, values.typed_data(), values_out->typed_data(),
                sum_of_squares != nullptr ? squares.data() : nullptr, width, 0, c.size);
      });
  if (sum_of_squares != nullptr) {
    squares.resize(static_cast<size_t>(size));
    *sum_of_squares = TotalSquares(squares);
  }
  return ffi::Error::Success();
}

ffi::Error CoalesceImpl(ffi::ThreadPool pool, ffi::BufferR1<ffi::S32> keys, ffi::Buffer<ffi::F32> values,
                        ffi::ResultBufferR1<ffi::S32> keys_out, ffi::ResultBuffer<ffi::F32> values_out,
                        int64_t num_rows, int64_t threads) {
  return CoalesceInto(pool, keys, values, keys_out, values_out, nullptr, num_rows, threads);
}

ffi::Error CoalesceSquaresImpl(ffi::ThreadPool pool, ffi::BufferR1<ffi::S32> keys, ffi::Buffer<ffi::F32> values,
                               ffi::ResultBufferR1<ffi::S32> keys_out, ffi::ResultBuffer<ffi::F32> values_out,
                               ffi::ResultBufferR0<ffi::F32> sum_of_squares, int64_t num_rows, int64_t threads) {
  return CoalesceInto(pool, keys, values, keys_out, values_out, sum_of_squares->typed_data(), num_rows, threads);
}

ffi::Error SumSquaresImpl(ffi::ThreadPool pool, ffi::BufferR1<ffi::S32> keys, ffi::Buffer<ffi::F32> values,
                          ffi::ResultBufferR0<ffi::F32> sum_of_squares, int64_t num_rows, int64_t unique,
                          int64_t threads) {
  const auto k = static_cast<int64_t>(keys.element_count());
  int64_t width = 0;
  if (ffi::Error e = CheckBatch(k, values.dimensions(), num_rows, width); e.failure()) return e;
  if (unique != 0) {
    *sum_of_squares->typed_data() = EntrySquares(pool, keys.typed_data(), k, values.typed_data(), width, num_rows,
                                                 threads);
    return ffi::Error::Success();
  }
  // Each row summed as SumRows sums it (SumEntries: from 0, in entry order), then squared (SummedParts).
  *sum_of_squares->typed_data() =
      SummedParts(pool, keys.typed_data(), k, values.typed_data(), width, num_rows, threads).squares();
  return ffi::Error::Success();
}

ffi::Error DistinctImpl(ffi::BufferR1<ffi::S32> keys, ffi::ResultBufferR1<ffi::S32> keys_out,
                        ffi::ResultBufferR1<ffi::S32> inverse, int64_t num_rows) {
  const auto k = static_cast<int64_t>(keys.element_count());
  if (num_rows < 0 || num_rows > INT32_MAX) return ffi::Error::InvalidArgument("at most 2**31 - 1 rows");
  if (static_cast<int64_t>(keys_out->element_count()) != k || static_cast<int64_t>(inverse->element_count()) != k)
    return ffi::Error::InvalidArgument("results must have the shape of keys");
  // Coalesce's hashing without its chains of entries: each key's slot is all a lookup needs.
  const int32_t* in = keys.typed_data();
  int32_t* out_keys = keys_out->typed_data();
  int32_t* slot = inverse->typed_data();
  const KeySlots slots(k);
  std::vector<int64_t> table(slots.count(), -1);  // (distinct index << 32) | key, or -1 for an empty slot
  int32_t size = 0;
  for (int64_t i = 0; i < k; ++i) {
    const int32_t key = in[i];
    if (!InRange(key, num_rows)) {
      slot[i] = static_cast<int32_t>(k - 1);
      continue;
    }
    uint32_t h = slots.Home(key);
    while (table[h] >= 0 && static_cast<int32_t>(table[h] & 0xFFFFFFFF) != key) h = slots.Next(h);
    if (table[h] < 0) {
      table[h] = (int64_t{size} << 32) | static_cast<uint32_t>(key);
      out_keys[size++] = key;
    }
    slot[i] = static_cast<int32_t>(table[h] >> 32);
  }
  const auto pad = static_cast<int32_t>(num_rows);
  for (int64_t d = size; d < k; ++d) out_keys[d] = pad;
  return ffi::Error::Success();
}

}  // namespace
}  // namespace optax_sparse_adam

XLA_FFI_DEFINE_HANDLER_SYMBOL(OptaxSparseAdamCoalesce, optax_sparse_adam::CoalesceImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::BufferR1<ffi::S32>>()   // keys
                                  .Arg<ffi::Buffer<ffi::F32>>()     // values
                                  .Ret<ffi::BufferR1<ffi::S32>>()   // keys: distinct first, then padding
                                  .Ret<ffi::Buffer<ffi::F32>>()     // values summed per distinct key
                                  .Attr<int64_t>("num_rows")
                                  .Attr<int64_t>("threads"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(OptaxSparseAdamCoalesceSquares, optax_sparse_adam::CoalesceSquaresImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::BufferR1<ffi::S32>>()   // keys
                                  .Arg<ffi::Buffer<ffi::F32>>()     // values
                                  .Ret<ffi::BufferR1<ffi::S32>>()   // keys: distinct first, then padding
                                  .Ret<ffi::Buffer<ffi::F32>>()     // values summed per distinct key
                                  .Ret<ffi::BufferR0<ffi::F32>>()   // the sum of their squares
                                  .Attr<int64_t>("num_rows")
                                  .Attr<int64_t>("threads"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(OptaxSparseAdamSumSquares, optax_sparse_adam::SumSquaresImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::BufferR1<ffi::S32>>()  // keys
                                  .Arg<ffi::Buffer<ffi::F32>>()    // values
                                  .Ret<ffi::BufferR0<ffi::F32>>()  // coalesce_squares' sum of squares
                                  .Attr<int64_t>("num_rows")
                                  .Attr<int64_t>("unique")  // nonzero: each entry its own row (EntrySquares)
                                  .Attr<int64_t>("threads"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(OptaxSparseAdamDistinct, optax_sparse_adam::DistinctImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::BufferR1<ffi::S32>>()  // keys
                                  .Ret<ffi::BufferR1<ffi::S32>>()  // keys: distinct first, then padding
                                  .Ret<ffi::BufferR1<ffi::S32>>()  // inverse: each entry's slot
                                  .Attr<int64_t>("num_rows"));
