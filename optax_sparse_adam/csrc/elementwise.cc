// Lazy element-wise optimizers on the rows a batch touches, as XLA FFI handlers for the CPU: the row loop of
// row_loop.h (duplicates summed, rows split over threads, the step packed as the XLA path packs it) and three
// rules whose state has the parameters' shape, one value per entry.
//
// Each rule has two handlers:
//   ..._rows  (state..., keys, values, scalars[, p]) -> (state..., keys, step)
//     the sparse leaf rule for tx.update (the row engine's kernel hook): the state in place, the step rows packed
//     as the XLA path packs them (distinct keys first, padding after; with `unique`, in the entries' own slots),
//     adagrad's and momentum's times neg_lr (1, or the learning rate's -lr, which optax.scale_by_learning_rate
//     would multiply the rows by next: one multiplication, as there);
//   ..._apply (p, state..., keys, values, scalars) -> (p, state...)
//     the rule and the parameters' update in one pass over each touched row (update_and_apply's fused step).
// The targets, and their scalars in the order the Python side stacks them:
//   adagrad (scale_by_sparse_adagrad, optax.scale_by_rss's rule): acc; scalars eps, neg_lr
//     a' = fma(g, g, a),  u = (a' > 0 ? 1 / sqrt(a' + eps) : 0) g,  p' = p + neg_lr u
//   momentum (sparse_sgd's lazy trace, optax.trace's rule): trace; scalars momentum, neg_lr; attribute nesterov
//     t' = g + momentum t,  u = t',  p' = p + neg_lr u
//     (Nesterov: t' = fma(t, momentum, g),  u = fma(t', momentum, g), as XLA:CPU contracts them there)
//   ftrl (sparse_ftrl, TensorFlow's ApplyFtrlV2): accumulator n, linear z; scalars 1 / alpha (alpha with
//     `divides`), l1, q0 = 2 (l2 + beta / (2 alpha)), 2 l2_shrinkage, c (learning_rate_power); the rows handler
//     also reads p; attributes shrinks (whether the rule adds the shrinkage), root (0: n^-c with powf, 1:
//     sqrt(n), 2: sqrt where c == -0.5 and powf elsewhere, as the rule chooses for a traced power), divides
//     (XLA divides by a learning rate computed at run time, and multiplies by the reciprocal of a constant one)
//     gs = fma(p, 2 l2_shrinkage, g) (or g),  n' = fma(g, g, n),  s = (root(n') - root(n)) (1 / alpha),
//     z' = z + fma(-s, p, gs),  p_new = |z'| > l1 ? fma(sign(z'), l1, -z') / fma(root(n'), 1 / alpha, q0) : 0
//     (with `divides`: s = (root(n') - root(n)) / alpha, and root(n') / alpha + q0 in the last denominator),
//     u = p_new - p,  p' = p + u (apply_updates' sum: p_new to within a rounding, as on the XLA path).
// And the two handlers of momentum with catch-up:
//   catch_up_momentum_apply (p, trace, last_step, keys, values, scalars, window, powers, per_key, far, far_steps,
//                            counts) -> (p, trace, last_step, flags)
//     sparse_sgd(momentum, catch_up=True)'s step: a row that sat out idle > 0 steps since its record first takes
//     them in their closed form, from two coefficients it picks as the XLA path's replay computes them per row
//     (IdleRecords: C, the sum over the idle steps of lr_k momentum^k, times momentum with Nesterov, and
//     momentum**idle):
//       q = fma(-C, t, p),  t = t momentum**idle,
//     then the momentum step from t, and p' = p + ((q + neg_lr u) - p), the update the XLA path rounds and
//     applies (p' = p + neg_lr u for a row that did not sit out); each touched row's record takes the step's
//     count in place, last_step = max(last_step, count). Under a schedule, a row idle longer than the window
//     whose entry the state's record (far, far_steps) does not hold is left as it is, its records too, and
//     flagged in each of its entries (flags 1): the caller takes it by the XLA rule.
//   catch_up_momentum_rows (the same operands) -> (trace, last_step, keys, step, flags)
//     the leaf rule for tx.update: p read, not written; the step rows, packed as the rows handlers pack theirs,
//     hold the XLA rule's update, (q + neg_lr u) - p where the row sat out steps and neg_lr u elsewhere (NaN
//     for a flagged row).
// Per entry, with the expressions XLA:CPU compiles the XLA path to (it contracts a product into the following
// add, and turns a division by a constant scalar into a multiplication by its reciprocal); built with
// -ffp-contract=off so that only the fused multiply-adds written here occur. The apply handlers take the
// global-norm clipping's scalars after the rule's, as rowwise.cc's do (rows.h's Clip). Tables are aliased to
// results (input_output_aliases), so under donation nothing table-sized is copied. Keys outside [0, num_rows)
// are padding.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "row_loop.h"
#include "rows.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace optax_sparse_adam {
namespace {

// ---- The rules. Each updates a row of its state from the row's summed gradient g; `out` is the parameters
// (apply) or the step rows (rows, at `slot`).

template <bool kApplies>
struct AdagradRule {
  static constexpr bool kApply = kApplies;
  float eps, neg_lr;
  float* acc;
  float* out;
  int64_t width;

  int64_t Scratch() const { return 0; }

  OSA_ROW_INLINE void Prefetch(int64_t r) const {
    PrefetchRow(acc + r * width, width);
    if (kApply) PrefetchRow(out + r * width, width);
  }

  OSA_ROW_INLINE void Row(const float* __restrict g, int64_t r, int64_t slot, int64_t, float*) const {
    const float eps_ = eps, neg_lr_ = neg_lr;  // locals: the rows written might alias the rule's members
    float* __restrict a = acc + r * width;
    float* __restrict dst = kApply ? out + r * width : out + slot * width;
    for (int64_t j = 0; j < width; ++j) {
      const float an = std::fma(g[j], g[j], a[j]);
      a[j] = an;
      const float u = (an > 0.0f ? 1.0f / std::sqrt(an + eps_) : 0.0f) * g[j];
      if constexpr (kApply) {
        dst[j] = dst[j] + neg_lr_ * u;
      } else {
        dst[j] = neg_lr_ * u;
      }
    }
  }
};

template <bool kApplies, bool kNesterov>
struct MomentumRule {
  static constexpr bool kApply = kApplies;
  float momentum, neg_lr;
  float* trace;
  float* out;
  int64_t width;

