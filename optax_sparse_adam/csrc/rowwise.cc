// Lazy row-wise optimizers on the rows a batch touches, as XLA FFI handlers for the CPU: one row loop
// (duplicates summed, rows split over threads, the step packed as the XLA path packs it) and two rules.
//
// Row-wise Adagrad (scale_by_rowwise_adagrad; FBGEMM's EXACT_ROWWISE_ADAGRAD):
//   optax_sparse_adam_v9_rowwise_adagrad_rows   (acc, keys, values, scalars[, p]) -> (acc, keys, step)
//     the sparse leaf rule: the accumulators in place, and the step rows
//     packed as the XLA path packs them (distinct keys first, padding after;
//     with `unique`, in the entries' own slots); p (the parameters) is read
//     for weight decay only: L2 (decay 1), or decoupled (decay 2: each step
//     row plus wd p, sparse_rowwise_adagrad's decay stage, before neg_lr);
//   optax_sparse_adam_v9_rowwise_adagrad_apply  (p, acc, keys, values, scalars, seeds) -> (p, acc)
//     the rule and p += neg_lr * step (after decoupled weight decay, in that
//     mode), touching each row of p and acc once.
// Row-wise Adam (scale_by_rowwise_adam; FBGEMM's PARTIAL_ROWWISE_ADAM):
//   optax_sparse_adam_v9_rowwise_adam_rows  (mu, nu, keys, values, scalars[, row_count[, bc]])
//                                             -> (mu, nu, keys, step[, row_count])
//   optax_sparse_adam_v9_rowwise_adam_apply (p, mu, nu, keys, values, scalars, seeds[, row_count[, bc]])
//                                             -> (p, mu, nu[, row_count])
//     mu per entry, nu one scalar per row; with per-row bias correction each
//     row's update count rises by one (saturating, as optax.safe_increment)
//     and 1 - b1^c, 1 - b2^c at the row's new count c replace the global
//     corrections: computed here in float32 with powf (the function XLA:CPU
//     calls for the rule's power), or given as bc (k x 2, per entry, computed
//     by XLA as the rule computes them, where it does not in float32).
// The apply handlers take two more scalars after the rule's (3 + 2, 9 + 2):
// the global-norm clipping's divisor and factor, each summed gradient row then
// clipped first, g = (g / div) * mul (sparse_aware(clip_by_global_norm)'s rule);
// or one (3 + 1, 9 + 1), its max_norm, where the table is the only leaf the
// clipping sees: the handler then takes the norm of the batch's summed rows
// itself (of its entries, where the keys are taken as distinct: rows.h's
// EntrySquares), bitwise as the sum_squares handler, and div and mul from it
// (rows.h's Clip), in one call.
// The apply handlers take p as float32, bfloat16 or float16 (rows.h's
// parameter policies: a 16-bit row widened, updated in float32, rounded once,
// to nearest or, with `rounding` 1, stochastically from `seeds`: the leaf's two
// seeds, then the row id its draws give local row 0 beyond the shard's first
// row, nonzero inside shard_map only).
// Tables are aliased to results (input_output_aliases), so under donation
// nothing table-sized is copied. Keys outside [0, num_rows) are padding.
//
// Per touched row r of width d, with the expressions XLA:CPU compiles the XLA
// path to (it contracts a product into the following add, and turns a
// division by a broadcast scalar or by the constant d into a multiplication by
// its reciprocal); build with -ffp-contract=off so that only the fused
// multiply-adds written here occur:
//   g   = ((0 + g_e1) + g_e2) + ...     over the entries of a row, in entry order
//   g   = (g / clip_div) * clip_mul     (apply handlers given the clipping's scalars)
//   S   = sum_j g_j g_j                 in the order of RowSumOfSquares
// Adagrad:
//   g   = fma(wd, p, g)                 (L2 decay, before S)
//   a'  = fma(S, 1 / d, a)              (d = 1: fma(g, g, a))
//   u   = g (1 / (sqrt(a') + eps))      (d = 1: g / (sqrt(a') + eps))
//   u   = fma(wd, p, u)                 (decoupled decay; d = 1: u + wd p)
// Adam:
//   m'  = fma(1 - b1, g, b1 m)          per entry
//   v'  = fma(1 - b2, S (1 / d), b2 v)  (d = 1: g g in place of S (1 / d))
//   D   = sqrt(v' (1 / bc2) + eps_root) + eps   (per-row bias correction: v' / bc2)
//   u   = (m' (1 / bc1)) (1 / D)        (d = 1: (m' (1 / bc1)) / D; per-row: m' / (bc1 D), as XLA
//                                        rewrites (a / b) / c where all three have one shape)
// and in the apply handlers p = p + neg_lr u; the rows handlers' step rows are neg_lr u (neg_lr 1, or the
// learning rate's -lr, which optax.scale_by_learning_rate would multiply them by next: one multiplication, as there).
// XLA chooses the order of the row sum itself (a YNNPACK reduction or a loop
// of its own, by shape and CPU), so S may differ from the XLA path's by the
// rounding of a sum of d nonnegative terms; the tests bound it.
#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "row_loop.h"
#include "rows.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace optax_sparse_adam {
namespace {

// The rules' row functions are OSA_ROW_INLINE (rows.h); the row loop that runs them is row_loop.h's.

// sum_j g_j^2 in a fixed order: 16 lanes, each summing its products (rounded,
// not fused) over a block of 64 floats from zero, the blocks' lanes added
// into running lanes, and the lanes folded in halves (lane l + lane l + h).
// This is the order of XLA:CPU's reduction on AVX-512 for widths 31 to 448
// (measured). Written with GCC/Clang vector types, the 16 lanes as two halves of 8 (lanes 0-7, 8-15), so that
// every clone keeps them in registers (two ymm, or four xmm): as one 64-byte vector, the AVX2 clones, inlined
// into the row loops, kept the lanes on the stack and moved them through general registers (two 16-byte stores
// then a 32-byte load, a failed store forwarding every 16 floats of every row).
typedef float Half __attribute__((vector_size(32)));
typedef float Quarter __attribute__((vector_size(16)));
constexpr int64_t kLanes = 16;
constexpr int64_t kBlock = 64;

OSA_ROW_INLINE float RowSumOfSquares(const float* __restrict g, int64_t width) {
  Half total_lo = {}, total_hi = {};
  for (int64_t b = 0; b < width; b += kBlock) {
    Half lo = {}, hi = {};
    const int64_t end = std::min(width, b + kBlock);
    int64_t j = b;
    for (; j + kLanes <= end; j += kLanes) {
      Half x, y;
      std::memcpy(&x, g + j, sizeof(x));
      std::memcpy(&y, g + j + kLanes / 2, sizeof(y));
      lo = lo + x * x;
      hi = hi + y * y;
    }
    if (j < end) {  // the last lanes of a partial vector are zero
      float tail[kLanes] = {};
      std::memcpy(tail, g + j, sizeof(float) * static_cast<size_t>(end - j));
      Half x, y;
      std::memcpy(&x, tail, sizeof(x));
      std::memcpy(&y, tail + kLanes / 2, sizeof(y));
      lo = lo + x * x;
      hi = hi + y * y;
    }
    total_lo = total_lo + lo;
    total_hi = total_hi + hi;
  }
  // Fold: lanes l + l + 8, then l + l + 4, l + l + 2, l + l + 1.
  const Half t8 = total_lo + total_hi;
  Quarter lo4, hi4;
  std::memcpy(&lo4, &t8, sizeof(Quarter));
  std::memcpy(&hi4, reinterpret_cast<const char*>(&t8) + sizeof(Quarter), sizeof(Quarter));
  const Quarter t4 = lo4 + hi4;
  return (t4[0] + t4[2]) + (t4[1] + t4[3]);
}

// ---- Row-wise Adagrad.

// Order of the scalars operand, as _rowwise.adagrad_scalars stacks it.
struct AdagradScalars {
  float eps, weight_decay, neg_lr;
};
constexpr int64_t kAdagradScalars = 3;

// How weight decay enters: not at all, folded into the gradient (L2), or added
// to the step (decoupled).
enum Decay : int64_t { kNoDecay = 0, kL2 = 1, kDecoupled = 2 };

template <int64_t kDecay, bool kApplies, class Params = F32Params>
struct AdagradRule {
  static constexpr bool kApply = kApplies;
  static constexpr bool kReadsP = kApply || kDecay != kNoDecay;
  using T = typename Params::T;  // the parameters' entries (float32 but in an apply handler's)
  AdagradScalars s;
  float* acc;
  const T* p;  // the parameters: read for decay, written by apply (then p == out); null otherwise
  T* out;      // apply: the parameters; rows: the step rows (float32)
  int64_t width;
  Params params = {};

