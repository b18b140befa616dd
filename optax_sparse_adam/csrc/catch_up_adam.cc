// Lazy Adam with exact catch-up (sparse_adam(catch_up=True), and with
// decay sparse_adamw(catch_up=True)) and its application, as an XLA FFI
// handler for the CPU:
//   optax_sparse_adam_v9_catch_up_adam_apply
//     (p, mu, nu, last_step, decay_mark, keys, values, scalars, window, far, far_steps, powers, through, limits,
//      neg_rates, corrections, counts) -> (p, mu, nu, last_step, decay_mark, flags)
// (scalars: Adam's 10, AdamW's 11 with `decay`, then optionally the
// global-norm clipping's divisor and factor, each summed gradient row then
// clipped first as sparse_adam.cc does; the attribute far_by_key says
// whether far holds a row per key, which an empty batch's operands cannot
// say), and tx.update's rule:
//   optax_sparse_adam_v9_catch_up_adam_rows
//     (the same operands and attributes, p read only)
//     -> (mu, nu, last_step, decay_mark, keys, updates, flags)
// each touched row replayed and stepped in a scratch copy, its update (UpdateOfRow) packed as sparse_adam.cc's
// rows handler packs its step rows.
// Each touched row first takes the `idle` steps it sat out as _catch_up.replay
// takes them, then Adam's step as sparse_adam.cc takes it, and its records
// are written as the XLA rule writes them: last_step max(last_step, count)
// (the step's count, counts[0]), and where decay_mark is a table (AdamW's state; a
// zero-size one otherwise) min(decay_mark, limits[4]) (the decay's log after
// the step), NaN kept as jnp.minimum keeps it. Per element, the idle steps' displacement is the closed
// form, from the row's C_0..C_{T-1} of the series in z = eps / sqrt(v), which
// this kernel picks as _catch_up._coefficients does (window[idle - 1] for a
// row idle at most `cap` steps; for one idle longer, the long-idle table's
// entry of its last step, or with far_by_key the key's own, or where
// far_steps is given the state's record's (_catch_up.IdleRecord: far holds
// its coefficients, far_offset rows on, far_steps the last step each entry
// is for; a row whose last step L its entry L mod len(far_steps) is not for
// is flagged, and the XLA path computes its coefficients), and from the
// row's b1**idle and b2**idle, where the series reaches float32 resolution
// (z * limits[0] <= limits[1]); an element it does not reach (tiny or zero v)
// with m != 0 takes the first min(idle, cap) idle steps one by one, in
// _catch_up._replay_steps' arithmetic: each step's -lr from neg_rates (the
// window of the last `cap` steps) or limits[2] (rows idle longer, a constant
// learning rate), its bias corrections from the table `corrections` (by the
// step's count, the last entry standing for every later count). A row that
// needs those steps where they are not at hand (a schedule's rate for a row
// idle longer than the window: limits[2] is NaN; no table: limits[3] == 0) is
// left as it is, its records too, and flagged in every entry it has; the XLA
// path then takes it. Tables are aliased to results.
//
//   i = 1 / sqrt(v), z = eps i, S = C_{T-1}, S = C_j - z S for j = T-2 .. 0
//   p = p + (-(m i)) S,  m = m b1**idle,  v = v b2**idle
//   then Adam's step from (m, v) and p += neg_lr step (adam_row.h).
//
// The kernel reads each row's idle steps from its record: idle = done - last
// (counts[1] is done, the state's count before the step; without decay 0
// for a row that never moved, last == 0), and b**idle from b's table in
// `powers` (TablePower: (4, 256) floats each, b1's then b2's, then with
// decay gamma's), as _catch_up._power computes them.
//
// With `decay` (AdamW's decoupled decay, sparse_adamw(catch_up=True)) each
// idle step also multiplies the row by gamma = 1 - lr wd first: the row's
// W is the product of gamma over its idle steps (the window's C_j then carry
// the decay of the steps after theirs; a long-idle row's are the far entry's
// times its weight), and
//   p = fma(W, p, (-(m i)) S)
// W is through[idle - 1] for a row idle within the window (`through`, the
// products over the last steps), gamma**idle for one idle longer; the weight
// gamma**idle. Under a schedule, or a rate or decay not known when the step
// is traced (no table of gamma's powers; the attribute decay_from_marks), a
// row idle longer than the window takes both from the state's log of the
// decay: exp(limits[5] - decay_mark), limits[5] the log before the step and
// the row's mark the log when it was last up to date (std::exp, where the
// XLA path takes XLA's exp: they may round apart by an ulp, which the
// parameters' bound covers; the moments and records do not read it).
// The idle steps one by one add wd p to each step, as _replay_steps does; a
// row idle longer than the window takes its first cap steps so, then the
// decay of the rest, gamma**(idle - cap) from gamma's table (without the
// table such rows are flagged); the current step is AdamW's
// (p += neg_lr fma(wd, p, step)). Rows idle since step 0 (never moved) decay
// too: their idle steps are the count before the step (last == 0).
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "adam_row.h"
#include "rows.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace optax_sparse_adam {
namespace {

constexpr int64_t kTerms = 8;  // _catch_up._TERMS

// What taking a row's idle steps one by one needs beyond the row: the rates and the bias corrections.
struct IdleSteps {
  float b1, b2, eps;
  float weight_decay;         // AdamW's decay of each idle step (kDecay)
  float long_neg_lr;          // -lr of the idle steps of rows idle longer than the window; NaN where a schedule
  bool has_corrections;
  const float* neg_rates;     // (cap,): -lr of the idle step with count done - o
  int64_t cap;
  const float* corrections;   // (corrections_len, 2): the bias corrections of the idle step with that count
  int64_t corrections_len;
  const float* gamma_powers;  // with kDecay at a constant rate, gamma's table (TablePower); else nullptr

  // Whether the first min(idle, cap) idle steps of a row can be taken here: a row idle longer than the window
  // needs the constant rate (and with decay gamma's table, for the decay of its steps past the window).
  template <bool kDecay>
  OSA_ROW_INLINE bool CanStep(int32_t idle) const {
    return has_corrections && (idle <= cap || (!std::isnan(long_neg_lr) && (!kDecay || gamma_powers != nullptr)));
  }