  int64_t Scratch() const { return 0; }

  OSA_ROW_INLINE void Prefetch(int64_t r) const {
    PrefetchRow(trace + r * width, width);
    if (kApply) PrefetchRow(out + r * width, width);
  }

  OSA_ROW_INLINE void Row(const float* __restrict g, int64_t r, int64_t slot, int64_t, float*) const {
    const float mu = momentum, neg_lr_ = neg_lr;
    float* __restrict t = trace + r * width;
    float* __restrict dst = kApply ? out + r * width : out + slot * width;
    for (int64_t j = 0; j < width; ++j) {
      // XLA:CPU computes the product apart from the sum where it is the step itself (it keeps momentum * t
      // for the update's fusion), and contracts them where Nesterov's step reads the new trace again.
      const float tn = kNesterov ? std::fma(t[j], mu, g[j]) : g[j] + mu * t[j];
      t[j] = tn;
      const float u = kNesterov ? std::fma(tn, mu, g[j]) : tn;
      if constexpr (kApply) {
        dst[j] = dst[j] + neg_lr_ * u;
      } else {
        dst[j] = neg_lr_ * u;
      }
    }
  }
};

// A touched row's idle steps, from its record (IdleSince), and the step's count for the record. Their closed form's
// coefficients, as _sgd's idle_coefficients computes them per row: at a constant rate and momentum C(min(idle, cap))
// from the window (0 where cap == 0) and momentum**idle from its table (TablePower); under a schedule (with the
// state's record) C from the window for rows idle up to cap steps, and for rows idle longer the record's entry
// L mod its length (L the row's last step) where it is for L (times the momentum with Nesterov), else the row is
// declined (flagged: the XLA rule takes it); else both per key, computed by the XLA side (a momentum not known when
// the step is traced, one of 0 or whose window would pass 65,536 steps, a state that keeps no record).
struct IdleRecords {
  const float* window;     // (max(cap, 1),): C of rows idle 1 .. cap steps, or nullptr with per_key
  int64_t cap;
  const float* powers;     // momentum's table (1024 floats), or nullptr with per_key
  const float* per_key;    // (k, 2): C and momentum**idle per key, or nullptr
  const float* far;        // the record's coefficients, far_terms per entry (its first C), or nullptr
  const int32_t* far_steps;  // the last step each of the record's entries is for, or nullptr
  int64_t record_steps, far_terms;
  int32_t* flags;          // (k,): 1 for each entry of a declined row
  int32_t* last_step;      // per local row, written
  int32_t count, done;
};

// kApplies: p (`out`, the parameters) updated in place; else p read (`p`) and the update written to `out` at the
// row's slot.
template <bool kApplies, bool kNesterov>
struct CatchUpMomentumRule {
  static constexpr bool kApply = kApplies;
  float momentum, neg_lr;
  float* trace;
  const float* p;  // the parameters (apply: p == out)
  float* out;
  IdleRecords keys;
  int64_t width;

  int64_t Scratch() const { return 0; }

  OSA_ROW_INLINE void Prefetch(int64_t r) const {
    PrefetchRow(trace + r * width, width);
    PrefetchRow(p + r * width, width);
    __builtin_prefetch(keys.last_step + r, 1, 3);
  }

  OSA_ROW_INLINE void Declined(int64_t e) const { keys.flags[e] = 1; }

  // False, nothing written but a row of NaN in the step row (rows), for a row idle longer than the window whose
  // entry the state's record does not hold.
  OSA_ROW_INLINE bool Row(const float* __restrict g, int64_t r, int64_t slot, int64_t entry, float*) const {
    const float mu = momentum, neg_lr_ = neg_lr;
    float* __restrict t = trace + r * width;
    const float* pr = p + r * width;  // may be dst (apply): read before written, entry by entry
    float* dst = kApply ? out + r * width : out + slot * width;
    const int32_t last = keys.last_step[r];
    const int32_t idle = IdleSince(keys.done, last);
    if (idle <= 0) {  // up to date: the lazy step
      keys.last_step[r] = std::max(last, keys.count);
      for (int64_t j = 0; j < width; ++j) {
        const float tn = kNesterov ? std::fma(t[j], mu, g[j]) : g[j] + mu * t[j];
        t[j] = tn;
        const float step = neg_lr_ * (kNesterov ? std::fma(tn, mu, g[j]) : tn);
        if constexpr (kApply) {
          dst[j] = pr[j] + step;
        } else {
          dst[j] = step;
        }
      }
      return true;
    }
    float c, decay;
    if (keys.per_key != nullptr) {
      c = keys.per_key[2 * entry];
      decay = keys.per_key[2 * entry + 1];
    } else {
      if (keys.far_steps != nullptr && idle > keys.cap) {  // the record's entry for the row's last step
        const int64_t at = RecordEntry(keys.far_steps, keys.record_steps, last);
        if (at < 0) {
          if constexpr (!kApply) std::fill(dst, dst + width, std::numeric_limits<float>::quiet_NaN());
          return false;
        }
        c = keys.far[at * keys.far_terms];
        if constexpr (kNesterov) c = mu * c;  // as idle_coefficients multiplies the sum
      } else {
        c = keys.cap > 0 ? keys.window[std::min<int64_t>(idle, keys.cap) - 1] : 0.0f;
      }
      decay = TablePower(keys.powers, idle);
    }
    keys.last_step[r] = std::max(last, keys.count);
    for (int64_t j = 0; j < width; ++j) {
      const float p0 = pr[j];
      const float caught = std::fma(-c, t[j], p0);
      const float m = t[j] * decay;
      const float tn = kNesterov ? std::fma(m, mu, g[j]) : g[j] + mu * m;
      t[j] = tn;
      const float step = neg_lr_ * (kNesterov ? std::fma(tn, mu, g[j]) : tn);
      const float update = CaughtUpUpdate(caught + step, p0);
      if constexpr (kApply) {
        dst[j] = p0 + update;
      } else {
        dst[j] = update;
      }
    }
    return true;
  }
};

struct FtrlScalars {
  float alpha, l1, q0, shrink, power;  // alpha: 1 / alpha where the rule multiplies by it (kDivides false)
};
constexpr int64_t kFtrlScalars = 5;

// jnp.sign: -1, 0 or 1, a zero keeping its sign and a NaN staying NaN.
OSA_ROW_INLINE float Sign(float x) { return x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : x); }