  int64_t Scratch() const { return kDecay == kL2 ? width : 0; }

  OSA_ROW_INLINE void Prefetch(int64_t r) const {
    __builtin_prefetch(acc + r, 1, 3);
    if (kReadsP) PrefetchRow(p + r * width, width);
  }

  static float P(T x) { return Params::Load(x); }

  OSA_ROW_INLINE void Row(const float* __restrict g, int64_t r, int64_t slot, int64_t, float* __restrict buf) const {
    // Locals, not loads through `s`: the rows written might alias it, which
    // would keep the compiler from vectorizing the loops.
    const float eps = s.eps, wd = s.weight_decay, neg_lr = s.neg_lr;
    if constexpr (kDecay == kL2) {  // the gradient the rule sees: g + wd p
      const T* __restrict pr = p + r * width;
      for (int64_t j = 0; j < width; ++j) buf[j] = std::fma(wd, P(pr[j]), g[j]);
      g = buf;
    }
    T* __restrict dst = kApply ? out + r * width : out + slot * width;
    float* __restrict a = acc + r;
    const uint32_t seed = params.RowSeed(r);
    if (width == 1) {  // element-wise Adagrad: XLA divides, no row mean
      const float an = std::fma(g[0], g[0], *a);
      *a = an;
      float step = g[0] / (std::sqrt(an) + eps);
      if constexpr (kApply) {
        if constexpr (kDecay == kDecoupled) step = step + wd * P(dst[0]);
        dst[0] = params.Store(P(dst[0]) + neg_lr * step, seed);
      } else {
        if constexpr (kDecay == kDecoupled) step = step + wd * P(p[r]);
        dst[0] = neg_lr * step;
      }
      return;
    }
    const float inv_width = 1.0f / static_cast<float>(width);
    const float an = std::fma(RowSumOfSquares(g, width), inv_width, *a);
    *a = an;
    const float rcp = 1.0f / (std::sqrt(an) + eps);
    const T* __restrict pr = kDecay == kDecoupled && !kApply ? p + r * width : nullptr;  // rows: decay's p
    uint32_t draw = seed;
    for (int64_t j = 0; j < width; ++j, draw += kDrawStep) {
      float step = g[j] * rcp;
      if constexpr (kApply) {
        if constexpr (kDecay == kDecoupled) step = std::fma(wd, P(dst[j]), step);
        dst[j] = params.Store(P(dst[j]) + neg_lr * step, draw);
      } else {
        if constexpr (kDecay == kDecoupled) step = std::fma(wd, P(pr[j]), step);
        dst[j] = neg_lr * step;
      }
    }
  }
};

// ---- Row-wise Adam.

// Order of the scalars operand, as _rowwise.rowwise_adam_scalars stacks it.
struct AdamScalars {
  float b1, one_minus_b1, b2, one_minus_b2, eps, eps_root, bc1, bc2, neg_lr;
};
constexpr int64_t kAdamScalars = 9;

template <bool kPerRow, bool kApplies, class Params = F32Params>
struct AdamRule {
  static constexpr bool kApply = kApplies;
  using T = typename Params::T;  // the parameters' entries (float32 but in an apply handler's)
  AdamScalars s;
  float* m;
  float* v;
  int32_t* count;   // per-row bias correction: each row's update count; null otherwise
  const float* bc;  // per-row bias correction: (1 - b1^c, 1 - b2^c) per entry, or null to compute them; null otherwise
  T* out;           // apply: the parameters; rows: the step rows (float32)
  int64_t width;
  Params params = {};