  // The row's first min(idle, cap) idle steps one by one, from (p, m, v) into (ps, ms, vs), as
  // _catch_up._replay_steps takes them (dense Adam's arithmetic, with zero gradients, eps_root 0; with kDecay
  // AdamW's, the step plus weight_decay times the row, and the steps past the first cap decaying the row by
  // gamma ** (idle - cap) after them).
  template <bool kTorch, bool kDecay = false>
  OSA_ROW_INLINE void Replay(int32_t last, int32_t idle, const float* __restrict p, const float* __restrict m,
              const float* __restrict v, float* __restrict ps, float* __restrict ms, float* __restrict vs,
              int64_t width) const {
    for (int64_t j = 0; j < width; ++j) {
      ps[j] = p[j];
      ms[j] = m[j];
      vs[j] = v[j];
    }
    const int64_t n = std::min<int64_t>(idle, cap);
    for (int64_t k = 1; k <= n; ++k) {
      // Clamped below too: a negative last step (a state no step wrote) must not read before the table.
      const int64_t at = std::clamp<int64_t>(static_cast<int64_t>(last) + k, 0, corrections_len - 1);
      const float c1 = corrections[2 * at], c2 = corrections[2 * at + 1];
      const float neg_lr = idle <= cap ? neg_rates[idle - k] : long_neg_lr;
      const float scale = std::sqrt(c2) / c1;  // torch's placement
      for (int64_t j = 0; j < width; ++j) {
        const float mj = b1 * ms[j], vj = b2 * vs[j];
        float step = kTorch ? (scale * mj) / (std::sqrt(vj) + eps) : (mj / c1) / (std::sqrt(vj / c2) + eps);
        if constexpr (kDecay) step = std::fma(weight_decay, ps[j], step);  // step + wd p, as UpdateRow's AdamW
        ms[j] = mj;
        vs[j] = vj;
        ps[j] = std::fma(neg_lr, step, ps[j]);  // XLA:CPU contracts _replay_steps' p + (-lr) * step
      }
    }
    if constexpr (kDecay) {
      if (idle > n) {  // CanStep: a constant rate, gamma's table at hand
        const float rest = TablePower(gamma_powers, static_cast<int32_t>(idle - n));
        for (int64_t j = 0; j < width; ++j) ps[j] = rest * ps[j];
      }
    }
  }
};

// The operands IdleSteps reads, checked.
inline ffi::Error CheckSteps(int64_t cap, const ffi::BufferR1<ffi::F32>& neg_rates,
                             const ffi::BufferR2<ffi::F32>& corrections) {
  if (cap < 0 || static_cast<int64_t>(neg_rates.element_count()) < cap)
    return ffi::Error::InvalidArgument("neg_rates must hold a rate for each of the last `cap` steps");
  const auto table = corrections.dimensions();
  if (table[0] < 1 || table[1] != 2)
    return ffi::Error::InvalidArgument("corrections must hold two bias corrections for each of at least one count");
  return ffi::Error::Success();
}

// What a touched row's idle steps come to: their number, the row's last step, the moments' decays, and with
// AdamW's decay W (the row's scale) and the weight of the long-idle terms.
struct RowIdle {
  int32_t idle, last;
  float decay1, decay2, w, weight;
};

struct CatchUp {
  const float* window;  // (max(cap, 1), kTerms): the coefficients of rows idle 1 .. cap steps
  const float* far;     // (far_rows, kTerms): of rows idle longer, by their last step (or by key)
  int64_t far_rows;
  bool far_by_key;
  const int32_t* far_steps;  // with the state's record, the last step each of its entries is for; else nullptr
  int64_t record_steps;      // the record's entries (far_steps' length)
  int64_t far_offset;        // the record's first row in far (AdamW's variant)
  bool from_log;         // with decay: a long-idle row's W and weight from its mark, exp(old_log - mark)
  float old_log;         // the decay's log before the step
  const float* powers;   // b1's, b2's and with decay gamma's table (TablePower), 1024 floats each
  const float* through;  // (through_len,): with decay, the product of gamma over the last o + 1 steps, by o
  int64_t through_len;
  int32_t done;          // the state's count before the step
  float binv, ratio;
  IdleSteps steps;
  int32_t* flags;       // (k,)
  int32_t* last_step;   // the table's records (local rows)
  float* decay_mark;    // AdamW's, or nullptr
  int32_t count;        // the step's count, recorded
  float new_log;        // the decay's log after the step, recorded in decay_mark

  // The records of a row the kernel stepped (local row r), as the XLA rule writes them (_row_engine.stamp, and
  // AdamW's jnp.minimum(mark, new_log), NaN in either kept).
  void Record(int64_t r) const {
    last_step[r] = std::max(last_step[r], count);
    if (decay_mark != nullptr) {
      const float mark = decay_mark[r];
      decay_mark[r] = std::isnan(mark) || std::isnan(new_log) ? std::numeric_limits<float>::quiet_NaN()
                                                              : std::min(mark, new_log);
    }
  }

  // Local row r's idle steps, from its records before the step is recorded, as
  // _catch_up.replay computes them (int32 arithmetic wrapping as XLA's does).
  template <bool kDecay>
  OSA_ROW_INLINE RowIdle Idle(int64_t r) const {
    RowIdle ri;
    ri.last = last_step[r];
    const auto idle = static_cast<int32_t>(static_cast<uint32_t>(done) - static_cast<uint32_t>(ri.last));
    ri.idle = kDecay || ri.last > 0 ? idle : 0;
    ri.decay1 = TablePower(powers, ri.idle);
    ri.decay2 = TablePower(powers + 1024, ri.idle);
    ri.w = ri.weight = 1.0f;
    if constexpr (kDecay) {
      if (from_log) {  // _catch_up._DecayWeights' rows and far under a schedule: a long-idle row's from its mark
        ri.weight = ri.idle > steps.cap ? std::exp(old_log - decay_mark[r]) : 1.0f;
        ri.w = ri.idle > steps.cap ? ri.weight
               : ri.idle > 0       ? through[std::min<int64_t>(ri.idle - 1, through_len - 1)]
                                   : 1.0f;
      } else {  // _catch_up._DecayWeights' rows and far
        ri.weight = TablePower(powers + 2048, ri.idle);
        ri.w = ri.idle > steps.cap ? ri.weight
               : ri.idle > 0       ? through[std::min<int64_t>(ri.idle - 1, through_len - 1)]
                                   : 1.0f;
      }
    }
    return ri;
  }

  // The series' coefficients of a row idle ri.idle > 0 steps, as _catch_up._coefficients picks them (entry
  // `slot` standing for it); with decay a long-idle row's are the far entry's times its weight, written into
  // `scratch` (kTerms floats). nullptr for a long-idle row whose entry the state's record does not hold.
  template <bool kDecay>
  OSA_ROW_INLINE const float* Terms(int64_t slot, const RowIdle& ri, float* __restrict scratch) const {
    const int32_t n = ri.idle;
    if (n <= steps.cap) return window + static_cast<int64_t>(n - 1) * kTerms;
    int64_t at;
    if (far_steps != nullptr) {  // the record's entry for the row's last step
      const int64_t entry = RecordEntry(far_steps, record_steps, ri.last);
      if (entry < 0) return nullptr;
      at = far_offset + entry;
    } else {
      at = far_by_key ? slot : std::clamp<int64_t>(ri.last, 0, far_rows - 1);
    }
    const float* f = far + at * kTerms;
    if constexpr (!kDecay) {
      return f;
    } else {
      for (int64_t j = 0; j < kTerms; ++j) scratch[j] = f[j] * ri.weight;
      return scratch;
    }
  }