template <bool kApplies, bool kSqrt, bool kShrinks, bool kDivides>
struct FtrlRule {
  static constexpr bool kApply = kApplies;
  FtrlScalars s;
  float* n;
  float* z;
  const float* p;  // the parameters (apply: p == out)
  float* out;
  int64_t width;

  int64_t Scratch() const { return 0; }

  OSA_ROW_INLINE void Prefetch(int64_t r) const {
    PrefetchRow(n + r * width, width);
    PrefetchRow(z + r * width, width);
    PrefetchRow(p + r * width, width);
  }

  OSA_ROW_INLINE static float Root(float x, float neg_power) { return kSqrt ? std::sqrt(x) : std::pow(x, neg_power); }

  // x / alpha: a division where alpha is computed at run time, a product by the constant 1 / alpha where it is a
  // constant (XLA's simplifier turns the division by a constant into that product).
  OSA_ROW_INLINE static float PerAlpha(float x, float alpha) { return kDivides ? x / alpha : x * alpha; }

  OSA_ROW_INLINE void Row(const float* __restrict g, int64_t r, int64_t slot, int64_t, float*) const {
    const float alpha = s.alpha, l1 = s.l1, q0 = s.q0, shrink = s.shrink, neg_power = -s.power;
    float* __restrict nr = n + r * width;
    float* __restrict zr = z + r * width;
    const float* pr = p + r * width;  // may be dst (apply): read before written, entry by entry
    float* dst = kApply ? out + r * width : out + slot * width;
    for (int64_t j = 0; j < width; ++j) {
      const float pj = pr[j];
      const float gs = kShrinks ? std::fma(pj, shrink, g[j]) : g[j];
      const float nn = std::fma(g[j], g[j], nr[j]);
      const float root_new = Root(nn, neg_power);
      const float sigma = PerAlpha(root_new - Root(nr[j], neg_power), alpha);
      const float zn = zr[j] + std::fma(-sigma, pj, gs);
      nr[j] = nn;
      zr[j] = zn;
      const float quadratic = kDivides ? PerAlpha(root_new, alpha) + q0 : std::fma(root_new, alpha, q0);
      const float p_new = std::fabs(zn) > l1 ? std::fma(Sign(zn), l1, -zn) / quadratic : 0.0f;
      const float u = p_new - pj;
      if constexpr (kApply) {
        dst[j] = pj + u;
      } else {
        dst[j] = u;
      }
    }
  }
};

// ---- Checks shared by the handlers.

// The state tables (one value per entry of each local row) and the values: sets the shard's rows and the width.
ffi::Error CheckTables(ffi::Span<const int64_t> table, ffi::Span<const int64_t> values, int64_t k, Shard& shard,
                       int64_t& width) {
  if (table.size() < 1) return ffi::Error::InvalidArgument("tables must have at least one dimension");
  shard.local_rows = table[0];
  if (!shard.Valid()) return ffi::Error::InvalidArgument("row range outside a table of at most 2**31 - 1 rows");
  width = RowWidth(table);
  if (width < 1) return ffi::Error::InvalidArgument("rows must hold at least one entry");
  if (values.size() < 1 || values[0] != k || RowWidth(values) != width)
    return ffi::Error::InvalidArgument("values must have one row of the tables' width per key");
  return ffi::Error::Success();
}

ffi::Error CheckSame(const ffi::Buffer<ffi::F32>& a, const ffi::Buffer<ffi::F32>& b) {
  if (a.element_count() != b.element_count())
    return ffi::Error::InvalidArgument("the parameters and the state tables must have one shape");
  return ffi::Error::Success();
}

ffi::Error CheckScalars(const ffi::BufferR1<ffi::F32>& scalars, int64_t count, bool clips) {
  if (!ScalarCountOk(static_cast<int64_t>(scalars.element_count()), count, clips))
    return ffi::Error::InvalidArgument(clips ? "wrong number of scalars (the rule's, then 1 or 2 to clip)"
                                             : "wrong number of scalars");
  return ffi::Error::Success();
}

ffi::Error CheckRowsResults(size_t keys_out, size_t step_out, const ffi::BufferR1<ffi::S32>& keys,
                            const ffi::Buffer<ffi::F32>& values) {
  if (step_out != values.element_count() || keys_out != keys.element_count())
    return ffi::Error::InvalidArgument("results must have the shapes of keys and values");
  return ffi::Error::Success();
}

// ---- The handlers of the rules with one state table (Adagrad's accumulators, momentum's trace).

// A rows handler's checks and copy: run(table, step rows, width, shard, keys out), with the table in its result;
// run checks what else its handler takes before it writes a row, and returns its error.
template <typename F>
ffi::Error OneTableRows(const ffi::Buffer<ffi::F32>& table, const ffi::BufferR1<ffi::S32>& keys,
                        const ffi::Buffer<ffi::F32>& values, const ffi::BufferR1<ffi::F32>& scalars,
                        const ffi::BufferR0<ffi::S32>& row_begin, ffi::ResultBuffer<ffi::F32>& table_out,
                        ffi::Result<ffi::Buffer<ffi::S32>>& keys_out, ffi::ResultBuffer<ffi::F32>& step_out,
                        int64_t num_rows, F run) {
  const auto k = static_cast<int64_t>(keys.element_count());
  Shard shard{num_rows, *row_begin.typed_data(), 0};
  int64_t width = 0;
  if (ffi::Error e = CheckTables(table.dimensions(), values.dimensions(), k, shard, width); e.failure()) return e;
  if (ffi::Error e = CheckScalars(scalars, 2, false); e.failure()) return e;
  if (ffi::Error e = CheckRowsResults(keys_out->element_count(), step_out->element_count(), keys, values);
      e.failure())
    return e;
  float* t = table_out->typed_data();
  CopyIfNotAliased(t, table.typed_data(), table.element_count());
  return run(t, step_out->typed_data(), width, shard, keys_out->typed_data());
}

