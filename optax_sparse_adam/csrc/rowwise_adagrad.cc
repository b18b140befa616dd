// Lazy row-wise Adagrad on the rows a batch touches, as XLA FFI handlers for the CPU.
//
// Two handlers share one row loop:
//   optax_sparse_adam_v1_rowwise_adagrad_rows   (acc, keys, values, scalars[, p]) -> (acc, keys, step)
//     the sparse leaf rule of scale_by_rowwise_adagrad: the accumulators in
//     place, and the step rows packed as the XLA path packs them (distinct
//     keys first, padding after; with `unique`, in the entries' own slots);
//     p (the parameters) is read for L2 weight decay only;
//   optax_sparse_adam_v1_rowwise_adagrad_apply  (p, acc, keys, values, scalars) -> (p, acc)
//     the rule and p += neg_lr * step (after decoupled weight decay, in that
//     mode), touching each row of p and acc once.
// Tables are aliased to results (input_output_aliases), so under donation
// nothing table-sized is copied. Keys outside [0, num_rows) are padding.
//
// Per touched row r of width d, with the expressions XLA:CPU compiles the XLA
// path to (it contracts a product into the following add, and turns a
// division by a broadcast scalar or by the constant d into a multiplication by
// its reciprocal); build with -ffp-contract=off so that only the fused
// multiply-adds written here occur:
//   g   = ((0 + g_e1) + g_e2) + ...     over the entries of a row, in entry order
//   g   = fma(wd, p, g)                 (L2 decay)
//   S   = sum_j g_j g_j                 in the order of RowSumOfSquares
//   a'  = fma(S, 1 / d, a)              (d = 1: fma(g, g, a))
//   u   = g (1 / (sqrt(a') + eps))      (d = 1: g / (sqrt(a') + eps))
//   u   = fma(wd, p, u)                 (decoupled decay, apply only; d = 1: u + wd p)
//   p   = p + neg_lr u                  (apply only)
// XLA chooses the order of the row sum itself (a YNNPACK reduction or a loop
// of its own, by shape and CPU), so S may differ from the XLA path's by the
// rounding of a sum of d nonnegative terms; the tests bound it.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "rows.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace optax_sparse_adam {
namespace {

// Order of the scalars operand, as _rowwise.adagrad_scalars stacks it.
struct Scalars {
  float eps, weight_decay, neg_lr;
};
constexpr int64_t kNumScalars = 3;
constexpr int kPrefetchDistance = 4;

// The row functions below are inlined into the loops of OSA_TARGET_CLONES so
// that each clone vectorizes them for its own ISA (a call would reach the
// baseline build, and std::fma there is a library call).
#define OSA_ROW_INLINE inline __attribute__((always_inline))

// How weight decay enters: not at all, folded into the gradient (L2), or added
// to the step (decoupled; the apply handler only).
enum Decay : int64_t { kNoDecay = 0, kL2 = 1, kDecoupled = 2 };

struct Options {
  int64_t decay;
  int64_t unique;  // 0: keys may repeat; 1: distinct by the user's promise, checked; 2: known distinct
  int64_t threads;
};

// sum_j g_j^2 in a fixed order: 16 lanes, each summing its products (rounded,
// not fused) over a block of 64 floats from zero, the blocks' lanes added
// into running lanes, and the lanes folded in halves (lane l + lane l + h).
// This is the order of XLA:CPU's reduction on AVX-512 for widths 31 to 448
// (measured). Written with GCC/Clang vector types so that every clone keeps
// the lanes in registers (one zmm, two ymm or four xmm).
typedef float Lanes __attribute__((vector_size(64)));
typedef float Half __attribute__((vector_size(32)));
typedef float Quarter __attribute__((vector_size(16)));
constexpr int64_t kLanes = 16;
constexpr int64_t kBlock = 64;

OSA_ROW_INLINE float RowSumOfSquares(const float* __restrict g, int64_t width) {
  Lanes total = {};
  for (int64_t b = 0; b < width; b += kBlock) {
    Lanes block = {};
    const int64_t end = std::min(width, b + kBlock);
    int64_t j = b;
    for (; j + kLanes <= end; j += kLanes) {
      Lanes x;
      std::memcpy(&x, g + j, sizeof(x));
      block = block + x * x;
    }
    if (j < end) {  // the last lanes of a partial vector are zero
      Lanes x = {};
      std::memcpy(&x, g + j, sizeof(float) * static_cast<size_t>(end - j));
      block = block + x * x;
    }
    total = total + block;
  }
  // Fold: lanes l + l + 8, then l + l + 4, l + l + 2, l + l + 1.
  Half lo8, hi8;
  std::memcpy(&lo8, &total, sizeof(Half));
  std::memcpy(&hi8, reinterpret_cast<const char*>(&total) + sizeof(Half), sizeof(Half));
  const Half t8 = lo8 + hi8;
  Quarter lo4, hi4;
  std::memcpy(&lo4, &t8, sizeof(Quarter));
  std::memcpy(&hi4, reinterpret_cast<const char*>(&t8) + sizeof(Quarter), sizeof(Quarter));
  const Quarter t4 = lo4 + hi4;
  return (t4[0] + t4[2]) + (t4[1] + t4[3]);
}

// One row: the accumulator *a updated from the gradient row g (decay already
// folded in for L2); the step written to `out`, or with kApply added times
// neg_lr to the parameter row `out` (decoupled decay first).
template <int64_t kDecay, bool kApply>
OSA_ROW_INLINE void UpdateRow(const Scalars& s, const float* __restrict g, float* __restrict a, float* __restrict out,
                      int64_t width) {
  // Locals, not loads through `s`: the rows written might alias it, which
  // would keep the compiler from vectorizing the loops.
  const float eps = s.eps, wd = s.weight_decay, neg_lr = s.neg_lr;
  if (width == 1) {  // element-wise Adagrad: XLA divides, no row mean
    const float an = std::fma(g[0], g[0], *a);
    *a = an;
    float step = g[0] / (std::sqrt(an) + eps);
    if constexpr (kApply) {
      if constexpr (kDecay == kDecoupled) step = step + wd * out[0];
      out[0] = out[0] + neg_lr * step;
    } else {
      out[0] = step;
    }
    return;
  }
  const float inv_width = 1.0f / static_cast<float>(width);
  const float an = std::fma(RowSumOfSquares(g, width), inv_width, *a);
  *a = an;
  const float r = 1.0f / (std::sqrt(an) + eps);
  for (int64_t j = 0; j < width; ++j) {
    float step = g[j] * r;
    if constexpr (kApply) {
      if constexpr (kDecay == kDecoupled) step = std::fma(wd, out[j], step);
      out[j] = out[j] + neg_lr * step;
    } else {
      out[j] = step;
    }
  }
}

// The gradient row the rule sees: `g`, or with L2 decay g + wd p in `buf`.
template <int64_t kDecay>
OSA_ROW_INLINE const float* DecayedRow(const Scalars& s, const float* __restrict g, const float* __restrict p,
                               float* __restrict buf, int64_t width) {
  if constexpr (kDecay != kL2) {
    return g;
  } else {
    const float wd = s.weight_decay;
    for (int64_t j = 0; j < width; ++j) buf[j] = std::fma(wd, p[j], g[j]);
    return buf;
  }
}

// The tables a call writes: the accumulators, the parameters (read for L2
// decay, written by apply; null otherwise), and the step rows or the
// parameters as `out`.
struct Tables {
  float* acc;
  float* p;
  float* out;
};

OSA_ROW_INLINE void PrefetchTarget(const Tables& t, int64_t r, int64_t width, bool reads_p) {
  __builtin_prefetch(t.acc + r, 1, 3);
  if (reads_p) PrefetchRow(t.p + r * width, width);
}

// For each entry, the distinct row of a coalesced batch it adds to (-1 for padding).
inline std::vector<int32_t> EntryRows(const Coalesced& c, int64_t k) {
  std::vector<int32_t> row_of(static_cast<size_t>(k), -1);
  for (int64_t d = 0; d < c.size; ++d) {
    for (int32_t e = c.first[d]; e >= 0; e = c.next[e]) row_of[e] = static_cast<int32_t>(d);
  }
  return row_of;
}

// The distinct rows [lo, hi) of a coalesced batch.
template <int64_t kDecay, bool kApply>
OSA_TARGET_CLONES void CoalescedRows(const Scalars& s, const Coalesced& c, const int32_t* row_of, int64_t k,
                                     const Shard& shard, const float* values, const Tables& t, int64_t width,
                                     int64_t lo, int64_t hi) {
  constexpr bool kReadsP = kApply || kDecay == kL2;
  // The gradient rows first: duplicates summed from 0 in entry order, as XLA's
  // scatter-add sums them, reading the values in order (following each row's
  // chain of entries instead would miss the cache at every entry).
  std::vector<float> sums(static_cast<size_t>((hi - lo) * width), 0.0f);
  for (int64_t i = 0; i < k; ++i) {
    const int64_t d = row_of[i];
    if (d < lo || d >= hi) continue;
    float* __restrict g = sums.data() + (d - lo) * width;
    const float* __restrict v = values + i * width;
    for (int64_t j = 0; j < width; ++j) g[j] = g[j] + v[j];
  }
  std::vector<float> buf(kDecay == kL2 ? static_cast<size_t>(width) : 0);
  for (int64_t d = lo; d < hi; ++d) {
    if (d + kPrefetchDistance < hi && shard.Owns(c.row[d + kPrefetchDistance]))
      PrefetchTarget(t, shard.Local(c.row[d + kPrefetchDistance]), width, kReadsP);
    if (!shard.Owns(c.row[d])) {  // another shard's row
      if constexpr (!kApply) std::memset(t.out + d * width, 0, sizeof(float) * static_cast<size_t>(width));
      continue;
    }
    const int64_t r = shard.Local(c.row[d]);
    const float* p_row = kReadsP ? t.p + r * width : nullptr;
    const float* g = DecayedRow<kDecay>(s, sums.data() + (d - lo) * width, p_row, buf.data(), width);
    float* dst = kApply ? t.out + r * width : t.out + d * width;
    UpdateRow<kDecay, kApply>(s, g, t.acc + r, dst, width);
  }
}

// The entries [lo, hi) of a batch whose in-range keys are distinct.
template <int64_t kDecay, bool kApply>
OSA_TARGET_CLONES void UniqueRows(const Scalars& s, const int32_t* keys, const Shard& shard, const float* values,
                                  const Tables& t, int64_t width, int64_t lo, int64_t hi) {
  constexpr bool kReadsP = kApply || kDecay == kL2;
  std::vector<float> buf(kDecay == kL2 ? static_cast<size_t>(width) : 0);
  for (int64_t i = lo; i < hi; ++i) {
    if (i + kPrefetchDistance < hi && shard.Owns(keys[i + kPrefetchDistance]))
      PrefetchTarget(t, shard.Local(keys[i + kPrefetchDistance]), width, kReadsP);
    if (!shard.Owns(keys[i])) {
      if constexpr (!kApply) std::memset(t.out + i * width, 0, sizeof(float) * static_cast<size_t>(width));
      continue;
    }
    const int64_t r = shard.Local(keys[i]);
    const float* p_row = kReadsP ? t.p + r * width : nullptr;
    const float* gr = DecayedRow<kDecay>(s, values + i * width, p_row, buf.data(), width);
    float* dst = kApply ? t.out + r * width : t.out + i * width;
    UpdateRow<kDecay, kApply>(s, gr, t.acc + r, dst, width);
  }
}

template <int64_t kDecay, bool kApply>
void Run(ffi::ThreadPool& pool, const Scalars& s, const Options& o, const int32_t* keys, int64_t k,
         const Shard& shard, const float* values, const Tables& t, int32_t* out_keys, int64_t width) {
  const auto pad = static_cast<int32_t>(shard.num_rows);
  // A broken promise (a key twice) takes the coalescing path: its rows are
  // summed as without it, and no two threads ever write one row. Keys the
  // library made distinct itself skip the check.
  if (o.unique == 2 || (o.unique == 1 && !HasDuplicate(keys, k, shard.num_rows))) {
    if (out_keys != nullptr) {
      for (int64_t i = 0; i < k; ++i) out_keys[i] = InRange(keys[i], shard.num_rows) ? keys[i] : pad;
    }
    ParallelFor(pool, k, std::min<int64_t>(o.threads, k / 32 + 1), [&](int64_t lo, int64_t hi) {
      UniqueRows<kDecay, kApply>(s, keys, shard, values, t, width, lo, hi);
    });
    return;
  }
  // The step rows are packed over all rows (so every shard packs alike); p
  // and acc only need this shard's.
  Coalesced c;
  Coalesce(keys, k, kApply ? shard.begin + shard.local_rows : shard.num_rows, kApply ? shard.begin : 0, c);
  if (out_keys != nullptr) {
    for (int64_t d = 0; d < k; ++d) out_keys[d] = d < c.size ? c.row[d] : pad;
  }
  if constexpr (!kApply) {  // padding slots of the step
    std::memset(t.out + c.size * width, 0, sizeof(float) * static_cast<size_t>((k - c.size) * width));
  }
  const std::vector<int32_t> row_of = EntryRows(c, k);
  // A thread is worth its scheduling past a few dozen rows.
  ParallelFor(pool, c.size, std::min<int64_t>(o.threads, c.size / 32 + 1), [&](int64_t lo, int64_t hi) {
    CoalescedRows<kDecay, kApply>(s, c, row_of.data(), k, shard, values, t, width, lo, hi);
  });
}

template <bool kApply>
void Dispatch(ffi::ThreadPool& pool, const Scalars& s, const Options& o, const int32_t* keys, int64_t k,
              const Shard& shard, const float* values, const Tables& t, int32_t* out_keys, int64_t width) {
  switch (o.decay) {
    case kL2:
      Run<kL2, kApply>(pool, s, o, keys, k, shard, values, t, out_keys, width);
      return;
    case kDecoupled:
      if constexpr (kApply) {
        Run<kDecoupled, kApply>(pool, s, o, keys, k, shard, values, t, out_keys, width);
        return;
      }
      [[fallthrough]];  // unreachable: checked by the handlers
    default:
      Run<kNoDecay, kApply>(pool, s, o, keys, k, shard, values, t, out_keys, width);
  }
}

// Checks the shapes shared by both handlers; sets the shard's local rows and the width.
ffi::Error CheckShapes(ffi::Span<const int64_t> acc, ffi::Span<const int64_t> values, int64_t k,
                       size_t scalars_count, int64_t decay, Shard& shard, int64_t& width) {
  if (acc.size() != 1) return ffi::Error::InvalidArgument("the accumulators must be one per row");
  shard.local_rows = acc[0];
  if (!shard.Valid()) return ffi::Error::InvalidArgument("row range outside a table of at most 2**31 - 1 rows");
  if (values.size() < 1 || values[0] != k) return ffi::Error::InvalidArgument("values must have one row per key");
  width = RowWidth(values);
  if (width < 1) return ffi::Error::InvalidArgument("rows must hold at least one entry");
  if (static_cast<int64_t>(scalars_count) != kNumScalars)
    return ffi::Error::InvalidArgument("scalars must hold 3 values");
  if (decay < kNoDecay || decay > kDecoupled) return ffi::Error::InvalidArgument("decay must be 0, 1 or 2");
  return ffi::Error::Success();
}

Scalars ReadScalars(const ffi::BufferR1<ffi::F32>& b) {
  const float* x = b.typed_data();
  return Scalars{x[0], x[1], x[2]};
}

ffi::Error RowsImpl(ffi::ThreadPool pool, ffi::BufferR1<ffi::F32> acc, ffi::BufferR1<ffi::S32> keys,
                    ffi::Buffer<ffi::F32> values, ffi::BufferR1<ffi::F32> scalars, ffi::BufferR0<ffi::S32> row_begin,
                    ffi::RemainingArgs params, ffi::ResultBufferR1<ffi::F32> acc_out,
                    ffi::ResultBufferR1<ffi::S32> keys_out, ffi::ResultBuffer<ffi::F32> step_out, int64_t num_rows,
                    int64_t decay, int64_t unique, int64_t threads) {
  const auto k = static_cast<int64_t>(keys.element_count());
  Shard shard{num_rows, *row_begin.typed_data(), 0};
  int64_t width = 0;
  if (ffi::Error e = CheckShapes(acc.dimensions(), values.dimensions(), k, scalars.element_count(), decay, shard, width);
      e.failure())
    return e;
  if (decay == kDecoupled) return ffi::Error::InvalidArgument("decoupled decay is the apply handler's");
  if (step_out->element_count() != values.element_count() || keys_out->element_count() != keys.element_count())
    return ffi::Error::InvalidArgument("results must have the shapes of keys and values");
  const float* p = nullptr;
  if (decay == kL2) {  // L2 decay reads the parameters, the one remaining operand
    if (params.size() != 1) return ffi::Error::InvalidArgument("L2 decay needs the parameters");
    auto p_buf = params.get<ffi::Buffer<ffi::F32>>(0);
    if (p_buf.has_error()) return p_buf.error();
    if (static_cast<int64_t>(p_buf->element_count()) != shard.local_rows * width)
      return ffi::Error::InvalidArgument("p must have one row of the values' width per accumulator");
    p = p_buf->typed_data();
  } else if (!params.empty()) {
    return ffi::Error::InvalidArgument("the parameters are read for L2 decay only");
  }
  float* a = acc_out->typed_data();
  CopyIfNotAliased(a, acc.typed_data(), acc.element_count());
  const Tables t{a, const_cast<float*>(p), step_out->typed_data()};  // p is only read here
  const Options o{decay, unique, threads};
  Dispatch<false>(pool, ReadScalars(scalars), o, keys.typed_data(), k, shard, values.typed_data(), t,
                  keys_out->typed_data(), width);
  return ffi::Error::Success();
}

ffi::Error ApplyImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> p, ffi::BufferR1<ffi::F32> acc,
                     ffi::BufferR1<ffi::S32> keys, ffi::Buffer<ffi::F32> values, ffi::BufferR1<ffi::F32> scalars,
                     ffi::BufferR0<ffi::S32> row_begin, ffi::ResultBuffer<ffi::F32> p_out,
                     ffi::ResultBufferR1<ffi::F32> acc_out, int64_t num_rows, int64_t decay, int64_t unique,
                     int64_t threads) {
  const auto k = static_cast<int64_t>(keys.element_count());
  Shard shard{num_rows, *row_begin.typed_data(), 0};
  int64_t width = 0;
  if (ffi::Error e = CheckShapes(acc.dimensions(), values.dimensions(), k, scalars.element_count(), decay, shard, width);
      e.failure())
    return e;
  if (static_cast<int64_t>(p.element_count()) != shard.local_rows * width)
    return ffi::Error::InvalidArgument("p must have one row of the values' width per accumulator");
  float* q = p_out->typed_data();
  float* a = acc_out->typed_data();
  CopyIfNotAliased(q, p.typed_data(), p.element_count());
  CopyIfNotAliased(a, acc.typed_data(), acc.element_count());
  const Tables t{a, q, q};
  const Options o{decay, unique, threads};
  Dispatch<true>(pool, ReadScalars(scalars), o, keys.typed_data(), k, shard, values.typed_data(), t, nullptr, width);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace optax_sparse_adam

XLA_FFI_DEFINE_HANDLER_SYMBOL(OptaxSparseAdamRowwiseAdagradRows, optax_sparse_adam::RowsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::BufferR1<ffi::F32>>()  // acc
                                  .Arg<ffi::BufferR1<ffi::S32>>()  // keys
                                  .Arg<ffi::Buffer<ffi::F32>>()    // values
                                  .Arg<ffi::BufferR1<ffi::F32>>()  // scalars
                                  .Arg<ffi::BufferR0<ffi::S32>>()  // row_begin: first row held
                                  .RemainingArgs()                 // p, with L2 decay only
                                  .Ret<ffi::BufferR1<ffi::F32>>()  // acc
                                  .Ret<ffi::BufferR1<ffi::S32>>()  // keys, distinct first
                                  .Ret<ffi::Buffer<ffi::F32>>()    // step rows
                                  .Attr<int64_t>("num_rows")
                                  .Attr<int64_t>("decay")
                                  .Attr<int64_t>("unique")
                                  .Attr<int64_t>("threads"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(OptaxSparseAdamRowwiseAdagradApply, optax_sparse_adam::ApplyImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()    // p
                                  .Arg<ffi::BufferR1<ffi::F32>>()  // acc
                                  .Arg<ffi::BufferR1<ffi::S32>>()  // keys
                                  .Arg<ffi::Buffer<ffi::F32>>()    // values
                                  .Arg<ffi::BufferR1<ffi::F32>>()  // scalars
                                  .Arg<ffi::BufferR0<ffi::S32>>()  // row_begin: first row held
                                  .Ret<ffi::Buffer<ffi::F32>>()    // p
                                  .Ret<ffi::BufferR1<ffi::F32>>()  // acc
                                  .Attr<int64_t>("num_rows")
                                  .Attr<int64_t>("decay")
                                  .Attr<int64_t>("unique")
                                  .Attr<int64_t>("threads"));