  // Brings local row r's records into the cache ahead of its turn.
  void Prefetch(int64_t r) const {
    __builtin_prefetch(last_step + r, 1, 3);
    if (decay_mark != nullptr) __builtin_prefetch(decay_mark + r, 1, 3);
  }
};

// The series sum_j (-z)^j C_j of a row's coefficients c, by Horner's rule.
OSA_ROW_INLINE float Series(const float* c, float z) {
  float series = c[kTerms - 1];
  for (int64_t i = kTerms - 2; i >= 0; --i) series = c[i] - z * series;
  return series;
}

// The row's idle steps, in place: the closed form where the series takes an element (z * binv <= ratio, as the
// XLA path tests it; false for NaN), the steps one by one where it does not and m != 0. False, and nothing
// written, where those steps are needed and cannot be taken here. `work` holds 5 * width + kTerms floats. With
// kDecay the row is first scaled by its decay W, as _catch_up.replay scales it.
template <bool kTorch, bool kDecay>
OSA_ROW_INLINE bool CatchUpRow(const Scalars& s, const CatchUp& cu, int64_t slot, const RowIdle& ri,
                               float* __restrict p, float* __restrict m, float* __restrict v, float* __restrict work,
                               int64_t width) {
  const float eps = s.eps, binv = cu.binv, ratio = cu.ratio;
  const float decay1 = ri.decay1, decay2 = ri.decay2;
  const float w = kDecay ? ri.w : 1.0f;
  // The replay's (W p) + shift, as one multiply-add (the parameters' bound covers XLA:CPU's rounding it either
  // way); without decay, p + shift.
  auto moved = [w](float pj, float shift) { return kDecay ? std::fma(w, pj, shift) : pj + shift; };
  // A row whose first moment is zero throughout (one that never moved, which AdamW decays from step 0) takes no
  // shift in any element, whatever its z (the XLA path's shift is 0 where m == 0): no roots, no series.
  int32_t nonzero = 0;
  for (int64_t j = 0; j < width; ++j) nonzero |= m[j] != 0.0f;
  if (nonzero == 0) {
    for (int64_t j = 0; j < width; ++j) {
      p[j] = moved(p[j], 0.0f);
      m[j] = m[j] * decay1;
      v[j] = v[j] * decay2;
    }
    return true;
  }
  const float* c = cu.Terms<kDecay>(slot, ri, work + 5 * width);
  if (c == nullptr) return false;  // coefficients not at hand: the XLA path takes the row
  float* __restrict z = work;
  float* __restrict shift = work + width;
  // Each element's z and its closed form's shift in one pass (the shift is garbage where the series does not take
  // the element, and not read there). An int OR of the elements the series does not take, not a bool AND: GCC
  // vectorizes this loop only in that form (with `takes &= ...` it took a scalar square root and division per
  // element).
  int32_t refused = 0;
  for (int64_t j = 0; j < width; ++j) {
    const float inverse = 1.0f / std::sqrt(v[j]);
    const float zj = eps * inverse;
    z[j] = zj;
    shift[j] = (-(m[j] * inverse)) * Series(c, zj);
    refused |= !(zj * binv <= ratio);
  }
  if (refused == 0) {
    for (int64_t j = 0; j < width; ++j) {
      p[j] = moved(p[j], shift[j]);
      m[j] = m[j] * decay1;
      v[j] = v[j] * decay2;
    }
    return true;
  }
  bool steps = false;
  for (int64_t j = 0; j < width; ++j) steps |= !(z[j] * binv <= ratio) && m[j] != 0.0f;
  float* __restrict ps = work + 2 * width;
  if (steps) {
    if (!cu.steps.CanStep<kDecay>(ri.idle)) return false;
    cu.steps.Replay<kTorch, kDecay>(ri.last, ri.idle, p, m, v, ps, work + 3 * width, work + 4 * width, width);
  }
  for (int64_t j = 0; j < width; ++j) {
    if (z[j] * binv <= ratio) {
      p[j] = moved(p[j], shift[j]);
    } else if (m[j] != 0.0f) {
      p[j] = ps[j];
    } else {
      p[j] = moved(p[j], 0.0f);  // the XLA path's W p + shift, the shift 0
    }
    m[j] = m[j] * decay1;
    v[j] = v[j] * decay2;
  }
  return true;
}

// Local row r, whose gradient is g, entry `slot` standing for it; false (nothing written) for a flagged row. Its
// records are written where it is stepped.
template <bool kTorch, bool kMaximize, bool kDecay>
OSA_ROW_INLINE bool Row(const Scalars& s, const CatchUp& cu, int64_t slot, int64_t r, const float* g, float* p,
                        float* m, float* v, float* work, int64_t width) {
  const RowIdle ri = cu.Idle<kDecay>(r);
  if (ri.idle > 0 && !CatchUpRow<kTorch, kDecay>(s, cu, slot, ri, p, m, v, work, width)) return false;
  UpdateRow<kTorch, kMaximize, true, kDecay>(s, g, m, v, p, width);
  cu.Record(r);
  return true;
}

// tx.update's rule on local row r: the stored row `p` is read, not written; the row's update goes to `out`, as
// _catch_up._rule (and AdamWLeaf.rule with kDecay) computes it: the row replayed into scratch (CatchUpRow), Adam's
// step u (adam_row.h's UpdateRow), with kDecay u + wd (the replayed row) as one multiply-add, times neg_lr (-lr),
// and where the replay moved the row, (replayed + step) - p, which apply_updates adds to p (caught_up_update).
// Moved: without decay, an element of the replayed row changed (or is NaN); with it, or with AdamW's decay mark on a
// table its mask leaves out (AdamWLeaf.rule), the row sat out a step. False,
// and a row of NaN written, for a row whose idle steps are not at hand (its moments and records as they were: the
// caller takes such rows by the XLA rule).
template <bool kTorch, bool kMaximize, bool kDecay>
OSA_ROW_INLINE bool UpdateOfRow(const Scalars& s, const CatchUp& cu, int64_t slot, int64_t r, const float* g,
                                const float* __restrict p, float* m, float* v, float* __restrict out,
                                float* __restrict work, int64_t width) {
  const RowIdle ri = cu.Idle<kDecay>(r);
  float* __restrict q = work + 5 * width + kTerms;
  int32_t moved = 0;
  const float* caught = p;
  if (ri.idle > 0) {
    std::memcpy(q, p, sizeof(float) * static_cast<size_t>(width));
    if (!CatchUpRow<kTorch, kDecay>(s, cu, slot, ri, q, m, v, work, width)) {
      std::fill(out, out + width, std::numeric_limits<float>::quiet_NaN());
      return false;
    }
    caught = q;
    if (kDecay || cu.decay_mark != nullptr) {
      moved = 1;
    } else {
      for (int64_t j = 0; j < width; ++j) moved |= !(q[j] == p[j]);
    }
  }
  if constexpr (kDecay) {
    Scalars unit = s;
    unit.neg_lr = 1.0f;  // u itself: 1 * u
    UpdateRow<kTorch, kMaximize, false, false>(unit, g, m, v, out, width);
    const float weight_decay = s.weight_decay, neg_lr = s.neg_lr;
    for (int64_t j = 0; j < width; ++j) out[j] = neg_lr * std::fma(weight_decay, caught[j], out[j]);
  } else {
    UpdateRow<kTorch, kMaximize, false, false>(s, g, m, v, out, width);
  }
  if (moved != 0) {
    for (int64_t j = 0; j < width; ++j) out[j] = CaughtUpUpdate(caught[j] + out[j], p[j]);
  }
  cu.Record(r);
  return true;
}

// The distinct rows [lo, hi) of a coalesced batch: stepped in place, or with kRows (tx.update's rule) their updates
// written to `out` in the rows' slots (`q` read only).
template <bool kTorch, bool kMaximize, bool kDecay, bool kRows = false>
OSA_TARGET_CLONES void CoalescedRows(const Scalars& s, const CatchUp& cu, const Coalesced& c, const Shard& shard,
                                     const float* values, float* q, float* m, float* v, int64_t width, int64_t lo,
                                     int64_t hi, float* out = nullptr) {
  std::vector<float> g(static_cast<size_t>(width)), work((kRows ? 6 : 5) * static_cast<size_t>(width) + kTerms);
  for (int64_t d = lo; d < hi; ++d) {
    if (d + kPrefetchDistance < hi && shard.Owns(c.row[d + kPrefetchDistance])) {
      const int64_t r = shard.Local(c.row[d + kPrefetchDistance]);
      PrefetchRow(m + r * width, width);
      PrefetchRow(v + r * width, width);
      PrefetchRow(q + r * width, width);
      cu.Prefetch(r);
      PrefetchChain(c, d + kPrefetchDistance, values, width);
    }
    if (!shard.Owns(c.row[d])) {  // another shard's row
      if constexpr (kRows) std::memset(out + c.Slot(d) * width, 0, sizeof(float) * static_cast<size_t>(width));
      continue;
    }
    const int64_t r = shard.Local(c.row[d]);
    const int32_t first = c.first[d];
    SumChain(c, d, values, width, g.data());
    if (s.clip.on) ClipRow(s.clip, g.data(), width);
    bool stepped;
    if constexpr (kRows) {
      stepped = UpdateOfRow<kTorch, kMaximize, kDecay>(s, cu, first, r, g.data(), q + r * width, m + r * width,
                                               v + r * width, out + c.Slot(d) * width, work.data(), width);
    } else {
      stepped = Row<kTorch, kMaximize, kDecay>(s, cu, first, r, g.data(), q + r * width, m + r * width,
                                               v + r * width, work.data(), width);
    }
    if (!stepped) {
      for (int32_t e = first; e >= 0; e = c.next[e]) cu.flags[e] = 1;
    }
  }
}

template <bool kTorch, bool kMaximize, bool kDecay, bool kRows = false>
OSA_TARGET_CLONES void UniqueRows(const Scalars& s, const CatchUp& cu, const int32_t* keys, const Shard& shard,
                                  const float* values, float* q, float* m, float* v, int64_t width, int64_t lo,
                                  int64_t hi, float* out = nullptr) {
  std::vector<float> work((kRows ? 6 : 5) * static_cast<size_t>(width) + kTerms);
  std::vector<float> clipped(s.clip.on ? static_cast<size_t>(width) : 0);
  for (int64_t i = lo; i < hi; ++i) {
    if (i + kPrefetchDistance < hi && shard.Owns(keys[i + kPrefetchDistance])) {
      const int64_t r = shard.Local(keys[i + kPrefetchDistance]);
      PrefetchRow(m + r * width, width);
      PrefetchRow(v + r * width, width);
      PrefetchRow(q + r * width, width);
      cu.Prefetch(r);
    }
    if (!shard.Owns(keys[i])) {  // padding, or another shard's row
      if constexpr (kRows) std::memset(out + i * width, 0, sizeof(float) * static_cast<size_t>(width));
      continue;
    }
    const int64_t r = shard.Local(keys[i]);
    const float* g = ClippedRow(s.clip, values + i * width, clipped.data(), width);
    bool stepped;
    if constexpr (kRows) {
      stepped = UpdateOfRow<kTorch, kMaximize, kDecay>(s, cu, i, r, g, q + r * width, m + r * width, v + r * width,
                                               out + i * width, work.data(), width);
    } else {
      stepped = Row<kTorch, kMaximize, kDecay>(s, cu, i, r, g, q + r * width, m + r * width, v + r * width,
                                               work.data(), width);
    }
    if (!stepped) cu.flags[i] = 1;
  }
}

// With kRows (tx.update's rule), the rows' updates go to `out`, packed as sparse_adam.cc's rows handler
// packs them (each distinct in-range key once, in order of first occurrence, then padding keys num_rows with zero
// rows; keys taken as distinct in their entries' own slots), the keys to out_keys; p is read only.
template <bool kTorch, bool kMaximize, bool kDecay, bool kRows = false>
void Run(ffi::ThreadPool& pool, const Scalars& s, const Options& o, const CatchUp& cu, const int32_t* keys, int64_t k,
         const Shard& shard, const float* values, float* q, float* m, float* v, int64_t width, float* out = nullptr,
         int32_t* out_keys = nullptr) {
  const auto pad = static_cast<int32_t>(shard.num_rows);
  if (o.unique == 2 || (o.unique == 1 && !HasDuplicate(keys, k, shard.num_rows))) {
    if constexpr (kRows) {
      for (int64_t i = 0; i < k; ++i) out_keys[i] = InRange(keys[i], shard.num_rows) ? keys[i] : pad;
    }
    ParallelForOwned(pool, keys, k, shard, o.threads, [&](int64_t lo, int64_t hi) {
      UniqueRows<kTorch, kMaximize, kDecay, kRows>(s, cu, keys, shard, values, q, m, v, width, lo, hi, out);
    });
    return;
  }
  if constexpr (kRows) {
    ForEachCoalescedPartInOrder(pool, keys, k, shard.num_rows, o.threads, out, width, out_keys, pad,
                                [&](const Coalesced& c) {
                                  CoalescedRows<kTorch, kMaximize, kDecay, kRows>(s, cu, c, shard, values, q, m, v,
                                                                                  width, 0, c.size, out);
                                });
  } else {
    ForEachCoalescedPart(pool, keys, k, shard.begin + shard.local_rows, shard.begin, o.threads,
                         [&](const Coalesced& c) {
                           CoalescedRows<kTorch, kMaximize, kDecay>(s, cu, c, shard, values, q, m, v, width, 0,
                                                                    c.size);
                         });
  }
}

// What the catch-up kernels read of a step beyond the rows, checked (the fused step's handlers and the replay of
// a whole table): `keys` the number of keys (far_by_key: far holds a row each), `decays` AdamW's decay, `marks`
// whether the rows' decay marks are at hand; far_rows is set to far's rows of kTerms coefficients.
ffi::Error CheckStepOperands(int64_t keys, int64_t cap, bool decays, bool marks, bool from_log, bool far_by_key,
                             int64_t far_offset, const ffi::BufferR2<ffi::F32>& window, const ffi::Buffer<ffi::F32>& far,
                             const ffi::BufferR1<ffi::S32>& far_steps, const ffi::BufferR2<ffi::F32>& powers,
                             const ffi::BufferR1<ffi::F32>& through, const ffi::BufferR1<ffi::F32>& limits,
                             const ffi::BufferR1<ffi::F32>& neg_rates, const ffi::BufferR2<ffi::F32>& corrections,
                             const ffi::BufferR1<ffi::S32>& counts, int64_t& far_rows) {
  if (from_log && (!decays || !marks))
    return ffi::Error::InvalidArgument("decay_from_marks needs the decay and the rows' decay marks");
  const int64_t tables = decays && !from_log ? 3 : 2;
  if (powers.dimensions()[1] != 256 || powers.dimensions()[0] != 4 * tables)
    return ffi::Error::InvalidArgument(
        "powers must hold b1's and b2's tables (and with decay gamma's, but for decay_from_marks)");
  if (decays && through.element_count() < 1)
    return ffi::Error::InvalidArgument("through must hold the decay over the window's steps");
  const auto window_dims = window.dimensions(), far_dims = far.dimensions();
  // far: rows of kTerms coefficients, in as many dimensions as it comes (AdamW's record: (variants, steps, terms))
  far_rows = far_dims.size() < 2 ? 0 : static_cast<int64_t>(far.element_count()) / kTerms;
  if (window_dims[1] != kTerms || window_dims[0] < std::max<int64_t>(cap, 1))
    return ffi::Error::InvalidArgument("window must hold 8 coefficients for each idle count up to cap");
  if (far_dims.size() < 2 || far_dims.back() != kTerms || (far_by_key ? far_rows != keys : far_rows < 1))
    return ffi::Error::InvalidArgument("far must hold 8 coefficients per last step (or per key with far_by_key)");
  const auto record_steps = static_cast<int64_t>(far_steps.element_count());
  if (record_steps != 0 && (far_by_key || far_offset < 0 || far_offset + record_steps > far_rows))
    return ffi::Error::InvalidArgument("far must hold the record's entries from far_offset on (not by key)");
  if (limits.element_count() != 6) return ffi::Error::InvalidArgument("limits must hold 6 values");
  if (counts.element_count() != 2) return ffi::Error::InvalidArgument("counts must hold the step's count and done");
  return CheckSteps(cap, neg_rates, corrections);
}

// The CatchUp of a step's operands (checked by CheckStepOperands), its records and flags those given.
CatchUp MakeCatchUp(const Scalars& s, int64_t cap, bool decays, bool from_log, bool far_by_key, int64_t far_offset,
                    int64_t far_rows, const ffi::BufferR2<ffi::F32>& window, const ffi::Buffer<ffi::F32>& far,
                    const ffi::BufferR1<ffi::S32>& far_steps, const ffi::BufferR2<ffi::F32>& powers,
                    const ffi::BufferR1<ffi::F32>& through, const ffi::BufferR1<ffi::F32>& limits,
                    const ffi::BufferR1<ffi::F32>& neg_rates, const ffi::BufferR2<ffi::F32>& corrections,
                    const ffi::BufferR1<ffi::S32>& counts, int32_t* flags, int32_t* last_step, float* decay_mark) {
  const float* limit = limits.typed_data();
  const auto record_steps = static_cast<int64_t>(far_steps.element_count());
  const IdleSteps steps{s.b1,   s.b2, s.eps, s.weight_decay, limit[2], limit[3] != 0.0f, neg_rates.typed_data(),
                        cap, corrections.typed_data(), corrections.dimensions()[0],
                        decays && !from_log ? powers.typed_data() + 2048 : nullptr};
  return CatchUp{window.typed_data(),
                 far.typed_data(),
                 far_rows,
                 far_by_key,
                 record_steps != 0 ? far_steps.typed_data() : nullptr,
                 record_steps,
                 far_offset,
                 from_log,
                 limit[5],
                 powers.typed_data(),
                 through.typed_data(),
                 static_cast<int64_t>(through.element_count()),
                 counts.typed_data()[1],
                 limit[0],
                 limit[1],
                 steps,
                 flags,
                 last_step,
                 decay_mark,
                 counts.typed_data()[0],
                 limit[4]};
}

// Both handlers' step: the fused step into `q` (p's result), or with kRows (tx.update's rule) from the
// stored p (`q`, read only) into the rows' updates (rows_out, keys_out).
template <bool kRows>
ffi::Error Handle(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& p, ffi::Buffer<ffi::F32>& mu, ffi::Buffer<ffi::F32>& nu,
                  ffi::BufferR1<ffi::S32>& last_step, ffi::BufferR1<ffi::F32>& decay_mark,
                  ffi::BufferR1<ffi::S32>& keys, ffi::Buffer<ffi::F32>& values, ffi::BufferR1<ffi::F32>& scalars,
                  ffi::BufferR2<ffi::F32>& window, ffi::Buffer<ffi::F32>& far, ffi::BufferR1<ffi::S32>& far_steps,
                  ffi::BufferR2<ffi::F32>& powers, ffi::BufferR1<ffi::F32>& through,
                  ffi::BufferR1<ffi::F32>& limits,
                  ffi::BufferR1<ffi::F32>& neg_rates, ffi::BufferR2<ffi::F32>& corrections,
                  ffi::BufferR1<ffi::S32>& counts, ffi::BufferR0<ffi::S32>& row_begin, float* q,
                  ffi::ResultBuffer<ffi::F32>& mu_out, ffi::ResultBuffer<ffi::F32>& nu_out,
                  ffi::ResultBufferR1<ffi::S32>& last_step_out, ffi::ResultBufferR1<ffi::F32>& decay_mark_out,
                  ffi::ResultBufferR1<ffi::S32>& flags, float* rows_out, int32_t* keys_out, int64_t num_rows,
                  int64_t cap, int64_t torch_eps, int64_t maximize, int64_t decay, int64_t unique,
                  int64_t far_by_key, int64_t far_offset, int64_t decay_from_marks, int64_t threads) {
  const int64_t k = static_cast<int64_t>(keys.element_count());
  Shard shard{num_rows, *row_begin.typed_data(), 0};
  const auto dims = p.dimensions();
  if (dims.size() < 1) return ffi::Error::InvalidArgument("tables must have at least one dimension");
  shard.local_rows = dims[0];
  if (!shard.Valid()) return ffi::Error::InvalidArgument("row range outside a table of at most 2**31 - 1 rows");
  const int64_t width = RowWidth(dims);
  if (mu.element_count() != p.element_count() || nu.element_count() != p.element_count())
    return ffi::Error::InvalidArgument("mu and nu must have the parameter's shape");
  const bool marks = decay_mark.element_count() != 0;
  if (static_cast<int64_t>(last_step.element_count()) != shard.local_rows ||
      (marks && static_cast<int64_t>(decay_mark.element_count()) != shard.local_rows) ||
      last_step_out->element_count() != last_step.element_count() ||
      decay_mark_out->element_count() != decay_mark.element_count())
    return ffi::Error::InvalidArgument("last_step (and decay_mark unless empty) must have one entry per row");
  if (static_cast<int64_t>(values.element_count()) != k * width)
    return ffi::Error::InvalidArgument("values must have one row per key");
  const int64_t num_scalars = kNumScalars + (decay != 0);  // AdamW's weight decay the eleventh
  if (static_cast<int64_t>(scalars.element_count()) != num_scalars &&
      static_cast<int64_t>(scalars.element_count()) != num_scalars + kNumClipScalars)
    return ffi::Error::InvalidArgument("scalars must hold 10 values (11 with decay; 2 more to clip)");
  if (static_cast<int64_t>(flags->element_count()) != k)
    return ffi::Error::InvalidArgument("flags must have one entry per key");
  // With decay, whether a long-idle row's decay comes from its mark (no table of gamma's powers).
  const bool from_log = decay_from_marks != 0;
  int64_t far_rows = 0;
  if (ffi::Error error = CheckStepOperands(k, cap, decay != 0, marks, from_log, far_by_key != 0, far_offset, window,
                                           far, far_steps, powers, through, limits, neg_rates, corrections, counts,
                                           far_rows);
      error.failure())
    return error;
  float* m = mu_out->typed_data();
  float* v = nu_out->typed_data();
  CopyIfNotAliased(m, mu.typed_data(), mu.element_count());
  CopyIfNotAliased(v, nu.typed_data(), nu.element_count());
  CopyIfNotAliased(last_step_out->typed_data(), last_step.typed_data(), last_step.element_count());
  CopyIfNotAliased(decay_mark_out->typed_data(), decay_mark.typed_data(), decay_mark.element_count());
  std::memset(flags->typed_data(), 0, sizeof(int32_t) * static_cast<size_t>(k));
  Scalars s = ReadScalars(scalars);
  if (decay != 0) s.weight_decay = scalars.typed_data()[kNumScalars];
  s.clip = ReadClip(scalars, num_scalars);
  const CatchUp cu = MakeCatchUp(s, cap, decay != 0, from_log, far_by_key != 0, far_offset, far_rows, window, far,
                                 far_steps, powers, through, limits, neg_rates, corrections, counts,
                                 flags->typed_data(), last_step_out->typed_data(),
                                 marks ? decay_mark_out->typed_data() : nullptr);
  const Options o{torch_eps != 0, maximize != 0, unique, threads};
  auto run = [&](auto torch_eps, auto maximize, auto decays) {
    Run<decltype(torch_eps)::value, decltype(maximize)::value, decltype(decays)::value, kRows>(
        pool, s, o, cu, keys.typed_data(), k, shard, values.typed_data(), q, m, v, width, rows_out, keys_out);
  };
  auto with_decay = [&](auto torch_eps, auto maximize) {
    decay != 0 ? run(torch_eps, maximize, std::true_type{}) : run(torch_eps, maximize, std::false_type{});
  };
  using T = std::true_type;
  using F = std::false_type;
  if (o.torch_eps) {
    o.maximize ? with_decay(T{}, T{}) : with_decay(T{}, F{});
  } else {
    o.maximize ? with_decay(F{}, T{}) : with_decay(F{}, F{});
  }
  return ffi::Error::Success();
}

ffi::Error ApplyImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> p, ffi::Buffer<ffi::F32> mu, ffi::Buffer<ffi::F32> nu,
                     ffi::BufferR1<ffi::S32> last_step, ffi::BufferR1<ffi::F32> decay_mark,
                     ffi::BufferR1<ffi::S32> keys, ffi::Buffer<ffi::F32> values, ffi::BufferR1<ffi::F32> scalars,
                     ffi::BufferR2<ffi::F32> window, ffi::Buffer<ffi::F32> far,
                     ffi::BufferR1<ffi::S32> far_steps, ffi::BufferR2<ffi::F32> powers,
                     ffi::BufferR1<ffi::F32> through, ffi::BufferR1<ffi::F32> limits, ffi::BufferR1<ffi::F32> neg_rates,
                     ffi::BufferR2<ffi::F32> corrections, ffi::BufferR1<ffi::S32> counts,
                     ffi::BufferR0<ffi::S32> row_begin, ffi::ResultBuffer<ffi::F32> p_out,
                     ffi::ResultBuffer<ffi::F32> mu_out, ffi::ResultBuffer<ffi::F32> nu_out,
                     ffi::ResultBufferR1<ffi::S32> last_step_out, ffi::ResultBufferR1<ffi::F32> decay_mark_out,
                     ffi::ResultBufferR1<ffi::S32> flags, int64_t num_rows,
                     int64_t cap, int64_t torch_eps, int64_t maximize, int64_t decay, int64_t unique,
                     int64_t far_by_key, int64_t far_offset, int64_t decay_from_marks, int64_t threads) {
  if (p_out->element_count() != p.element_count()) return ffi::Error::InvalidArgument("p's result must have its shape");
  float* q = p_out->typed_data();
  CopyIfNotAliased(q, p.typed_data(), p.element_count());
  return Handle<false>(pool, p, mu, nu, last_step, decay_mark, keys, values, scalars, window, far, far_steps, powers,
                       through, limits, neg_rates, corrections, counts, row_begin, q, mu_out, nu_out,
                       last_step_out, decay_mark_out, flags, nullptr, nullptr, num_rows, cap, torch_eps, maximize,
                       decay, unique, far_by_key, far_offset, decay_from_marks, threads);
}