// An apply handler's checks and copies: run(table, parameters, width, shard, clip), with both in their results;
// run checks what else its handler takes before it writes a row, and returns its error.
template <typename F>
ffi::Error OneTableApply(const ffi::Buffer<ffi::F32>& p, const ffi::Buffer<ffi::F32>& table,
                         const ffi::BufferR1<ffi::S32>& keys, const ffi::Buffer<ffi::F32>& values,
                         const ffi::BufferR1<ffi::F32>& scalars, const ffi::BufferR0<ffi::S32>& row_begin,
                         ffi::ResultBuffer<ffi::F32>& p_out, ffi::ResultBuffer<ffi::F32>& table_out,
                         int64_t num_rows, F run) {
  const auto k = static_cast<int64_t>(keys.element_count());
  Shard shard{num_rows, *row_begin.typed_data(), 0};
  int64_t width = 0;
  if (ffi::Error e = CheckTables(table.dimensions(), values.dimensions(), k, shard, width); e.failure()) return e;
  if (ffi::Error e = CheckSame(p, table); e.failure()) return e;
  if (ffi::Error e = CheckScalars(scalars, 2, true); e.failure()) return e;
  float* q = p_out->typed_data();
  float* t = table_out->typed_data();
  CopyIfNotAliased(q, p.typed_data(), p.element_count());
  CopyIfNotAliased(t, table.typed_data(), table.element_count());
  return run(t, q, width, shard, ReadClip(scalars, 2));
}

// ---- Adagrad.

ffi::Error AdagradRowsImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> acc, ffi::BufferR1<ffi::S32> keys,
                           ffi::Buffer<ffi::F32> values, ffi::BufferR1<ffi::F32> scalars,
                           ffi::BufferR0<ffi::S32> row_begin, ffi::ResultBuffer<ffi::F32> acc_out,
                           ffi::Result<ffi::Buffer<ffi::S32>> keys_out, ffi::ResultBuffer<ffi::F32> step_out,
                           int64_t num_rows, int64_t unique, int64_t threads) {
  const float* x = scalars.typed_data();
  return OneTableRows(acc, keys, values, scalars, row_begin, acc_out, keys_out, step_out, num_rows,
                      [&](float* a, float* step, int64_t width, const Shard& shard, int32_t* out_keys) {
                        Run(pool, AdagradRule<false>{x[0], x[1], a, step, width}, Options{unique, threads},
                            keys.typed_data(), keys.element_count(), shard, values.typed_data(), out_keys);
                        return ffi::Error::Success();
                      });
}

ffi::Error AdagradApplyImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> p, ffi::Buffer<ffi::F32> acc,
                            ffi::BufferR1<ffi::S32> keys, ffi::Buffer<ffi::F32> values,
                            ffi::BufferR1<ffi::F32> scalars, ffi::BufferR0<ffi::S32> row_begin,
                            ffi::ResultBuffer<ffi::F32> p_out, ffi::ResultBuffer<ffi::F32> acc_out, int64_t num_rows,
                            int64_t unique, int64_t threads) {
  const float* x = scalars.typed_data();
  return OneTableApply(p, acc, keys, values, scalars, row_begin, p_out, acc_out, num_rows,
                       [&](float* a, float* q, int64_t width, const Shard& shard, const Clip& clip) {
                         Run(pool, AdagradRule<true>{x[0], x[1], a, q, width}, Options{unique, threads, clip},
                             keys.typed_data(), keys.element_count(), shard, values.typed_data(), nullptr);
                         return ffi::Error::Success();
                       });
}

// ---- Momentum.

template <bool kApply>
void RunMomentum(ffi::ThreadPool& pool, bool nesterov, const float* x, float* trace, float* out, int64_t width,
                 const Options& o, const ffi::BufferR1<ffi::S32>& keys, const Shard& shard,
                 const ffi::Buffer<ffi::F32>& values, int32_t* out_keys) {
  const int32_t* k = keys.typed_data();
  const auto n = static_cast<int64_t>(keys.element_count());
  if (nesterov) {
    Run(pool, MomentumRule<kApply, true>{x[0], x[1], trace, out, width}, o, k, n, shard, values.typed_data(),
        out_keys);
  } else {
    Run(pool, MomentumRule<kApply, false>{x[0], x[1], trace, out, width}, o, k, n, shard, values.typed_data(),
        out_keys);
  }
}

ffi::Error MomentumRowsImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> trace, ffi::BufferR1<ffi::S32> keys,
                            ffi::Buffer<ffi::F32> values, ffi::BufferR1<ffi::F32> scalars,
                            ffi::BufferR0<ffi::S32> row_begin, ffi::ResultBuffer<ffi::F32> trace_out,
                            ffi::Result<ffi::Buffer<ffi::S32>> keys_out, ffi::ResultBuffer<ffi::F32> step_out,
                            int64_t num_rows, int64_t nesterov, int64_t unique, int64_t threads) {
  return OneTableRows(trace, keys, values, scalars, row_begin, trace_out, keys_out, step_out, num_rows,
                      [&](float* t, float* step, int64_t width, const Shard& shard, int32_t* out_keys) {
                        RunMomentum<false>(pool, nesterov != 0, scalars.typed_data(), t, step, width,
                                           Options{unique, threads}, keys, shard, values, out_keys);
                        return ffi::Error::Success();
                      });
}