  int64_t Scratch() const { return 0; }

  OSA_ROW_INLINE void Prefetch(int64_t r) const {
    PrefetchRow(m + r * width, width);
    __builtin_prefetch(v + r, 1, 3);
    if (kPerRow) __builtin_prefetch(count + r, 1, 3);
    if (kApply) PrefetchRow(out + r * width, width);
  }

  OSA_ROW_INLINE void Row(const float* __restrict g, int64_t r, int64_t slot, int64_t entry, float*) const {
    const float b1 = s.b1, one_minus_b1 = s.one_minus_b1, b2 = s.b2, one_minus_b2 = s.one_minus_b2;
    const float eps = s.eps, eps_root = s.eps_root, neg_lr = s.neg_lr;
    float bc1 = s.bc1, bc2 = s.bc2;
    if constexpr (kPerRow) {
      if (count[r] < INT32_MAX) count[r] += 1;  // optax.safe_increment
      if (bc != nullptr) {
        bc1 = bc[2 * entry];
        bc2 = bc[2 * entry + 1];
      } else {  // 1 - b^c in float32, with XLA:CPU's function for it (the C library's powf)
        const float c = static_cast<float>(count[r]);
        bc1 = 1.0f - std::pow(b1, c);
        bc2 = 1.0f - std::pow(b2, c);
      }
    }
    // The row's mean square: XLA divides the sum by the constant d as a
    // multiplication by 1 / d (a row of one entry is its square).
    const float ms = width == 1 ? g[0] * g[0] : RowSumOfSquares(g, width) * (1.0f / static_cast<float>(width));
    const float vn = std::fma(one_minus_b2, ms, b2 * v[r]);
    v[r] = vn;
    // A global correction is a broadcast scalar (XLA multiplies by its
    // reciprocal), a per-row one an array of nu's shape (XLA divides).
    const float vc = kPerRow ? vn / bc2 : vn * (1.0f / bc2);
    const float denom = std::sqrt(vc + eps_root) + eps;
    float* __restrict mr = m + r * width;
    T* __restrict dst = kApply ? out + r * width : out + slot * width;
    const uint32_t seed = params.RowSeed(r);
    if (width == 1) {  // nu and the corrections have the row's own shape: XLA divides
      const float mn = std::fma(one_minus_b1, g[0], b1 * mr[0]);
      mr[0] = mn;
      const float step = kPerRow ? mn / (bc1 * denom) : (mn * (1.0f / bc1)) / denom;
      if constexpr (kApply) {
        dst[0] = params.Store(Params::Load(dst[0]) + neg_lr * step, seed);
      } else {
        dst[0] = neg_lr * step;
      }
      return;
    }
    const float inv_bc1 = 1.0f / bc1;
    const float rcp = 1.0f / denom;
    uint32_t draw = seed;
    for (int64_t j = 0; j < width; ++j, draw += kDrawStep) {
      const float mn = std::fma(one_minus_b1, g[j], b1 * mr[j]);
      mr[j] = mn;
      const float step = (mn * inv_bc1) * rcp;
      if constexpr (kApply) {
        dst[j] = params.Store(Params::Load(dst[j]) + neg_lr * step, draw);
      } else {
        dst[j] = neg_lr * step;
      }
    }
  }
};

// ---- Row-wise Adagrad's handlers.

template <bool kApply, class Params = F32Params>
void DispatchAdagrad(ffi::ThreadPool& pool, const AdagradScalars& s, int64_t decay, const Options& o,
                     const int32_t* keys, int64_t k, const Shard& shard, const float* values, float* acc,
                     const typename Params::T* p, typename Params::T* out, int32_t* out_keys, int64_t width,
                     const Params& params = {}) {
  switch (decay) {
    case kL2:
      Run(pool, AdagradRule<kL2, kApply, Params>{s, acc, p, out, width, params}, o, keys, k, shard, values,
          out_keys);
      return;
    case kDecoupled:
      Run(pool, AdagradRule<kDecoupled, kApply, Params>{s, acc, p, out, width, params}, o, keys, k, shard, values,
          out_keys);
      return;
    default:
      Run(pool, AdagradRule<kNoDecay, kApply, Params>{s, acc, p, out, width, params}, o, keys, k, shard, values,
          out_keys);
  }
}

// Checks the shapes shared by the Adagrad handlers; sets the shard's local rows and the width.
ffi::Error CheckAdagradShapes(ffi::Span<const int64_t> acc, ffi::Span<const int64_t> values, int64_t k,
                              size_t scalars_count, int64_t decay, Shard& shard, int64_t& width, bool clips) {
  if (acc.size() != 1) return ffi::Error::InvalidArgument("the accumulators must be one per row");
  shard.local_rows = acc[0];
  if (!shard.Valid()) return ffi::Error::InvalidArgument("row range outside a table of at most 2**31 - 1 rows");
  if (values.size() < 1 || values[0] != k) return ffi::Error::InvalidArgument("values must have one row per key");
  width = RowWidth(values);
  if (width < 1) return ffi::Error::InvalidArgument("rows must hold at least one entry");
  if (!ScalarCountOk(static_cast<int64_t>(scalars_count), kAdagradScalars, clips))
    return ffi::Error::InvalidArgument(clips ? "scalars must hold 3 values (4 or 5 to clip)"
                                             : "scalars must hold 3 values");
  if (decay < kNoDecay || decay > kDecoupled) return ffi::Error::InvalidArgument("decay must be 0, 1 or 2");
  return ffi::Error::Success();
}

AdagradScalars ReadAdagradScalars(const ffi::BufferR1<ffi::F32>& b) {
  const float* x = b.typed_data();
  return AdagradScalars{x[0], x[1], x[2]};
}

ffi::Error AdagradRowsImpl(ffi::ThreadPool pool, ffi::BufferR1<ffi::F32> acc, ffi::BufferR1<ffi::S32> keys,
                           ffi::Buffer<ffi::F32> values, ffi::BufferR1<ffi::F32> scalars,
                           ffi::BufferR0<ffi::S32> row_begin, ffi::RemainingArgs params,
                           ffi::ResultBufferR1<ffi::F32> acc_out, ffi::ResultBufferR1<ffi::S32> keys_out,
                           ffi::ResultBuffer<ffi::F32> step_out, int64_t num_rows, int64_t decay, int64_t unique,
                           int64_t threads) {
  const auto k = static_cast<int64_t>(keys.element_count());
  Shard shard{num_rows, *row_begin.typed_data(), 0};
  int64_t width = 0;
  if (ffi::Error e =
          CheckAdagradShapes(acc.dimensions(), values.dimensions(), k, scalars.element_count(), decay, shard, width,
                             /*clips=*/false);
      e.failure())
    return e;
  if (step_out->element_count() != values.element_count() || keys_out->element_count() != keys.element_count())
    return ffi::Error::InvalidArgument("results must have the shapes of keys and values");
  const float* p = nullptr;
  if (decay != kNoDecay) {  // decay reads the parameters, the one remaining operand
    if (params.size() != 1) return ffi::Error::InvalidArgument("weight decay needs the parameters");
    auto p_buf = params.get<ffi::Buffer<ffi::F32>>(0);
    if (p_buf.has_error()) return p_buf.error();
    if (static_cast<int64_t>(p_buf->element_count()) != shard.local_rows * width)
      return ffi::Error::InvalidArgument("p must have one row of the values' width per accumulator");
    p = p_buf->typed_data();
  } else if (!params.empty()) {
    return ffi::Error::InvalidArgument("the parameters are read for weight decay only");
  }
  float* a = acc_out->typed_data();
  CopyIfNotAliased(a, acc.typed_data(), acc.element_count());
  DispatchAdagrad<false>(pool, ReadAdagradScalars(scalars), decay, Options{unique, threads}, keys.typed_data(), k,
                         shard, values.typed_data(), a, p, step_out->typed_data(), keys_out->typed_data(), width);
  return ffi::Error::Success();
}

ffi::Error AdagradApplyImpl(ffi::ThreadPool pool, ffi::AnyBuffer p, ffi::BufferR1<ffi::F32> acc,
                            ffi::BufferR1<ffi::S32> keys, ffi::Buffer<ffi::F32> values,
                            ffi::BufferR1<ffi::F32> scalars, ffi::BufferR1<ffi::U32> seeds,
                            ffi::BufferR0<ffi::S32> row_begin, ffi::Result<ffi::AnyBuffer> p_out,
                            ffi::ResultBufferR1<ffi::F32> acc_out, int64_t num_rows, int64_t decay, int64_t unique,
                            int64_t threads, int64_t rounding) {
  const auto k = static_cast<int64_t>(keys.element_count());
  Shard shard{num_rows, *row_begin.typed_data(), 0};
  int64_t width = 0;
  if (ffi::Error e =
          CheckAdagradShapes(acc.dimensions(), values.dimensions(), k, scalars.element_count(), decay, shard, width,
                             /*clips=*/true);
      e.failure())
    return e;
  if (ffi::Error e = CheckParams(p, p_out, seeds, shard.local_rows, width); e.failure()) return e;
  auto* q = static_cast<char*>(p_out->untyped_data());
  float* a = acc_out->typed_data();
  CopyIfNotAliased(q, static_cast<const char*>(p.untyped_data()), p.size_bytes());
  CopyIfNotAliased(a, acc.typed_data(), acc.element_count());
  const Options o{unique, threads, ReadClip(scalars, kAdagradScalars)};
  const uint32_t* words = seeds.typed_data();
  return WithParams(p.element_type(), rounding, words, DrawsFirstRow(shard, seeds), [&](const auto& params) {
    using T = typename std::decay_t<decltype(params)>::T;
    DispatchAdagrad<true>(pool, ReadAdagradScalars(scalars), decay, o, keys.typed_data(), k, shard,
                          values.typed_data(), a, reinterpret_cast<T*>(q), reinterpret_cast<T*>(q), nullptr, width,
                          params);
  });
}

// ---- Row-wise Adam's handlers.

// The tables of a row-wise Adam call, checked: mu (local rows x width), nu
// (local rows), and with per-row bias correction the row counts (in the
// first remaining operand, written to the first remaining result) and the
// corrections (k x 2, the second remaining operand).
struct AdamTables {
  float* m;
  float* v;
  int32_t* count = nullptr;
  const float* bc = nullptr;
};

ffi::Error CheckAdam(ffi::Span<const int64_t> mu, size_t nu_count, ffi::Span<const int64_t> values, int64_t k,
                     size_t scalars_count, const ffi::RemainingArgs& extra, const ffi::RemainingRets& extra_out,
                     Shard& shard, int64_t& width, AdamTables& t, bool clips) {
  if (mu.size() < 1) return ffi::Error::InvalidArgument("tables must have at least one dimension");
  shard.local_rows = mu[0];
  if (!shard.Valid()) return ffi::Error::InvalidArgument("row range outside a table of at most 2**31 - 1 rows");
  width = RowWidth(mu);
  if (width < 1) return ffi::Error::InvalidArgument("rows must hold at least one entry");
  if (static_cast<int64_t>(nu_count) != shard.local_rows) return ffi::Error::InvalidArgument("nu must be one per row");
  if (values.size() < 1 || values[0] != k || RowWidth(values) != width)
    return ffi::Error::InvalidArgument("values must have one row of mu's width per key");
  if (!ScalarCountOk(static_cast<int64_t>(scalars_count), kAdamScalars, clips))
    return ffi::Error::InvalidArgument(clips ? "scalars must hold 9 values (10 or 11 to clip)"
                                             : "scalars must hold 9 values");
  if (extra.size() > 2 || extra_out.size() != (extra.size() > 0 ? 1u : 0u))
    return ffi::Error::InvalidArgument("per-row bias correction takes the row counts and, optionally, the corrections");
  if (extra.size() > 0) {
    auto count = extra.get<ffi::BufferR1<ffi::S32>>(0);
    auto count_out = extra_out.get<ffi::BufferR1<ffi::S32>>(0);
    if (count.has_error()) return count.error();
    if (count_out.has_error()) return count_out.error();
    if (static_cast<int64_t>(count->element_count()) != shard.local_rows ||
        (*count_out)->element_count() != count->element_count())
      return ffi::Error::InvalidArgument("the row counts must be one per row");
    if (extra.size() == 2) {
      auto bc = extra.get<ffi::Buffer<ffi::F32>>(1);
      if (bc.has_error()) return bc.error();
      if (static_cast<int64_t>(bc->element_count()) != 2 * k)
        return ffi::Error::InvalidArgument("the corrections must be two per key");
      t.bc = bc->typed_data();
    }
    t.count = (*count_out)->typed_data();
    CopyIfNotAliased(t.count, count->typed_data(), count->element_count());
  }
  return ffi::Error::Success();
}

AdamScalars ReadAdamScalars(const ffi::BufferR1<ffi::F32>& b) {
  const float* x = b.typed_data();
  return AdamScalars{x[0], x[1], x[2], x[3], x[4], x[5], x[6], x[7], x[8]};
}

template <bool kApply, class Params = F32Params>
void DispatchAdam(ffi::ThreadPool& pool, const AdamScalars& s, const AdamTables& t, const Options& o,
                  const int32_t* keys, int64_t k, const Shard& shard, const float* values,
                  typename Params::T* out, int32_t* out_keys, int64_t width, const Params& params = {}) {
  if (t.count != nullptr) {
    Run(pool, AdamRule<true, kApply, Params>{s, t.m, t.v, t.count, t.bc, out, width, params}, o, keys, k, shard,
        values, out_keys);
  } else {
    Run(pool, AdamRule<false, kApply, Params>{s, t.m, t.v, nullptr, nullptr, out, width, params}, o, keys, k, shard,
        values, out_keys);
  }
}

ffi::Error AdamRowsImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> mu, ffi::BufferR1<ffi::F32> nu,
                        ffi::BufferR1<ffi::S32> keys, ffi::Buffer<ffi::F32> values, ffi::BufferR1<ffi::F32> scalars,
                        ffi::BufferR0<ffi::S32> row_begin, ffi::RemainingArgs extra,
                        ffi::ResultBuffer<ffi::F32> mu_out, ffi::ResultBufferR1<ffi::F32> nu_out,
                        ffi::ResultBufferR1<ffi::S32> keys_out, ffi::ResultBuffer<ffi::F32> step_out,
                        ffi::RemainingRets extra_out, int64_t num_rows, int64_t unique, int64_t threads) {
  const auto k = static_cast<int64_t>(keys.element_count());
  Shard shard{num_rows, *row_begin.typed_data(), 0};
  int64_t width = 0;
  AdamTables t{mu_out->typed_data(), nu_out->typed_data()};
  if (ffi::Error e = CheckAdam(mu.dimensions(), nu.element_count(), values.dimensions(), k, scalars.element_count(),
                               extra, extra_out, shard, width, t, /*clips=*/false);
      e.failure())
    return e;
  if (step_out->element_count() != values.element_count() || keys_out->element_count() != keys.element_count())
    return ffi::Error::InvalidArgument("results must have the shapes of keys and values");
  CopyIfNotAliased(t.m, mu.typed_data(), mu.element_count());
  CopyIfNotAliased(t.v, nu.typed_data(), nu.element_count());
  DispatchAdam<false>(pool, ReadAdamScalars(scalars), t, Options{unique, threads}, keys.typed_data(), k, shard,
                      values.typed_data(), step_out->typed_data(), keys_out->typed_data(), width);
  return ffi::Error::Success();
}