// tx.update's rule (sparse_adam(catch_up=True), and with `decay` sparse_adamw(catch_up=True)'s): the apply
// handler's operands and attributes, p read only; the moments and records in place, the keys and the rows' updates
// packed as sparse_adam.cc's rows handler packs them. A flagged row keeps its moments and records, its update NaN.
ffi::Error RowsImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> p, ffi::Buffer<ffi::F32> mu, ffi::Buffer<ffi::F32> nu,
                    ffi::BufferR1<ffi::S32> last_step, ffi::BufferR1<ffi::F32> decay_mark,
                    ffi::BufferR1<ffi::S32> keys, ffi::Buffer<ffi::F32> values, ffi::BufferR1<ffi::F32> scalars,
                    ffi::BufferR2<ffi::F32> window, ffi::Buffer<ffi::F32> far, ffi::BufferR1<ffi::S32> far_steps,
                    ffi::BufferR2<ffi::F32> powers, ffi::BufferR1<ffi::F32> through,
                    ffi::BufferR1<ffi::F32> limits,
                    ffi::BufferR1<ffi::F32> neg_rates, ffi::BufferR2<ffi::F32> corrections,
                    ffi::BufferR1<ffi::S32> counts, ffi::BufferR0<ffi::S32> row_begin,
                    ffi::ResultBuffer<ffi::F32> mu_out, ffi::ResultBuffer<ffi::F32> nu_out,
                    ffi::ResultBufferR1<ffi::S32> last_step_out, ffi::ResultBufferR1<ffi::F32> decay_mark_out,
                    ffi::ResultBufferR1<ffi::S32> keys_out, ffi::ResultBuffer<ffi::F32> step_out,
                    ffi::ResultBufferR1<ffi::S32> flags, int64_t num_rows, int64_t cap, int64_t torch_eps,
                    int64_t maximize, int64_t decay, int64_t unique, int64_t far_by_key, int64_t far_offset,
                    int64_t decay_from_marks, int64_t threads) {
  if (step_out->element_count() != values.element_count() || keys_out->element_count() != keys.element_count())
    return ffi::Error::InvalidArgument("results must have the shapes of keys and values");
  return Handle<true>(pool, p, mu, nu, last_step, decay_mark, keys, values, scalars, window, far, far_steps, powers,
                      through, limits, neg_rates, corrections, counts, row_begin,
                      const_cast<float*>(p.typed_data()), mu_out, nu_out, last_step_out, decay_mark_out, flags,
                      step_out->typed_data(), keys_out->typed_data(), num_rows, cap, torch_eps, maximize, decay, unique,
                      far_by_key, far_offset, decay_from_marks, threads);
}