ffi::Error MomentumApplyImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> p, ffi::Buffer<ffi::F32> trace,
                             ffi::BufferR1<ffi::S32> keys, ffi::Buffer<ffi::F32> values,
                             ffi::BufferR1<ffi::F32> scalars, ffi::BufferR0<ffi::S32> row_begin,
                             ffi::ResultBuffer<ffi::F32> p_out, ffi::ResultBuffer<ffi::F32> trace_out,
                             int64_t num_rows, int64_t nesterov, int64_t unique, int64_t threads) {
  return OneTableApply(p, trace, keys, values, scalars, row_begin, p_out, trace_out, num_rows,
                       [&](float* t, float* q, int64_t width, const Shard& shard, const Clip& clip) {
                         RunMomentum<true>(pool, nesterov != 0, scalars.typed_data(), t, q, width,
                                           Options{unique, threads, clip}, keys, shard, values, nullptr);
                         return ffi::Error::Success();
                       });
}

// The catch-up momentum handlers' coefficient operands, checked (k keys), and each touched row's records, read
// into their result; `records` is set (flags zeroed).
ffi::Error ReadIdleRecords(const ffi::BufferR1<ffi::S32>& last_step, const ffi::BufferR1<ffi::F32>& window,
                           const ffi::BufferR1<ffi::F32>& powers, const ffi::BufferR2<ffi::F32>& per_key,
                           const ffi::BufferR2<ffi::F32>& far, const ffi::BufferR1<ffi::S32>& far_steps,
                           const ffi::BufferR1<ffi::S32>& counts, ffi::ResultBufferR1<ffi::S32>& last_step_out,
                           ffi::ResultBufferR1<ffi::S32>& flags, int64_t k, int64_t cap, int64_t per_key_given,
                           const Shard& shard, IdleRecords& records) {
  // Whether per_key is given is an attribute: an empty batch's per_key is empty too.
  const bool by_key = per_key_given != 0;
  if (by_key ? per_key.dimensions()[0] != k || per_key.dimensions()[1] != 2 : per_key.element_count() != 0)
    return ffi::Error::InvalidArgument("per_key must hold 2 values per key where given, else be empty");
  if (!by_key && (cap < 0 || static_cast<int64_t>(window.element_count()) < std::max<int64_t>(cap, 1) ||
                  powers.element_count() != 1024))
    return ffi::Error::InvalidArgument("without per_key, window must hold C for each idle count up to cap and "
                                       "powers the momentum's table");
  const auto record_steps = static_cast<int64_t>(far_steps.element_count());
  const int64_t far_terms = far.dimensions()[1];
  if (record_steps != 0 && (by_key || far.dimensions()[0] != record_steps || far_terms < 1))
    return ffi::Error::InvalidArgument("far must hold an entry of the record for each of far_steps (not by key)");
  if (counts.element_count() != 2) return ffi::Error::InvalidArgument("counts must hold the step's count and done");
  if (static_cast<int64_t>(last_step.element_count()) != shard.local_rows ||
      last_step_out->element_count() != last_step.element_count())
    return ffi::Error::InvalidArgument("last_step must have one entry per row");
  if (static_cast<int64_t>(flags->element_count()) != k)
    return ffi::Error::InvalidArgument("flags must have one entry per key");
  int32_t* last = last_step_out->typed_data();
  CopyIfNotAliased(last, last_step.typed_data(), last_step.element_count());
  std::fill(flags->typed_data(), flags->typed_data() + k, 0);
  records = IdleRecords{by_key ? nullptr : window.typed_data(),
                        cap,
                        by_key ? nullptr : powers.typed_data(),
                        by_key ? per_key.typed_data() : nullptr,
                        record_steps != 0 ? far.typed_data() : nullptr,
                        record_steps != 0 ? far_steps.typed_data() : nullptr,
                        record_steps,
                        far_terms,
                        flags->typed_data(),
                        last,
                        counts.typed_data()[0],
                        counts.typed_data()[1]};
  return ffi::Error::Success();
}

template <bool kApply>
void RunCatchUpMomentum(ffi::ThreadPool& pool, bool nesterov, const float* x, float* trace, const float* p,
                        float* out, const IdleRecords& records, int64_t width, const Options& o,
                        const ffi::BufferR1<ffi::S32>& keys, const Shard& shard, const ffi::Buffer<ffi::F32>& values,
                        int32_t* out_keys) {
  const int32_t* k = keys.typed_data();
  const auto n = static_cast<int64_t>(keys.element_count());
  if (nesterov) {
    Run(pool, CatchUpMomentumRule<kApply, true>{x[0], x[1], trace, p, out, records, width}, o, k, n, shard,
        values.typed_data(), out_keys);
  } else {
    Run(pool, CatchUpMomentumRule<kApply, false>{x[0], x[1], trace, p, out, records, width}, o, k, n, shard,
        values.typed_data(), out_keys);
  }
}

#define OSA_CATCH_UP_MOMENTUM_ARGS                                                                                \
  ffi::ThreadPool pool, ffi::Buffer<ffi::F32> p, ffi::Buffer<ffi::F32> trace, ffi::BufferR1<ffi::S32> last_step, \
      ffi::BufferR1<ffi::S32> keys, ffi::Buffer<ffi::F32> values, ffi::BufferR1<ffi::F32> scalars,              \
      ffi::BufferR1<ffi::F32> window, ffi::BufferR1<ffi::F32> powers, ffi::BufferR2<ffi::F32> per_key,          \
      ffi::BufferR2<ffi::F32> far, ffi::BufferR1<ffi::S32> far_steps, ffi::BufferR1<ffi::S32> counts,           \
      ffi::BufferR0<ffi::S32> row_begin