ffi::Error AdamApplyImpl(ffi::ThreadPool pool, ffi::AnyBuffer p, ffi::Buffer<ffi::F32> mu,
                         ffi::BufferR1<ffi::F32> nu, ffi::BufferR1<ffi::S32> keys, ffi::Buffer<ffi::F32> values,
                         ffi::BufferR1<ffi::F32> scalars, ffi::BufferR1<ffi::U32> seeds,
                         ffi::BufferR0<ffi::S32> row_begin, ffi::RemainingArgs extra,
                         ffi::Result<ffi::AnyBuffer> p_out, ffi::ResultBuffer<ffi::F32> mu_out,
                         ffi::ResultBufferR1<ffi::F32> nu_out, ffi::RemainingRets extra_out, int64_t num_rows,
                         int64_t unique, int64_t threads, int64_t rounding) {
  const auto k = static_cast<int64_t>(keys.element_count());
  Shard shard{num_rows, *row_begin.typed_data(), 0};
  int64_t width = 0;
  AdamTables t{mu_out->typed_data(), nu_out->typed_data()};
  if (ffi::Error e = CheckAdam(mu.dimensions(), nu.element_count(), values.dimensions(), k, scalars.element_count(),
                               extra, extra_out, shard, width, t, /*clips=*/true);
      e.failure())
    return e;
  if (ffi::Error e = CheckParams(p, p_out, seeds, shard.local_rows, width); e.failure()) return e;
  auto* q = static_cast<char*>(p_out->untyped_data());
  CopyIfNotAliased(q, static_cast<const char*>(p.untyped_data()), p.size_bytes());
  CopyIfNotAliased(t.m, mu.typed_data(), mu.element_count());
  CopyIfNotAliased(t.v, nu.typed_data(), nu.element_count());
  const Options o{unique, threads, ReadClip(scalars, kAdamScalars)};
  const uint32_t* words = seeds.typed_data();
  return WithParams(p.element_type(), rounding, words, DrawsFirstRow(shard, seeds), [&](const auto& params) {
    using T = typename std::decay_t<decltype(params)>::T;
    DispatchAdam<true>(pool, ReadAdamScalars(scalars), t, o, keys.typed_data(), k, shard, values.typed_data(),
                       reinterpret_cast<T*>(q), nullptr, width, params);
  });
}

}  // namespace
}  // namespace optax_sparse_adam