// The idle steps of gathered rows, one by one (_catch_up.replay's elements the series does not take):
//   optax_sparse_adam_v9_catch_up_adam_steps
//     (p, mu, nu, last, idle, limits, neg_rates, corrections, powers) -> (p, flags)
// Each row with idle > 0 takes its first min(idle, cap) idle steps as IdleSteps::Replay takes them, every
// element (the caller keeps the ones it needs); the moments are read, not written. limits: b1, b2, eps,
// long_neg_lr, has_corrections, and with `decay` (AdamW's, sparse_adamw(catch_up=True)) the weight decay: each
// step then adds wd p, and a row idle longer than the window decays by gamma**(idle - cap) after its first cap
// steps, from gamma's table in `powers` (TablePower; empty under a schedule, where such rows have no constant
// rate either). A row whose steps are not at hand is left as it is and flagged.
template <bool kTorch, bool kDecay>
OSA_TARGET_CLONES void StepRange(const IdleSteps& steps, const int32_t* last, const int32_t* idle, const float* m,
                                 const float* v, float* q, int32_t* flags, int64_t width, int64_t lo, int64_t hi) {
  std::vector<float> work(3 * static_cast<size_t>(width));
  for (int64_t r = lo; r < hi; ++r) {
    if (idle[r] <= 0) continue;
    if (!steps.CanStep<kDecay>(idle[r])) {
      flags[r] = 1;
      continue;
    }
    float* row = q + r * width;
    steps.Replay<kTorch, kDecay>(last[r], idle[r], row, m + r * width, v + r * width, work.data(),
                                 work.data() + width, work.data() + 2 * width, width);
    std::memcpy(row, work.data(), sizeof(float) * static_cast<size_t>(width));
  }
}