ffi::Error CatchUpMomentumApplyImpl(OSA_CATCH_UP_MOMENTUM_ARGS, ffi::ResultBuffer<ffi::F32> p_out,
                                    ffi::ResultBuffer<ffi::F32> trace_out, ffi::ResultBufferR1<ffi::S32> last_step_out,
                                    ffi::ResultBufferR1<ffi::S32> flags, int64_t num_rows, int64_t cap,
                                    int64_t per_key_given, int64_t nesterov, int64_t unique, int64_t threads) {
  const auto k = static_cast<int64_t>(keys.element_count());
  return OneTableApply(
      p, trace, keys, values, scalars, row_begin, p_out, trace_out, num_rows,
      [&](float* t, float* q, int64_t width, const Shard& shard, const Clip& clip) {
        IdleRecords records{};
        if (ffi::Error e = ReadIdleRecords(last_step, window, powers, per_key, far, far_steps, counts,
                                           last_step_out, flags, k, cap, per_key_given, shard, records);
            e.failure())
          return e;
        RunCatchUpMomentum<true>(pool, nesterov != 0, scalars.typed_data(), t, q, q, records, width,
                                 Options{unique, threads, clip}, keys, shard, values, nullptr);
        return ffi::Error::Success();
      });
}

ffi::Error CatchUpMomentumRowsImpl(OSA_CATCH_UP_MOMENTUM_ARGS, ffi::ResultBuffer<ffi::F32> trace_out,
                                   ffi::ResultBufferR1<ffi::S32> last_step_out,
                                   ffi::Result<ffi::Buffer<ffi::S32>> keys_out, ffi::ResultBuffer<ffi::F32> step_out,
                                   ffi::ResultBufferR1<ffi::S32> flags, int64_t num_rows, int64_t cap,
                                   int64_t per_key_given, int64_t nesterov, int64_t unique, int64_t threads) {
  const auto k = static_cast<int64_t>(keys.element_count());
  return OneTableRows(
      trace, keys, values, scalars, row_begin, trace_out, keys_out, step_out, num_rows,
      [&](float* t, float* step, int64_t width, const Shard& shard, int32_t* out_keys) {
        if (ffi::Error e = CheckSame(p, trace); e.failure()) return e;
        IdleRecords records{};
        if (ffi::Error e = ReadIdleRecords(last_step, window, powers, per_key, far, far_steps, counts,
                                           last_step_out, flags, k, cap, per_key_given, shard, records);
            e.failure())
          return e;
        RunCatchUpMomentum<false>(pool, nesterov != 0, scalars.typed_data(), t, p.typed_data(), step, records, width,
                                  Options{unique, threads}, keys, shard, values, out_keys);
        return ffi::Error::Success();
      });
}

#undef OSA_CATCH_UP_MOMENTUM_ARGS

// ---- FTRL.

FtrlScalars ReadFtrlScalars(const ffi::BufferR1<ffi::F32>& b) {
  const float* x = b.typed_data();
  return FtrlScalars{x[0], x[1], x[2], x[3], x[4]};
}

// Runs the FTRL rule chosen by the handler's attributes, the flags picking the template's.
struct FtrlCall {
  FtrlScalars s;
  float* n;
  float* z;
  const float* p;
  float* out;
  int64_t width;

  template <bool kApply, bool... kFlags>
  void Run(ffi::ThreadPool& pool, const Options& o, const int32_t* keys, int64_t k, const Shard& shard,
           const float* values, int32_t* out_keys) const {
    optax_sparse_adam::Run(pool, FtrlRule<kApply, kFlags...>{s, n, z, p, out, width}, o, keys, k, shard, values,
                           out_keys);
  }
};

template <bool kApply, bool... kChosen, typename... Flags>
void RunFtrlWith(const FtrlCall& call, ffi::ThreadPool& pool, const Options& o, const int32_t* keys, int64_t k,
                 const Shard& shard, const float* values, int32_t* out_keys, bool flag, Flags... rest) {
  if constexpr (sizeof...(Flags) == 0) {
    if (flag) {
      call.Run<kApply, kChosen..., true>(pool, o, keys, k, shard, values, out_keys);
    } else {
      call.Run<kApply, kChosen..., false>(pool, o, keys, k, shard, values, out_keys);
    }
  } else if (flag) {
    RunFtrlWith<kApply, kChosen..., true>(call, pool, o, keys, k, shard, values, out_keys, rest...);
  } else {
    RunFtrlWith<kApply, kChosen..., false>(call, pool, o, keys, k, shard, values, out_keys, rest...);
  }
}

template <bool kApply>
void RunFtrl(ffi::ThreadPool& pool, int64_t root, bool shrinks, bool divides, const FtrlCall& call,
             const Options& o, const int32_t* keys, int64_t k, const Shard& shard, const float* values,
             int32_t* out_keys) {
  // root 2 chooses as the rule's jnp.where(c == -0.5, sqrt, power) does, once for the call.
  const bool takes_sqrt = root == 1 || (root == 2 && call.s.power == -0.5f);
  RunFtrlWith<kApply>(call, pool, o, keys, k, shard, values, out_keys, takes_sqrt, shrinks, divides);
}

ffi::Error CheckFtrl(const ffi::Buffer<ffi::F32>& n, const ffi::Buffer<ffi::F32>& z, const ffi::Buffer<ffi::F32>& p,
                     int64_t root) {
  if (ffi::Error e = CheckSame(p, n); e.failure()) return e;
  if (ffi::Error e = CheckSame(p, z); e.failure()) return e;
  if (root < 0 || root > 2) return ffi::Error::InvalidArgument("root must be 0, 1 or 2");
  return ffi::Error::Success();
}