XLA_FFI_DEFINE_HANDLER_SYMBOL(OptaxSparseAdamRowwiseAdagradRows, optax_sparse_adam::AdagradRowsImpl,
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(OptaxSparseAdamRowwiseAdagradApply, optax_sparse_adam::AdagradApplyImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()           // p: float32, bfloat16 or float16
                                  .Arg<ffi::BufferR1<ffi::F32>>()  // acc
                                  .Arg<ffi::BufferR1<ffi::S32>>()  // keys
                                  .Arg<ffi::Buffer<ffi::F32>>()    // values
                                  .Arg<ffi::BufferR1<ffi::F32>>()  // scalars
                                  .Arg<ffi::BufferR1<ffi::U32>>()  // seeds: rounding's two, the draws' row offset
                                  .Arg<ffi::BufferR0<ffi::S32>>()  // row_begin: first row held
                                  .Ret<ffi::AnyBuffer>()           // p
                                  .Ret<ffi::BufferR1<ffi::F32>>()  // acc
                                  .Attr<int64_t>("num_rows")
                                  .Attr<int64_t>("decay")
                                  .Attr<int64_t>("unique")
                                  .Attr<int64_t>("threads")
                                  .Attr<int64_t>("rounding"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(OptaxSparseAdamRowwiseAdamRows, optax_sparse_adam::AdamRowsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()    // mu
                                  .Arg<ffi::BufferR1<ffi::F32>>()  // nu
                                  .Arg<ffi::BufferR1<ffi::S32>>()  // keys
                                  .Arg<ffi::Buffer<ffi::F32>>()    // values
                                  .Arg<ffi::BufferR1<ffi::F32>>()  // scalars
                                  .Arg<ffi::BufferR0<ffi::S32>>()  // row_begin: first row held
                                  .RemainingArgs()                 // row_count, bc: per-row bias correction only
                                  .Ret<ffi::Buffer<ffi::F32>>()    // mu
                                  .Ret<ffi::BufferR1<ffi::F32>>()  // nu
                                  .Ret<ffi::BufferR1<ffi::S32>>()  // keys, distinct first
                                  .Ret<ffi::Buffer<ffi::F32>>()    // step rows
                                  .RemainingRets()                 // row_count: per-row bias correction only
                                  .Attr<int64_t>("num_rows")
                                  .Attr<int64_t>("unique")
                                  .Attr<int64_t>("threads"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(OptaxSparseAdamRowwiseAdamApply, optax_sparse_adam::AdamApplyImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()           // p: float32, bfloat16 or float16
                                  .Arg<ffi::Buffer<ffi::F32>>()    // mu
                                  .Arg<ffi::BufferR1<ffi::F32>>()  // nu
                                  .Arg<ffi::BufferR1<ffi::S32>>()  // keys
                                  .Arg<ffi::Buffer<ffi::F32>>()    // values
                                  .Arg<ffi::BufferR1<ffi::F32>>()  // scalars
                                  .Arg<ffi::BufferR1<ffi::U32>>()  // seeds: rounding's two, the draws' row offset
                                  .Arg<ffi::BufferR0<ffi::S32>>()  // row_begin: first row held
                                  .RemainingArgs()                 // row_count, bc: per-row bias correction only
                                  .Ret<ffi::AnyBuffer>()           // p
                                  .Ret<ffi::Buffer<ffi::F32>>()    // mu
                                  .Ret<ffi::BufferR1<ffi::F32>>()  // nu
                                  .RemainingRets()                 // row_count: per-row bias correction only
                                  .Attr<int64_t>("num_rows")
                                  .Attr<int64_t>("unique")
                                  .Attr<int64_t>("threads")
                                  .Attr<int64_t>("rounding"));