template <bool kTorch, bool kDecay>
void StepRows(ffi::ThreadPool& pool, const IdleSteps& steps, const int32_t* last, const int32_t* idle,
              const float* m, const float* v, float* q, int32_t* flags, int64_t rows, int64_t width,
              int64_t threads) {
  ParallelFor(pool, rows, std::min<int64_t>(threads, rows / 32 + 1), [&](int64_t lo, int64_t hi) {
    StepRange<kTorch, kDecay>(steps, last, idle, m, v, q, flags, width, lo, hi);
  });
}

ffi::Error StepsImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> p, ffi::Buffer<ffi::F32> mu,
                     ffi::Buffer<ffi::F32> nu, ffi::BufferR1<ffi::S32> last, ffi::BufferR1<ffi::S32> idle,
                     ffi::BufferR1<ffi::F32> limits, ffi::BufferR1<ffi::F32> neg_rates,
                     ffi::BufferR2<ffi::F32> corrections, ffi::BufferR2<ffi::F32> powers,
                     ffi::BufferR0<ffi::S32> row_begin, ffi::ResultBuffer<ffi::F32> p_out,
                     ffi::ResultBufferR1<ffi::S32> flags, int64_t num_rows, int64_t cap, int64_t torch_eps,
                     int64_t decay, int64_t threads) {
  (void)row_begin;
  (void)num_rows;
  const auto dims = p.dimensions();
  if (dims.size() < 1) return ffi::Error::InvalidArgument("rows must have at least one dimension");
  const int64_t rows = dims[0];
  const int64_t width = RowWidth(dims);
  if (mu.element_count() != p.element_count() || nu.element_count() != p.element_count())
    return ffi::Error::InvalidArgument("mu and nu must have the rows' shape");
  if (static_cast<int64_t>(last.element_count()) != rows || static_cast<int64_t>(idle.element_count()) != rows ||
      static_cast<int64_t>(flags->element_count()) != rows)
    return ffi::Error::InvalidArgument("last, idle and flags must have one entry per row");
  if (limits.element_count() != (decay != 0 ? 6u : 5u))
    return ffi::Error::InvalidArgument("limits must hold 5 values (6 with decay)");
  if (ffi::Error error = CheckSteps(cap, neg_rates, corrections); error.failure()) return error;
  const auto table = corrections.dimensions();
  const int64_t gamma_tables = powers.dimensions()[0];
  if (powers.dimensions()[1] != 256 || (gamma_tables != 0 && (gamma_tables != 4 || decay == 0)))
    return ffi::Error::InvalidArgument("powers must be empty, or with decay gamma's table (4, 256)");
  float* q = p_out->typed_data();
  CopyIfNotAliased(q, p.typed_data(), p.element_count());
  std::memset(flags->typed_data(), 0, sizeof(int32_t) * static_cast<size_t>(rows));
  const float* limit = limits.typed_data();
  const IdleSteps steps{limit[0],
                        limit[1],
                        limit[2],
                        decay != 0 ? limit[5] : 0.0f,
                        limit[3],
                        limit[4] != 0.0f,
                        neg_rates.typed_data(),
                        cap,
                        corrections.typed_data(),
                        table[0],
                        gamma_tables != 0 ? powers.typed_data() : nullptr};
  auto run = [&](auto torch, auto decays) {
    StepRows<decltype(torch)::value, decltype(decays)::value>(pool, steps, last.typed_data(), idle.typed_data(),
                                                             mu.typed_data(), nu.typed_data(), q,
                                                             flags->typed_data(), rows, width, threads);
  };
  using T = std::true_type;
  using F = std::false_type;
  if (torch_eps != 0) {
    decay != 0 ? run(T{}, T{}) : run(T{}, F{});
  } else {
    decay != 0 ? run(F{}, T{}) : run(F{}, F{});
  }
  return ffi::Error::Success();
}