ffi::Error FtrlRowsImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> n, ffi::Buffer<ffi::F32> z,
                        ffi::Buffer<ffi::F32> p, ffi::BufferR1<ffi::S32> keys, ffi::Buffer<ffi::F32> values,
                        ffi::BufferR1<ffi::F32> scalars, ffi::BufferR0<ffi::S32> row_begin,
                        ffi::ResultBuffer<ffi::F32> n_out, ffi::ResultBuffer<ffi::F32> z_out,
                        ffi::Result<ffi::Buffer<ffi::S32>> keys_out, ffi::ResultBuffer<ffi::F32> step_out,
                        int64_t num_rows, int64_t root, int64_t shrinks, int64_t divides, int64_t unique,
                        int64_t threads) {
  const auto k = static_cast<int64_t>(keys.element_count());
  Shard shard{num_rows, *row_begin.typed_data(), 0};
  int64_t width = 0;
  if (ffi::Error e = CheckTables(n.dimensions(), values.dimensions(), k, shard, width); e.failure()) return e;
  if (ffi::Error e = CheckFtrl(n, z, p, root); e.failure()) return e;
  if (ffi::Error e = CheckScalars(scalars, kFtrlScalars, false); e.failure()) return e;
  if (ffi::Error e = CheckRowsResults(keys_out->element_count(), step_out->element_count(), keys, values);
      e.failure())
    return e;
  float* nn = n_out->typed_data();
  float* zz = z_out->typed_data();
  CopyIfNotAliased(nn, n.typed_data(), n.element_count());
  CopyIfNotAliased(zz, z.typed_data(), z.element_count());
  RunFtrl<false>(pool, root, shrinks != 0, divides != 0,
                 FtrlCall{ReadFtrlScalars(scalars), nn, zz, p.typed_data(), step_out->typed_data(), width},
                 Options{unique, threads}, keys.typed_data(), k, shard, values.typed_data(), keys_out->typed_data());
  return ffi::Error::Success();
}

ffi::Error FtrlApplyImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> p, ffi::Buffer<ffi::F32> n,
                         ffi::Buffer<ffi::F32> z, ffi::BufferR1<ffi::S32> keys, ffi::Buffer<ffi::F32> values,
                         ffi::BufferR1<ffi::F32> scalars, ffi::BufferR0<ffi::S32> row_begin,
                         ffi::ResultBuffer<ffi::F32> p_out, ffi::ResultBuffer<ffi::F32> n_out,
                         ffi::ResultBuffer<ffi::F32> z_out, int64_t num_rows, int64_t root, int64_t shrinks,
                         int64_t divides, int64_t unique, int64_t threads) {
  const auto k = static_cast<int64_t>(keys.element_count());
  Shard shard{num_rows, *row_begin.typed_data(), 0};
  int64_t width = 0;
  if (ffi::Error e = CheckTables(n.dimensions(), values.dimensions(), k, shard, width); e.failure()) return e;
  if (ffi::Error e = CheckFtrl(n, z, p, root); e.failure()) return e;
  if (ffi::Error e = CheckScalars(scalars, kFtrlScalars, true); e.failure()) return e;
  float* q = p_out->typed_data();
  float* nn = n_out->typed_data();
  float* zz = z_out->typed_data();
  CopyIfNotAliased(q, p.typed_data(), p.element_count());
  CopyIfNotAliased(nn, n.typed_data(), n.element_count());
  CopyIfNotAliased(zz, z.typed_data(), z.element_count());
  RunFtrl<true>(pool, root, shrinks != 0, divides != 0, FtrlCall{ReadFtrlScalars(scalars), nn, zz, q, q, width},
                Options{unique, threads, ReadClip(scalars, kFtrlScalars)}, keys.typed_data(), k, shard,
                values.typed_data(), nullptr);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace optax_sparse_adam

XLA_FFI_DEFINE_HANDLER_SYMBOL(OptaxSparseAdamAdagradRows, optax_sparse_adam::AdagradRowsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()    // acc
                                  .Arg<ffi::BufferR1<ffi::S32>>()  // keys
                                  .Arg<ffi::Buffer<ffi::F32>>()    // values
                                  .Arg<ffi::BufferR1<ffi::F32>>()  // scalars
                                  .Arg<ffi::BufferR0<ffi::S32>>()  // row_begin: first row held
                                  .Ret<ffi::Buffer<ffi::F32>>()    // acc
                                  .Ret<ffi::Buffer<ffi::S32>>()    // keys, distinct first
                                  .Ret<ffi::Buffer<ffi::F32>>()    // step rows
                                  .Attr<int64_t>("num_rows")
                                  .Attr<int64_t>("unique")
                                  .Attr<int64_t>("threads"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(OptaxSparseAdamAdagradApply, optax_sparse_adam::AdagradApplyImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()    // p
                                  .Arg<ffi::Buffer<ffi::F32>>()    // acc
                                  .Arg<ffi::BufferR1<ffi::S32>>()  // keys
                                  .Arg<ffi::Buffer<ffi::F32>>()    // values
                                  .Arg<ffi::BufferR1<ffi::F32>>()  // scalars
                                  .Arg<ffi::BufferR0<ffi::S32>>()  // row_begin: first row held
                                  .Ret<ffi::Buffer<ffi::F32>>()    // p
                                  .Ret<ffi::Buffer<ffi::F32>>()    // acc
                                  .Attr<int64_t>("num_rows")
                                  .Attr<int64_t>("unique")
                                  .Attr<int64_t>("threads"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(OptaxSparseAdamMomentumRows, optax_sparse_adam::MomentumRowsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()    // trace
                                  .Arg<ffi::BufferR1<ffi::S32>>()  // keys
                                  .Arg<ffi::Buffer<ffi::F32>>()    // values
                                  .Arg<ffi::BufferR1<ffi::F32>>()  // scalars
                                  .Arg<ffi::BufferR0<ffi::S32>>()  // row_begin: first row held
                                  .Ret<ffi::Buffer<ffi::F32>>()    // trace
                                  .Ret<ffi::Buffer<ffi::S32>>()    // keys, distinct first
                                  .Ret<ffi::Buffer<ffi::F32>>()    // step rows
                                  .Attr<int64_t>("num_rows")
                                  .Attr<int64_t>("nesterov")
                                  .Attr<int64_t>("unique")
                                  .Attr<int64_t>("threads"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(OptaxSparseAdamMomentumApply, optax_sparse_adam::MomentumApplyImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()    // p
                                  .Arg<ffi::Buffer<ffi::F32>>()    // trace
                                  .Arg<ffi::BufferR1<ffi::S32>>()  // keys
                                  .Arg<ffi::Buffer<ffi::F32>>()    // values
                                  .Arg<ffi::BufferR1<ffi::F32>>()  // scalars
                                  .Arg<ffi::BufferR0<ffi::S32>>()  // row_begin: first row held
                                  .Ret<ffi::Buffer<ffi::F32>>()    // p
                                  .Ret<ffi::Buffer<ffi::F32>>()    // trace
                                  .Attr<int64_t>("num_rows")
                                  .Attr<int64_t>("nesterov")
                                  .Attr<int64_t>("unique")
                                  .Attr<int64_t>("threads"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(OptaxSparseAdamFtrlRows, optax_sparse_adam::FtrlRowsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()    // accumulator
                                  .Arg<ffi::Buffer<ffi::F32>>()    // linear
                                  .Arg<ffi::Buffer<ffi::F32>>()    // p (read)
                                  .Arg<ffi::BufferR1<ffi::S32>>()  // keys
                                  .Arg<ffi::Buffer<ffi::F32>>()    // values
                                  .Arg<ffi::BufferR1<ffi::F32>>()  // scalars
                                  .Arg<ffi::BufferR0<ffi::S32>>()  // row_begin: first row held
                                  .Ret<ffi::Buffer<ffi::F32>>()    // accumulator
                                  .Ret<ffi::Buffer<ffi::F32>>()    // linear
                                  .Ret<ffi::Buffer<ffi::S32>>()    // keys, distinct first
                                  .Ret<ffi::Buffer<ffi::F32>>()    // step rows
                                  .Attr<int64_t>("num_rows")
                                  .Attr<int64_t>("root")
                                  .Attr<int64_t>("shrinks")
                                  .Attr<int64_t>("divides")
                                  .Attr<int64_t>("unique")
                                  .Attr<int64_t>("threads"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(OptaxSparseAdamFtrlApply, optax_sparse_adam::FtrlApplyImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()    // p
                                  .Arg<ffi::Buffer<ffi::F32>>()    // accumulator
                                  .Arg<ffi::Buffer<ffi::F32>>()    // linear
                                  .Arg<ffi::BufferR1<ffi::S32>>()  // keys
                                  .Arg<ffi::Buffer<ffi::F32>>()    // values
                                  .Arg<ffi::BufferR1<ffi::F32>>()  // scalars
                                  .Arg<ffi::BufferR0<ffi::S32>>()  // row_begin: first row held
                                  .Ret<ffi::Buffer<ffi::F32>>()    // p
                                  .Ret<ffi::Buffer<ffi::F32>>()    // accumulator
                                  .Ret<ffi::Buffer<ffi::F32>>()    // linear
                                  .Attr<int64_t>("num_rows")
                                  .Attr<int64_t>("root")
                                  .Attr<int64_t>("shrinks")
                                  .Attr<int64_t>("divides")
                                  .Attr<int64_t>("unique")
                                  .Attr<int64_t>("threads"));

// The operands of both catch-up momentum handlers (the rows handler reads p).
#define OSA_CATCH_UP_MOMENTUM_OPERANDS                                                  \
  Arg<ffi::Buffer<ffi::F32>>()         /* p */                                          \
      .Arg<ffi::Buffer<ffi::F32>>()    /* trace */                                      \
      .Arg<ffi::BufferR1<ffi::S32>>()  /* last_step: per row, the step recorded */      \
      .Arg<ffi::BufferR1<ffi::S32>>()  /* keys */                                       \
      .Arg<ffi::Buffer<ffi::F32>>()    /* values */                                     \
      .Arg<ffi::BufferR1<ffi::F32>>()  /* scalars */                                    \
      .Arg<ffi::BufferR1<ffi::F32>>()  /* window: C of rows idle 1 .. cap steps */      \
      .Arg<ffi::BufferR1<ffi::F32>>()  /* powers: the momentum's table */               \
      .Arg<ffi::BufferR2<ffi::F32>>()  /* per_key: C, momentum**idle, or empty */       \
      .Arg<ffi::BufferR2<ffi::F32>>()  /* far: the record's coefficients, or empty */   \
      .Arg<ffi::BufferR1<ffi::S32>>()  /* far_steps: the record's last steps, or empty */ \
      .Arg<ffi::BufferR1<ffi::S32>>()  /* counts: the step's (recorded), done */        \
      .Arg<ffi::BufferR0<ffi::S32>>()  /* row_begin: first row held */

XLA_FFI_DEFINE_HANDLER_SYMBOL(OptaxSparseAdamCatchUpMomentumApply, optax_sparse_adam::CatchUpMomentumApplyImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .OSA_CATCH_UP_MOMENTUM_OPERANDS
                                  .Ret<ffi::Buffer<ffi::F32>>()    // p
                                  .Ret<ffi::Buffer<ffi::F32>>()    // trace
                                  .Ret<ffi::BufferR1<ffi::S32>>()  // last_step
                                  .Ret<ffi::BufferR1<ffi::S32>>()  // flags
                                  .Attr<int64_t>("num_rows")
                                  .Attr<int64_t>("cap")
                                  .Attr<int64_t>("per_key")
                                  .Attr<int64_t>("nesterov")
                                  .Attr<int64_t>("unique")
                                  .Attr<int64_t>("threads"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(OptaxSparseAdamCatchUpMomentumRows, optax_sparse_adam::CatchUpMomentumRowsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .OSA_CATCH_UP_MOMENTUM_OPERANDS
                                  .Ret<ffi::Buffer<ffi::F32>>()    // trace
                                  .Ret<ffi::BufferR1<ffi::S32>>()  // last_step
                                  .Ret<ffi::Buffer<ffi::S32>>()    // keys, packed
                                  .Ret<ffi::Buffer<ffi::F32>>()    // step rows
                                  .Ret<ffi::BufferR1<ffi::S32>>()  // flags
                                  .Attr<int64_t>("num_rows")
                                  .Attr<int64_t>("cap")
                                  .Attr<int64_t>("per_key")
                                  .Attr<int64_t>("nesterov")
                                  .Attr<int64_t>("unique")
                                  .Attr<int64_t>("threads"));

#undef OSA_CATCH_UP_MOMENTUM_OPERANDS