// catch_up's replay of every row of a table (_catch_up.catch_up on sparse_adam(catch_up=True)'s and
// sparse_adamw(catch_up=True)'s tables), in place:
//   optax_sparse_adam_v9_catch_up_adam_replay
//     (p, mu, nu, last_step, decay_mark, hp, window, far, far_steps, powers, through, limits, neg_rates,
//      corrections, counts, row_begin) -> (p, mu, nu, flags)
// Each row with idle steps takes them as the fused step takes a touched row's (CatchUpRow: the closed form, and
// the steps one by one for the elements the series does not take), without a step after them. The records are
// read, not written (catch_up writes them). hp: b1, b2, eps and the weight decay (0 without `decay`); the other
// operands and attributes are catch_up_adam_apply's (far by the rows' last steps or the state's record, not by
// key; counts: done twice). A row whose idle steps or coefficients are not at hand is left as it is and flagged,
// for the caller's XLA path.
template <bool kTorch, bool kDecay>
OSA_TARGET_CLONES void ReplayRange(const Scalars& s, const CatchUp& cu, float* p, float* m, float* v,
                                   int32_t* flags, int64_t width, int64_t lo, int64_t hi) {
  std::vector<float> work(5 * static_cast<size_t>(width) + kTerms);
  for (int64_t r = lo; r < hi; ++r) {
    const RowIdle ri = cu.Idle<kDecay>(r);
    if (ri.idle > 0 &&
        !CatchUpRow<kTorch, kDecay>(s, cu, r, ri, p + r * width, m + r * width, v + r * width, work.data(), width))
      flags[r] = 1;
  }
}

ffi::Error ReplayImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> p, ffi::Buffer<ffi::F32> mu,
                      ffi::Buffer<ffi::F32> nu, ffi::BufferR1<ffi::S32> last_step, ffi::BufferR1<ffi::F32> decay_mark,
                      ffi::BufferR1<ffi::F32> hp, ffi::BufferR2<ffi::F32> window, ffi::Buffer<ffi::F32> far,
                      ffi::BufferR1<ffi::S32> far_steps, ffi::BufferR2<ffi::F32> powers,
                      ffi::BufferR1<ffi::F32> through, ffi::BufferR1<ffi::F32> limits,
                      ffi::BufferR1<ffi::F32> neg_rates, ffi::BufferR2<ffi::F32> corrections,
                      ffi::BufferR1<ffi::S32> counts, ffi::BufferR0<ffi::S32> row_begin,
                      ffi::ResultBuffer<ffi::F32> p_out, ffi::ResultBuffer<ffi::F32> mu_out,
                      ffi::ResultBuffer<ffi::F32> nu_out, ffi::ResultBufferR1<ffi::S32> flags, int64_t num_rows,
                      int64_t cap, int64_t torch_eps, int64_t decay, int64_t far_offset, int64_t decay_from_marks,
                      int64_t threads) {
  (void)row_begin;  // rows are independent
  (void)num_rows;
  const auto dims = p.dimensions();
  if (dims.size() < 1) return ffi::Error::InvalidArgument("tables must have at least one dimension");
  const int64_t rows = dims[0];
  const int64_t width = RowWidth(dims);
  if (mu.element_count() != p.element_count() || nu.element_count() != p.element_count() ||
      p_out->element_count() != p.element_count())
    return ffi::Error::InvalidArgument("mu, nu and p's result must have the parameter's shape");
  const bool marks = decay_mark.element_count() != 0;
  if (static_cast<int64_t>(last_step.element_count()) != rows ||
      (marks && static_cast<int64_t>(decay_mark.element_count()) != rows) ||
      static_cast<int64_t>(flags->element_count()) != rows)
    return ffi::Error::InvalidArgument("last_step, flags (and decay_mark unless empty) must have one entry per row");
  if (hp.element_count() != 4) return ffi::Error::InvalidArgument("hp must hold b1, b2, eps and the weight decay");
  const bool from_log = decay_from_marks != 0;
  int64_t far_rows = 0;
  if (ffi::Error error = CheckStepOperands(0, cap, decay != 0, marks, from_log, false, far_offset, window, far,
                                           far_steps, powers, through, limits, neg_rates, corrections, counts,
                                           far_rows);
      error.failure())
    return error;
  float* q = p_out->typed_data();
  float* m = mu_out->typed_data();
  float* v = nu_out->typed_data();
  CopyIfNotAliased(q, p.typed_data(), p.element_count());
  CopyIfNotAliased(m, mu.typed_data(), mu.element_count());
  CopyIfNotAliased(v, nu.typed_data(), nu.element_count());
  std::memset(flags->typed_data(), 0, sizeof(int32_t) * static_cast<size_t>(rows));
  Scalars s{};
  const float* h = hp.typed_data();
  s.b1 = h[0];
  s.b2 = h[1];
  s.eps = h[2];
  s.weight_decay = decay != 0 ? h[3] : 0.0f;
  // The records, read only here (CatchUp writes them only when it records a stepped row).
  const CatchUp cu = MakeCatchUp(s, cap, decay != 0, from_log, false, far_offset, far_rows, window, far, far_steps,
                                 powers, through, limits, neg_rates, corrections, counts, flags->typed_data(),
                                 const_cast<int32_t*>(last_step.typed_data()),
                                 marks ? const_cast<float*>(decay_mark.typed_data()) : nullptr);
  int32_t* flag = flags->typed_data();
  auto run = [&](auto torch, auto decays) {
    ParallelFor(pool, rows, std::min<int64_t>(threads, rows / 32 + 1), [&](int64_t lo, int64_t hi) {
      ReplayRange<decltype(torch)::value, decltype(decays)::value>(s, cu, q, m, v, flag, width, lo, hi);
    });
  };
  using T = std::true_type;
  using F = std::false_type;
  if (torch_eps != 0) {
    decay != 0 ? run(T{}, T{}) : run(T{}, F{});
  } else {
    decay != 0 ? run(F{}, T{}) : run(F{}, F{});
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace optax_sparse_adam

// The operands of both catch-up Adam handlers (the rows handler reads p).
#define OSA_CATCH_UP_ADAM_ARGS                                                                     \
  Arg<ffi::Buffer<ffi::F32>>()         /* p */                                                     \
      .Arg<ffi::Buffer<ffi::F32>>()    /* mu */                                                    \
      .Arg<ffi::Buffer<ffi::F32>>()    /* nu */                                                    \
      .Arg<ffi::BufferR1<ffi::S32>>()  /* last_step: per row, the step recorded */                 \
      .Arg<ffi::BufferR1<ffi::F32>>()  /* decay_mark: per row (AdamW), or empty */                 \
      .Arg<ffi::BufferR1<ffi::S32>>()  /* keys */                                                  \
      .Arg<ffi::Buffer<ffi::F32>>()    /* values */                                                \
      .Arg<ffi::BufferR1<ffi::F32>>()  /* scalars */                                               \
      .Arg<ffi::BufferR2<ffi::F32>>()  /* window: coefficients by idle count */                    \
      .Arg<ffi::Buffer<ffi::F32>>()    /* far: of long-idle rows, by last step or key, (..., 8) */  \
      .Arg<ffi::BufferR1<ffi::S32>>()  /* far_steps: the record's last steps, or empty */          \
      .Arg<ffi::BufferR2<ffi::F32>>()  /* powers: b1's, b2's[, gamma's] tables */                  \
      .Arg<ffi::BufferR1<ffi::F32>>()  /* through: the window's decay (AdamW) */                   \
      .Arg<ffi::BufferR1<ffi::F32>>()  /* limits: binv, ratio, long_neg_lr, has table, logs */     \
      .Arg<ffi::BufferR1<ffi::F32>>()  /* neg_rates: the window's -lr, by offset */                \
      .Arg<ffi::BufferR2<ffi::F32>>()  /* corrections: (c1, c2) by the step's count */             \
      .Arg<ffi::BufferR1<ffi::S32>>()  /* counts: (2,), the step's (recorded), done */             \
      .Arg<ffi::BufferR0<ffi::S32>>()  /* row_begin: first row held */

XLA_FFI_DEFINE_HANDLER_SYMBOL(OptaxSparseAdamCatchUpApply, optax_sparse_adam::ApplyImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .OSA_CATCH_UP_ADAM_ARGS
                                  .Ret<ffi::Buffer<ffi::F32>>()     // p
                                  .Ret<ffi::Buffer<ffi::F32>>()     // mu
                                  .Ret<ffi::Buffer<ffi::F32>>()     // nu
                                  .Ret<ffi::BufferR1<ffi::S32>>()  // last_step
                                  .Ret<ffi::BufferR1<ffi::F32>>()   // decay_mark
                                  .Ret<ffi::BufferR1<ffi::S32>>()  // flags: per key
                                  .Attr<int64_t>("num_rows")
                                  .Attr<int64_t>("cap")
                                  .Attr<int64_t>("torch_eps")
                                  .Attr<int64_t>("maximize")
                                  .Attr<int64_t>("decay")
                                  .Attr<int64_t>("unique")
                                  .Attr<int64_t>("far_by_key")
                                  .Attr<int64_t>("far_offset")
                                  .Attr<int64_t>("decay_from_marks")
                                  .Attr<int64_t>("threads"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(OptaxSparseAdamCatchUpRows, optax_sparse_adam::RowsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .OSA_CATCH_UP_ADAM_ARGS
                                  .Ret<ffi::Buffer<ffi::F32>>()     // mu
                                  .Ret<ffi::Buffer<ffi::F32>>()     // nu
                                  .Ret<ffi::BufferR1<ffi::S32>>()  // last_step
                                  .Ret<ffi::BufferR1<ffi::F32>>()   // decay_mark
                                  .Ret<ffi::BufferR1<ffi::S32>>()  // keys, distinct first
                                  .Ret<ffi::Buffer<ffi::F32>>()     // the rows' updates
                                  .Ret<ffi::BufferR1<ffi::S32>>()  // flags: per key
                                  .Attr<int64_t>("num_rows")
                                  .Attr<int64_t>("cap")
                                  .Attr<int64_t>("torch_eps")
                                  .Attr<int64_t>("maximize")
                                  .Attr<int64_t>("decay")
                                  .Attr<int64_t>("unique")
                                  .Attr<int64_t>("far_by_key")
                                  .Attr<int64_t>("far_offset")
                                  .Attr<int64_t>("decay_from_marks")
                                  .Attr<int64_t>("threads"));

#undef OSA_CATCH_UP_ADAM_ARGS

XLA_FFI_DEFINE_HANDLER_SYMBOL(OptaxSparseAdamCatchUpSteps, optax_sparse_adam::StepsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()     // p: rows
                                  .Arg<ffi::Buffer<ffi::F32>>()     // mu
                                  .Arg<ffi::Buffer<ffi::F32>>()     // nu
                                  .Arg<ffi::BufferR1<ffi::S32>>()  // last: per row
                                  .Arg<ffi::BufferR1<ffi::S32>>()  // idle: per row (0: no steps)
                                  .Arg<ffi::BufferR1<ffi::F32>>()   // limits: b1, b2, eps, long_neg_lr, has table
                                                                    // (and wd with decay)
                                  .Arg<ffi::BufferR1<ffi::F32>>()   // neg_rates: the window's -lr, by offset
                                  .Arg<ffi::BufferR2<ffi::F32>>()   // corrections: (c1, c2) by the step's count
                                  .Arg<ffi::BufferR2<ffi::F32>>()   // powers: gamma's table (decay), or empty
                                  .Arg<ffi::BufferR0<ffi::S32>>()   // row_begin (unused: rows are independent)
                                  .Ret<ffi::Buffer<ffi::F32>>()     // p
                                  .Ret<ffi::BufferR1<ffi::S32>>()  // flags: per row
                                  .Attr<int64_t>("num_rows")
                                  .Attr<int64_t>("cap")
                                  .Attr<int64_t>("torch_eps")
                                  .Attr<int64_t>("decay")
                                  .Attr<int64_t>("threads"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(OptaxSparseAdamCatchUpReplay, optax_sparse_adam::ReplayImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()     // p
                                  .Arg<ffi::Buffer<ffi::F32>>()     // mu
                                  .Arg<ffi::Buffer<ffi::F32>>()     // nu
                                  .Arg<ffi::BufferR1<ffi::S32>>()  // last_step: per row, read only
                                  .Arg<ffi::BufferR1<ffi::F32>>()   // decay_mark: per row (AdamW), or empty
                                  .Arg<ffi::BufferR1<ffi::F32>>()   // hp: b1, b2, eps, weight decay
                                  .Arg<ffi::BufferR2<ffi::F32>>()   // window: coefficients by idle count
                                  .Arg<ffi::Buffer<ffi::F32>>()     // far: of long-idle rows, by last step
                                  .Arg<ffi::BufferR1<ffi::S32>>()  // far_steps: the record's last steps, or empty
                                  .Arg<ffi::BufferR2<ffi::F32>>()   // powers: b1's, b2's[, gamma's] tables
                                  .Arg<ffi::BufferR1<ffi::F32>>()   // through: the window's decay (AdamW)
                                  .Arg<ffi::BufferR1<ffi::F32>>()   // limits: catch_up_adam_apply's
                                  .Arg<ffi::BufferR1<ffi::F32>>()   // neg_rates: the window's -lr, by offset
                                  .Arg<ffi::BufferR2<ffi::F32>>()   // corrections: (c1, c2) by the step's count
                                  .Arg<ffi::BufferR1<ffi::S32>>()  // counts: (2,), done twice
                                  .Arg<ffi::BufferR0<ffi::S32>>()   // row_begin (unused: rows are independent)
                                  .Ret<ffi::Buffer<ffi::F32>>()     // p
                                  .Ret<ffi::Buffer<ffi::F32>>()     // mu
                                  .Ret<ffi::Buffer<ffi::F32>>()     // nu
                                  .Ret<ffi::BufferR1<ffi::S32>>()  // flags: per row
                                  .Attr<int64_t>("num_rows")
                                  .Attr<int64_t>("cap")
                                  .Attr<int64_t>("torch_eps")
                                  .Attr<int64_t>("decay")
                                  .Attr<int64_t>("far_offset")
                                  .Attr<int64_t>("decay_from_marks")
                                  .Attr<int64_t>("threads"));
