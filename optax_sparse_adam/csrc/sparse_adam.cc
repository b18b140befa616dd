// Lazy Adam on the rows a batch touches, as XLA FFI handlers for the CPU.
//
// The handlers share one row loop:
//   optax_sparse_adam_v9_sparse_adam_rows   (mu, nu, keys, values, scalars) -> (mu, nu, keys, step)
//     the sparse leaf rule of scale_by_sparse_adam: new moments in place, and
//     the step rows times the scalar neg_lr (1, or sparse_adam's -lr) packed
//     as the XLA path packs them (distinct keys first, padding after; with
//     `unique`, in the entries' own slots);
//   optax_sparse_adam_v9_sparse_adam_apply  (p, mu, nu, keys, values, scalars) -> (p, mu, nu)
//     the same and p += neg_lr * step, touching each row of p, mu and nu once;
//   optax_sparse_adam_v9_sparse_adamw_apply (p, mu, nu, keys, values, scalars) -> (p, mu, nu)
//     sparse_adamw's lazy step: p += neg_lr * fma(weight_decay, p, step), the
//     weight decay an eleventh scalar;
//   optax_sparse_adam_v9_sparse_adamw_rows  (p, mu, nu, keys, values, scalars) -> (mu, nu, keys, step)
//     its leaf rule for tx.update with the decay and the learning rate: the step rows
//     neg_lr * fma(weight_decay, p, step), packed as above (p read only);
//   optax_sparse_adam_v9_sparse_amsgrad_apply (p, mu, nu, nu_max, keys, values, scalars) -> (p, mu, nu, nu_max)
//     sparse_amsgrad's lazy step: nu_max' = max(nu_max, v' (1 / bc2)),
//     s = (m' (1 / bc1)) / (sqrt(nu_max' + eps_root) + eps), p += neg_lr s;
//   optax_sparse_adam_v9_sparse_amsgrad_rows (mu, nu, nu_max, keys, values, scalars) -> (mu, nu, nu_max, keys, step)
//     its leaf rule for tx.update: the moments in place, the step rows times neg_lr packed as above;
//   optax_sparse_adam_v9_catch_up_amsgrad_apply
//       (p, mu, nu, nu_max, last_step, keys, values, scalars, window, far, powers, decay2, counts)
//       -> (p, mu, nu, nu_max, last_step)
//     sparse_amsgrad(catch_up=True)'s fused step: a row that sat out idle > 0 steps since its record first takes
//     them in their closed form (_amsgrad's replay_rows; IdleRows: C, the sum over the idle steps of
//     lr_t b1^k / (1 - b1^t), from the window or the long-idle table, then b1**idle and b2**idle from their
//     tables, as the XLA path computes them per row), then AMSGrad's step:
//       p = p - C (m / (sqrt(nu_max + eps_root) + eps)),  m = m b1**idle,  v = v b2**idle
//     (the parameters within two ulps of the XLA path's, which rounds the caught-up row and the update apart);
//     each touched row's record takes the step's count, in place: last_step = max(last_step, count);
//   optax_sparse_adam_v9_catch_up_amsgrad_rows
//       (p, mu, nu, nu_max, last_step, keys, values, scalars, window, far, powers, decay2, counts)
//       -> (mu, nu, nu_max, last_step, keys, step)
//     its leaf rule for tx.update: each touched row replayed in a scratch copy of p (read only), its update
//     (replayed + step) - p where it sat out a step, the step elsewhere, packed as the rows handler packs them.
// The apply handlers take two more scalars after the others where the
// gradient was clipped by its global norm (sparse_aware(clip_by_global_norm)):
// each summed row becomes (g / clip_div) * clip_mul first, bitwise what the
// clipping stage computes on the coalesced rows, so the fused step reads the
// batch's entries and no clipped copy of them. Where the table is the only
// leaf the clipping sees, they take one, its max_norm, instead: the handler
// sums the batch's rows once, takes their norm bitwise as the sum_squares
// handler does, clip_div and clip_mul from it (rows.h's Clip), and updates the
// rows from the sums it kept, all in one call; keys taken as distinct (unique)
// are not summed: their entries' norm (rows.h's EntrySquares, as sum_squares
// with `unique` takes it), then each row updated from its entry.
// Tables are aliased to results (input_output_aliases), so under donation
// nothing table-sized is copied. Keys outside [0, num_rows) are padding.
//
// Numerics follow what XLA:CPU compiles the XLA path to, operation by
// operation (it contracts a product into the following add, and turns the
// divisions by the bias corrections into multiplications by their reciprocals,
// where it keeps the clipping's division by the norm: the tests pin each);
// build with -ffp-contract=off so that only the fused multiply-adds written
// here occur:
//   g   = ((0 + g_e1) + g_e2) + ...   over the entries of a row, in entry order
//   g   = (g / clip_div) * clip_mul   (apply handlers given the clipping's scalars)
//   m'  = fma(1 - b1, g, b1 m)        (maximize: fma(b1, m, -((1 - b1) g)))
//   v'  = fma(1 - b2, g g, b2 v)
//   optax: s = (m' (1 / bc1)) / (sqrt(v' (1 / bc2) + eps_root) + eps)
//   torch: s = (torch_scale m') / (sqrt(v' + eps_root) + eps)
//   p'  = p + neg_lr s                (AdamW: p + neg_lr fma(weight_decay, p, s))
// The tests compare both paths bitwise (but for the catch-up's parameters, above).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "adam_row.h"
#include "rows.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace optax_sparse_adam {
namespace {

// sparse_amsgrad(catch_up=True)'s idle steps, from each row's record as _amsgrad's idle_coefficients computes
// them per row: idle = done - last (0 for a row that never moved, last == 0); C, the sum over the idle steps of
// lr_t b1^k / (1 - b1^t), from the window (rows idle 1 .. cap steps) or the long-idle table (by the row's last
// step, clamped, or by its entry under a schedule), as _catch_up._coefficients picks it (0 where cap == 0: b1 == 0);
// b1**idle and b2**idle from their tables (TablePower), or b2's per entry where b2 has no table. The record (the
// table's last steps, local rows) takes the step's count, as the XLA rule stamps it.
struct IdleRows {
  const float* window;  // (max(cap, 1),)
  const float* far;     // (far_rows,)
  int64_t far_rows;
  bool far_by_key;
  int64_t cap;
  const float* powers;  // b1's table, then b2's unless decay2 is given (1024 floats each)
  const float* decay2;  // (k,): b2**idle per entry, or nullptr
  int32_t* last_step;   // per local row
  int32_t count, done;
  const float* table = nullptr;  // tx.update's rule: the stored parameters (local rows), read only
};

// Local row r's idle steps where it has any (entry `slot` standing for it), in place (nu_max does not move while
// a row is idle), and its record; whether it had any.
OSA_ROW_INLINE bool CatchUpAmsgradRow(const Scalars& s, const IdleRows* rows, int64_t slot, int64_t r,
                                      float* __restrict p, float* __restrict m, float* __restrict v,
                                      const float* __restrict vm, int64_t width) {
  const int32_t last = rows->last_step[r];
  rows->last_step[r] = std::max(last, rows->count);
  const int32_t idle = IdleSince(rows->done, last);
  if (idle <= 0) return false;
  float coefficient = 0.0f;
  if (rows->cap > 0) {
    coefficient = idle <= rows->cap ? rows->window[idle - 1]
                  : rows->far_by_key
                      ? rows->far[slot]
                      : rows->far[std::clamp<int64_t>(last, 0, rows->far_rows - 1)];
  }
  const float decay1 = TablePower(rows->powers, idle);
  const float decay2 = rows->decay2 != nullptr ? rows->decay2[slot] : TablePower(rows->powers + 1024, idle);
  const float eps = s.eps, eps_root = s.eps_root;
  for (int64_t j = 0; j < width; ++j) {
    p[j] = p[j] - coefficient * (m[j] / (std::sqrt(vm[j] + eps_root) + eps));
    m[j] = m[j] * decay1;
    v[j] = v[j] * decay2;
  }
  return true;
}

// Local row r's step from its gradient row g, into `dst` (the parameter row with kApply, else its step rows' slot),
// entry `slot` standing for it. With `idle` (sparse_amsgrad(catch_up=True)) the row first takes its idle steps:
// in place with kApply; else (tx.update's rule, as _amsgrad's rule computes it) the stored row is replayed into
// `scratch` and, where the row sat out a step, its update is (replayed + step) - p (caught_up_update).
template <bool kTorch, bool kMaximize, bool kApply, bool kDecay, bool kAmsgrad>
OSA_ROW_INLINE void StepRow(const Scalars& s, const IdleRows* idle, int64_t slot, int64_t r, const float* g, float* m,
                            float* v, float* vm, float* dst, float* scratch, int64_t width) {
  if constexpr (kAmsgrad && kApply) {
    if (idle != nullptr) CatchUpAmsgradRow(s, idle, slot, r, dst, m, v, vm, width);
  } else if constexpr (kAmsgrad) {
    if (idle != nullptr) {
      const float* p = idle->table + r * width;
      std::memcpy(scratch, p, sizeof(float) * static_cast<size_t>(width));
      const bool moved = CatchUpAmsgradRow(s, idle, slot, r, scratch, m, v, vm, width);
      UpdateRow<kTorch, kMaximize, false, kDecay, true>(s, g, m, v, dst, width, vm);
      if (moved) {
        for (int64_t j = 0; j < width; ++j) dst[j] = CaughtUpUpdate(scratch[j] + dst[j], p[j]);
      }
      return;
    }
  }
  UpdateRow<kTorch, kMaximize, kApply, kDecay, kAmsgrad>(s, g, m, v, dst, width, kAmsgrad ? vm : nullptr,
                                                         kDecay && !kApply ? s.params + r * width : nullptr);
}

// The distinct rows [lo, hi) of a coalesced batch; with `sums`, their summed gradient rows (c.size x width, each
// clipped here in place) rather than the entries.
template <bool kTorch, bool kMaximize, bool kApply, bool kDecay, bool kAmsgrad, bool kClip>
OSA_TARGET_CLONES void CoalescedRows(const Scalars& s, const Coalesced& c, const Shard& shard, const float* values,
                                     float* m, float* v, float* vm, float* out, int64_t width, int64_t lo,
                                     int64_t hi, const IdleRows* idle, float* sums = nullptr) {
  std::vector<float> buffer(sums == nullptr ? static_cast<size_t>(width) : 0);
  std::vector<float> scratch(kAmsgrad && !kApply && idle != nullptr ? static_cast<size_t>(width) : 0);
  for (int64_t d = lo; d < hi; ++d) {
    if (d + kPrefetchDistance < hi && shard.Owns(c.row[d + kPrefetchDistance])) {
      const int64_t r = shard.Local(c.row[d + kPrefetchDistance]);
      PrefetchRow(m + r * width, width);
      PrefetchRow(v + r * width, width);
      if constexpr (kAmsgrad) {
        PrefetchRow(vm + r * width, width);
        if (idle != nullptr) __builtin_prefetch(idle->last_step + r, 1, 3);
        if (!kApply && idle != nullptr) PrefetchRow(idle->table + r * width, width);
      }
      if constexpr (kApply) PrefetchRow(out + r * width, width);
      if constexpr (!kApply && kDecay) PrefetchRow(s.params + r * width, width);
      if (sums == nullptr) PrefetchChain(c, d + kPrefetchDistance, values, width);
    }
    if (!shard.Owns(c.row[d])) {  // another shard's row
      if constexpr (!kApply) std::memset(out + c.Slot(d) * width, 0, sizeof(float) * static_cast<size_t>(width));
      continue;
    }
    const int64_t r = shard.Local(c.row[d]);
    float* g = sums != nullptr ? sums + d * width : buffer.data();
    if (sums == nullptr) SumChain(c, d, values, width, g);
    if constexpr (kClip) ClipRow(s.clip, g, width);
    float* dst = kApply ? out + r * width : out + c.Slot(d) * width;
    StepRow<kTorch, kMaximize, kApply, kDecay, kAmsgrad>(s, idle, c.first[d], r, g, m + r * width, v + r * width,
                                                         vm + r * width, dst, scratch.data(), width);
  }
}

// The entries [lo, hi) of a batch whose in-range keys are distinct.
template <bool kTorch, bool kMaximize, bool kApply, bool kDecay, bool kAmsgrad, bool kClip>
OSA_TARGET_CLONES void UniqueRows(const Scalars& s, const int32_t* keys, const Shard& shard, const float* values,
                                  float* m, float* v, float* vm, float* out, int64_t width, int64_t lo, int64_t hi,
                                  const IdleRows* idle) {
  std::vector<float> clipped(kClip ? static_cast<size_t>(width) : 0);
  std::vector<float> scratch(kAmsgrad && !kApply && idle != nullptr ? static_cast<size_t>(width) : 0);
  for (int64_t i = lo; i < hi; ++i) {
    if (i + kPrefetchDistance < hi && shard.Owns(keys[i + kPrefetchDistance])) {
      const int64_t r = shard.Local(keys[i + kPrefetchDistance]);
      PrefetchRow(m + r * width, width);
      PrefetchRow(v + r * width, width);
      if constexpr (kAmsgrad) {
        PrefetchRow(vm + r * width, width);
        if (idle != nullptr) __builtin_prefetch(idle->last_step + r, 1, 3);
      }
      if constexpr (kApply) PrefetchRow(out + r * width, width);
      if constexpr (!kApply && kDecay) PrefetchRow(s.params + r * width, width);
    }
    if (!shard.Owns(keys[i])) {
      if constexpr (!kApply) std::memset(out + i * width, 0, sizeof(float) * static_cast<size_t>(width));
      continue;
    }
    const int64_t r = shard.Local(keys[i]);
    float* dst = kApply ? out + r * width : out + i * width;
    const float* g = kClip ? ClippedRow(s.clip, values + i * width, clipped.data(), width) : values + i * width;
    StepRow<kTorch, kMaximize, kApply, kDecay, kAmsgrad>(s, idle, i, r, g, m + r * width, v + r * width,
                                                         vm + r * width, dst, scratch.data(), width);
  }
}

// An apply handler's step whose clipping takes its norm from the batch itself (Clip::norm), its keys possibly
// repeating: the norm of every row in range (a row shard's call too sums the whole gradient), then the row pass,
// clipping by it. (Keys taken as distinct take their entries' norm instead: Run.)
template <bool kTorch, bool kMaximize, bool kDecay, bool kAmsgrad>
void RunNormClipped(ffi::ThreadPool& pool, const Scalars& s, const Options& o, const int32_t* keys, int64_t k,
                    const Shard& shard, const float* values, float* m, float* v, float* vm, float* out,
                    int64_t width, const IdleRows* idle) {
  ForEachCoalescedPartNormClipped(pool, keys, k, values, width, shard.num_rows, o.threads, s.clip.max_norm,
                                  [&](const Coalesced& c, float* sums, const Clip& clip) {
                                    Scalars clipped = s;
                                    clipped.clip = clip;
                                    CoalescedRows<kTorch, kMaximize, true, kDecay, kAmsgrad, true>(
                                        clipped, c, shard, values, m, v, vm, out, width, 0, c.size, idle, sums);
                                  });
}

template <bool kTorch, bool kMaximize, bool kApply, bool kDecay, bool kAmsgrad, bool kClip = false>
void Run(ffi::ThreadPool& pool, const Scalars& s, const Options& o, const int32_t* keys, int64_t k, const Shard& shard,
         const float* values, float* m, float* v, float* vm, float* out, int32_t* out_keys, int64_t width,
         const IdleRows* idle = nullptr) {
  if constexpr (kApply && kClip) {
    if (s.clip.norm && o.unique != 0) {
      // Keys taken as distinct: their entries' norm, as the sum_squares handler takes it (EntrySquares), then the
      // step as given the clipping's two scalars (a broken promise's rows are still summed first).
      Scalars clipped = s;
      clipped.clip = ClipOfNorm(EntrySquares(pool, keys, k, values, width, shard.num_rows, o.threads), s.clip.max_norm);
      Run<kTorch, kMaximize, kApply, kDecay, kAmsgrad, kClip>(pool, clipped, o, keys, k, shard, values, m, v, vm, out,
                                                              out_keys, width, idle);
      return;
    }
    if (s.clip.norm) {
      RunNormClipped<kTorch, kMaximize, kDecay, kAmsgrad>(pool, s, o, keys, k, shard, values, m, v, vm, out, width,
                                                          idle);
      return;
    }
  }
  const auto pad = static_cast<int32_t>(shard.num_rows);
  // A broken promise (a key twice) takes the coalescing path: its rows are
  // summed as without it, and no two threads ever write one row. Keys the
  // library made distinct itself skip the check.
  if (o.unique == 2 || (o.unique == 1 && !HasDuplicate(keys, k, shard.num_rows))) {
    if (out_keys != nullptr) {
      for (int64_t i = 0; i < k; ++i) out_keys[i] = InRange(keys[i], shard.num_rows) ? keys[i] : pad;
    }
    ParallelForOwned(pool, keys, k, shard, o.threads, [&](int64_t lo, int64_t hi) {
      UniqueRows<kTorch, kMaximize, kApply, kDecay, kAmsgrad, kClip>(s, keys, shard, values, m, v, vm, out, width, lo,
                                                                     hi, idle);
    });
    return;
  }
  if constexpr (kApply) {
    // p, m and v only need this shard's rows: each thread coalesces its share of them (ForEachCoalescedPart).
    ForEachCoalescedPart(pool, keys, k, shard.begin + shard.local_rows, shard.begin, o.threads,
                         [&](const Coalesced& c) {
                           CoalescedRows<kTorch, kMaximize, kApply, kDecay, kAmsgrad, kClip>(
                               s, c, shard, values, m, v, vm, out, width, 0, c.size, idle);
                         });
  } else {
    ForEachCoalescedPartInOrder(pool, keys, k, shard.num_rows, o.threads, out, width, out_keys, pad,
                                [&](const Coalesced& c) {
                                  CoalescedRows<kTorch, kMaximize, kApply, kDecay, kAmsgrad, kClip>(
                                      s, c, shard, values, m, v, vm, out, width, 0, c.size, idle);
                                });
  }
}

// Checks the shapes shared by both handlers; sets the shard's local rows and the width. An apply handler
// (`clips`) also takes the clipping's scalars after its num_scalars (ReadClip).
ffi::Error CheckShapes(ffi::Span<const int64_t> table, size_t mu_count, size_t nu_count, int64_t k,
                       size_t values_count, size_t scalars_count, int64_t num_scalars, Shard& shard, int64_t& width,
                       bool clips = false) {
  if (table.size() < 1) return ffi::Error::InvalidArgument("tables must have at least one dimension");
  shard.local_rows = table[0];
  if (!shard.Valid()) return ffi::Error::InvalidArgument("row range outside a table of at most 2**31 - 1 rows");
  width = RowWidth(table);
  if (mu_count != nu_count || static_cast<int64_t>(mu_count) != shard.local_rows * width)
    return ffi::Error::InvalidArgument("mu and nu must have the parameter's shape");
  if (static_cast<int64_t>(values_count) != k * width)
    return ffi::Error::InvalidArgument("values must have one row per key");
  const auto count = static_cast<int64_t>(scalars_count);
  if (!ScalarCountOk(count, num_scalars, clips)) {
    if (!clips)
      return ffi::Error::InvalidArgument(num_scalars == kNumScalars ? "scalars must hold 10 values"
                                                                    : "scalars must hold 11 values");
    return ffi::Error::InvalidArgument(num_scalars == kNumScalars
                                           ? "scalars must hold 10 values (11 or 12 to clip)"
                                           : "scalars must hold 11 values (12 or 13 to clip)");
  }
  return ffi::Error::Success();
}

template <bool kApply, bool kDecay = false>
void Dispatch(ffi::ThreadPool& pool, const Scalars& s, const Options& o, const int32_t* keys, int64_t k,
              const Shard& shard, const float* values, float* m, float* v, float* out, int32_t* out_keys,
              int64_t width) {
  auto run = [&](auto torch_eps, auto maximize) {
    if constexpr (kApply) {
      if (s.clip.on) {
        Run<decltype(torch_eps)::value, decltype(maximize)::value, kApply, kDecay, false, true>(
            pool, s, o, keys, k, shard, values, m, v, nullptr, out, out_keys, width);
        return;
      }
    }
    Run<decltype(torch_eps)::value, decltype(maximize)::value, kApply, kDecay, false>(
        pool, s, o, keys, k, shard, values, m, v, nullptr, out, out_keys, width);
  };
  using T = std::true_type;
  using F = std::false_type;
  if (o.torch_eps) {
    o.maximize ? run(T{}, T{}) : run(T{}, F{});
  } else {
    o.maximize ? run(F{}, T{}) : run(F{}, F{});
  }
}

// The rows handlers: the leaf rule for tx.update, the step rows times neg_lr packed as the XLA path packs them;
// with kDecay, sparse_adamw's, each step row neg_lr * fma(weight_decay, p, step) (the weight decay an eleventh
// scalar; `p`, the parameters, read only).
template <bool kDecay>
ffi::Error Rows(ffi::ThreadPool& pool, const ffi::Buffer<ffi::F32>* p, ffi::Buffer<ffi::F32>& mu,
                ffi::Buffer<ffi::F32>& nu, ffi::BufferR1<ffi::S32>& keys, ffi::Buffer<ffi::F32>& values,
                ffi::BufferR1<ffi::F32>& scalars, ffi::BufferR0<ffi::S32>& row_begin,
                ffi::ResultBuffer<ffi::F32>& mu_out, ffi::ResultBuffer<ffi::F32>& nu_out,
                ffi::ResultBufferR1<ffi::S32>& keys_out, ffi::ResultBuffer<ffi::F32>& step_out, int64_t num_rows,
                int64_t torch_eps, int64_t maximize, int64_t unique, int64_t threads) {
  const int64_t k = static_cast<int64_t>(keys.element_count());
  Shard shard{num_rows, *row_begin.typed_data(), 0};
  int64_t width = 0;
  if (ffi::Error e = CheckShapes(mu.dimensions(), mu.element_count(), nu.element_count(), k, values.element_count(),
                                 scalars.element_count(), kDecay ? kNumScalars + 1 : kNumScalars, shard, width);
      e.failure())
    return e;
  if (kDecay && p->element_count() != mu.element_count()) return ffi::Error::InvalidArgument("p must have mu's shape");
  if (step_out->element_count() != values.element_count() || keys_out->element_count() != keys.element_count())
    return ffi::Error::InvalidArgument("results must have the shapes of keys and values");
  float* m = mu_out->typed_data();
  float* v = nu_out->typed_data();
  CopyIfNotAliased(m, mu.typed_data(), mu.element_count());
  CopyIfNotAliased(v, nu.typed_data(), nu.element_count());
  const Options o{torch_eps != 0, maximize != 0, unique, threads};
  Scalars s = ReadScalars(scalars);
  if constexpr (kDecay) {
    s.weight_decay = scalars.typed_data()[kNumScalars];
    s.params = p->typed_data();
  }
  Dispatch<false, kDecay>(pool, s, o, keys.typed_data(), k, shard, values.typed_data(), m, v, step_out->typed_data(),
                          keys_out->typed_data(), width);
  return ffi::Error::Success();
}

ffi::Error RowsImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> mu, ffi::Buffer<ffi::F32> nu,
                    ffi::BufferR1<ffi::S32> keys, ffi::Buffer<ffi::F32> values, ffi::BufferR1<ffi::F32> scalars,
                    ffi::BufferR0<ffi::S32> row_begin, ffi::ResultBuffer<ffi::F32> mu_out,
                    ffi::ResultBuffer<ffi::F32> nu_out, ffi::ResultBufferR1<ffi::S32> keys_out,
                    ffi::ResultBuffer<ffi::F32> step_out, int64_t num_rows, int64_t torch_eps, int64_t maximize,
                    int64_t unique, int64_t threads) {
  return Rows<false>(pool, nullptr, mu, nu, keys, values, scalars, row_begin, mu_out, nu_out, keys_out, step_out,
                     num_rows, torch_eps, maximize, unique, threads);
}

ffi::Error AdamwRowsImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> p, ffi::Buffer<ffi::F32> mu,
                         ffi::Buffer<ffi::F32> nu, ffi::BufferR1<ffi::S32> keys, ffi::Buffer<ffi::F32> values,
                         ffi::BufferR1<ffi::F32> scalars, ffi::BufferR0<ffi::S32> row_begin,
                         ffi::ResultBuffer<ffi::F32> mu_out, ffi::ResultBuffer<ffi::F32> nu_out,
                         ffi::ResultBufferR1<ffi::S32> keys_out, ffi::ResultBuffer<ffi::F32> step_out,
                         int64_t num_rows, int64_t torch_eps, int64_t maximize, int64_t unique, int64_t threads) {
  return Rows<true>(pool, &p, mu, nu, keys, values, scalars, row_begin, mu_out, nu_out, keys_out, step_out, num_rows,
                    torch_eps, maximize, unique, threads);
}

template <bool kDecay>
ffi::Error ApplyImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> p, ffi::Buffer<ffi::F32> mu, ffi::Buffer<ffi::F32> nu,
                     ffi::BufferR1<ffi::S32> keys, ffi::Buffer<ffi::F32> values, ffi::BufferR1<ffi::F32> scalars,
                     ffi::BufferR0<ffi::S32> row_begin, ffi::ResultBuffer<ffi::F32> p_out,
                     ffi::ResultBuffer<ffi::F32> mu_out,
                     ffi::ResultBuffer<ffi::F32> nu_out, int64_t num_rows, int64_t torch_eps,
                     int64_t maximize, int64_t unique, int64_t threads) {
  const int64_t k = static_cast<int64_t>(keys.element_count());
  Shard shard{num_rows, *row_begin.typed_data(), 0};
  int64_t width = 0;
  if (ffi::Error e = CheckShapes(mu.dimensions(), mu.element_count(), nu.element_count(), k, values.element_count(),
                                 scalars.element_count(), kDecay ? kNumScalars + 1 : kNumScalars, shard, width,
                                 /*clips=*/true);
      e.failure())
    return e;
  if (p.element_count() != mu.element_count()) return ffi::Error::InvalidArgument("p must have mu's shape");
  float* q = p_out->typed_data();
  float* m = mu_out->typed_data();
  float* v = nu_out->typed_data();
  CopyIfNotAliased(q, p.typed_data(), p.element_count());
  CopyIfNotAliased(m, mu.typed_data(), mu.element_count());
  CopyIfNotAliased(v, nu.typed_data(), nu.element_count());
  const Options o{torch_eps != 0, maximize != 0, unique, threads};
  Scalars s = ReadScalars(scalars);
  if constexpr (kDecay) s.weight_decay = scalars.typed_data()[kNumScalars];
  s.clip = ReadClip(scalars, kDecay ? kNumScalars + 1 : kNumScalars);
  Dispatch<true, kDecay>(pool, s, o, keys.typed_data(), k, shard, values.typed_data(), m, v, q, nullptr, width);
  return ffi::Error::Success();
}

// sparse_amsgrad's fused step: (p, mu, nu, nu_max) updated in place on the touched rows, each first taking the
// idle steps `idle` gives it (catch-up), where it is not null.
ffi::Error AmsgradApply(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& p, ffi::Buffer<ffi::F32>& mu,
                        ffi::Buffer<ffi::F32>& nu, ffi::Buffer<ffi::F32>& nu_max, ffi::BufferR1<ffi::S32>& keys,
                        ffi::Buffer<ffi::F32>& values, ffi::BufferR1<ffi::F32>& scalars,
                        ffi::BufferR0<ffi::S32>& row_begin, ffi::ResultBuffer<ffi::F32>& p_out,
                        ffi::ResultBuffer<ffi::F32>& mu_out, ffi::ResultBuffer<ffi::F32>& nu_out,
                        ffi::ResultBuffer<ffi::F32>& nu_max_out, int64_t num_rows, int64_t unique, int64_t threads,
                        const IdleRows* idle) {
  const int64_t k = static_cast<int64_t>(keys.element_count());
  Shard shard{num_rows, *row_begin.typed_data(), 0};
  int64_t width = 0;
  if (ffi::Error e = CheckShapes(mu.dimensions(), mu.element_count(), nu.element_count(), k, values.element_count(),
                                 scalars.element_count(), kNumScalars, shard, width, /*clips=*/true);
      e.failure())
    return e;
  if (p.element_count() != mu.element_count() || nu_max.element_count() != mu.element_count())
    return ffi::Error::InvalidArgument("p and nu_max must have mu's shape");
  float* q = p_out->typed_data();
  float* m = mu_out->typed_data();
  float* v = nu_out->typed_data();
  float* vm = nu_max_out->typed_data();
  CopyIfNotAliased(q, p.typed_data(), p.element_count());
  CopyIfNotAliased(m, mu.typed_data(), mu.element_count());
  CopyIfNotAliased(v, nu.typed_data(), nu.element_count());
  CopyIfNotAliased(vm, nu_max.typed_data(), nu_max.element_count());
  const Options o{false, false, unique, threads};
  Scalars s = ReadScalars(scalars);
  s.clip = ReadClip(scalars, kNumScalars);
  if (s.clip.on) {
    Run<false, false, true, false, true, true>(pool, s, o, keys.typed_data(), k, shard, values.typed_data(), m, v, vm,
                                               q, nullptr, width, idle);
  } else {
    Run<false, false, true, false, true>(pool, s, o, keys.typed_data(), k, shard, values.typed_data(), m, v, vm, q,
                                         nullptr, width, idle);
  }
  return ffi::Error::Success();
}

ffi::Error AmsgradApplyImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> p, ffi::Buffer<ffi::F32> mu,
                            ffi::Buffer<ffi::F32> nu, ffi::Buffer<ffi::F32> nu_max, ffi::BufferR1<ffi::S32> keys,
                            ffi::Buffer<ffi::F32> values, ffi::BufferR1<ffi::F32> scalars,
                            ffi::BufferR0<ffi::S32> row_begin, ffi::ResultBuffer<ffi::F32> p_out,
                            ffi::ResultBuffer<ffi::F32> mu_out, ffi::ResultBuffer<ffi::F32> nu_out,
                            ffi::ResultBuffer<ffi::F32> nu_max_out, int64_t num_rows, int64_t unique,
                            int64_t threads) {
  return AmsgradApply(pool, p, mu, nu, nu_max, keys, values, scalars, row_begin, p_out, mu_out, nu_out, nu_max_out,
                      num_rows, unique, threads, nullptr);
}

// The catch-up operands of the AMSGrad handlers, checked, as IdleRows (the records copied to last_step_out).
ffi::Error ReadIdleRows(int64_t k, int64_t rows_held, ffi::BufferR1<ffi::S32>& last_step,
                        ffi::BufferR1<ffi::F32>& window, ffi::BufferR1<ffi::F32>& far, ffi::BufferR1<ffi::F32>& powers,
                        ffi::BufferR1<ffi::F32>& decay2, ffi::BufferR1<ffi::S32>& counts,
                        ffi::ResultBufferR1<ffi::S32>& last_step_out, int64_t cap, int64_t far_by_key,
                        int64_t decay2_given, IdleRows& rows) {
  const auto window_len = static_cast<int64_t>(window.element_count());
  const auto far_len = static_cast<int64_t>(far.element_count());
  if (cap < 0 || window_len < std::max<int64_t>(cap, 1))
    return ffi::Error::InvalidArgument("window must hold a coefficient for each idle count up to cap");
  if (far_by_key != 0 ? far_len != k : far_len < 1)
    return ffi::Error::InvalidArgument("far must hold a coefficient per last step (or per key with far_by_key)");
  // Whether decay2 is given is an attribute: an empty batch's decay2 is empty too.
  const bool by_key = decay2_given != 0;
  if (static_cast<int64_t>(decay2.element_count()) != (by_key ? k : 0))
    return ffi::Error::InvalidArgument("decay2 must hold b2**idle per key where given, else be empty");
  if (static_cast<int64_t>(powers.element_count()) != (by_key ? 1024 : 2048))
    return ffi::Error::InvalidArgument("powers must hold b1's table, and b2's unless decay2 is given");
  if (static_cast<int64_t>(last_step.element_count()) != rows_held ||
      last_step_out->element_count() != last_step.element_count())
    return ffi::Error::InvalidArgument("last_step must have one entry per row");
  if (counts.element_count() != 2) return ffi::Error::InvalidArgument("counts must hold the step's count and done");
  CopyIfNotAliased(last_step_out->typed_data(), last_step.typed_data(), last_step.element_count());
  rows = IdleRows{window.typed_data(), far.typed_data(), far_len,
                  far_by_key != 0,     cap,              powers.typed_data(),
                  by_key ? decay2.typed_data() : nullptr,
                  last_step_out->typed_data(), counts.typed_data()[0], counts.typed_data()[1]};
  return ffi::Error::Success();
}

ffi::Error CatchUpAmsgradApplyImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> p, ffi::Buffer<ffi::F32> mu,
                                   ffi::Buffer<ffi::F32> nu, ffi::Buffer<ffi::F32> nu_max,
                                   ffi::BufferR1<ffi::S32> last_step, ffi::BufferR1<ffi::S32> keys,
                                   ffi::Buffer<ffi::F32> values, ffi::BufferR1<ffi::F32> scalars,
                                   ffi::BufferR1<ffi::F32> window, ffi::BufferR1<ffi::F32> far,
                                   ffi::BufferR1<ffi::F32> powers, ffi::BufferR1<ffi::F32> decay2,
                                   ffi::BufferR1<ffi::S32> counts, ffi::BufferR0<ffi::S32> row_begin,
                                   ffi::ResultBuffer<ffi::F32> p_out, ffi::ResultBuffer<ffi::F32> mu_out,
                                   ffi::ResultBuffer<ffi::F32> nu_out, ffi::ResultBuffer<ffi::F32> nu_max_out,
                                   ffi::ResultBufferR1<ffi::S32> last_step_out, int64_t num_rows, int64_t cap,
                                   int64_t far_by_key, int64_t decay2_given, int64_t unique, int64_t threads) {
  const auto k = static_cast<int64_t>(keys.element_count());
  const auto rows_held = p.dimensions().size() > 0 ? p.dimensions()[0] : 0;
  IdleRows rows{};
  if (ffi::Error e = ReadIdleRows(k, rows_held, last_step, window, far, powers, decay2, counts, last_step_out, cap,
                                  far_by_key, decay2_given, rows);
      e.failure())
    return e;
  return AmsgradApply(pool, p, mu, nu, nu_max, keys, values, scalars, row_begin, p_out, mu_out, nu_out, nu_max_out,
                      num_rows, unique, threads, &rows);
}

// sparse_amsgrad's leaf rule for tx.update: (mu, nu, nu_max) in place and the step rows packed as the rows
// handler packs them; with `idle` (catch-up), each row first takes its idle steps (StepRow).
ffi::Error AmsgradRows(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& mu, ffi::Buffer<ffi::F32>& nu,
                       ffi::Buffer<ffi::F32>& nu_max, ffi::BufferR1<ffi::S32>& keys, ffi::Buffer<ffi::F32>& values,
                       ffi::BufferR1<ffi::F32>& scalars, ffi::BufferR0<ffi::S32>& row_begin,
                       ffi::ResultBuffer<ffi::F32>& mu_out, ffi::ResultBuffer<ffi::F32>& nu_out,
                       ffi::ResultBuffer<ffi::F32>& nu_max_out, ffi::ResultBufferR1<ffi::S32>& keys_out,
                       ffi::ResultBuffer<ffi::F32>& step_out, int64_t num_rows, int64_t unique, int64_t threads,
                       const IdleRows* idle) {
  const int64_t k = static_cast<int64_t>(keys.element_count());
  Shard shard{num_rows, *row_begin.typed_data(), 0};
  int64_t width = 0;
  if (ffi::Error e = CheckShapes(mu.dimensions(), mu.element_count(), nu.element_count(), k, values.element_count(),
                                 scalars.element_count(), kNumScalars, shard, width);
      e.failure())
    return e;
  if (nu_max.element_count() != mu.element_count()) return ffi::Error::InvalidArgument("nu_max must have mu's shape");
  if (step_out->element_count() != values.element_count() || keys_out->element_count() != keys.element_count())
    return ffi::Error::InvalidArgument("results must have the shapes of keys and values");
  float* m = mu_out->typed_data();
  float* v = nu_out->typed_data();
  float* vm = nu_max_out->typed_data();
  CopyIfNotAliased(m, mu.typed_data(), mu.element_count());
  CopyIfNotAliased(v, nu.typed_data(), nu.element_count());
  CopyIfNotAliased(vm, nu_max.typed_data(), nu_max.element_count());
  const Options o{false, false, unique, threads};
  Run<false, false, false, false, true>(pool, ReadScalars(scalars), o, keys.typed_data(), k, shard,
                                        values.typed_data(), m, v, vm, step_out->typed_data(),
                                        keys_out->typed_data(), width, idle);
  return ffi::Error::Success();
}

ffi::Error AmsgradRowsImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> mu, ffi::Buffer<ffi::F32> nu,
                           ffi::Buffer<ffi::F32> nu_max, ffi::BufferR1<ffi::S32> keys, ffi::Buffer<ffi::F32> values,
                           ffi::BufferR1<ffi::F32> scalars, ffi::BufferR0<ffi::S32> row_begin,
                           ffi::ResultBuffer<ffi::F32> mu_out, ffi::ResultBuffer<ffi::F32> nu_out,
                           ffi::ResultBuffer<ffi::F32> nu_max_out, ffi::ResultBufferR1<ffi::S32> keys_out,
                           ffi::ResultBuffer<ffi::F32> step_out, int64_t num_rows, int64_t unique, int64_t threads) {
  return AmsgradRows(pool, mu, nu, nu_max, keys, values, scalars, row_begin, mu_out, nu_out, nu_max_out, keys_out,
                     step_out, num_rows, unique, threads, nullptr);
}

// sparse_amsgrad(catch_up=True)'s leaf rule for tx.update: the apply handler's operands, p read only; (mu, nu,
// nu_max, last_step) in place and the rows' updates packed as the rows handler packs its step rows (StepRow).
ffi::Error CatchUpAmsgradRowsImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> p, ffi::Buffer<ffi::F32> mu,
                                  ffi::Buffer<ffi::F32> nu, ffi::Buffer<ffi::F32> nu_max,
                                  ffi::BufferR1<ffi::S32> last_step, ffi::BufferR1<ffi::S32> keys,
                                  ffi::Buffer<ffi::F32> values, ffi::BufferR1<ffi::F32> scalars,
                                  ffi::BufferR1<ffi::F32> window, ffi::BufferR1<ffi::F32> far,
                                  ffi::BufferR1<ffi::F32> powers, ffi::BufferR1<ffi::F32> decay2,
                                  ffi::BufferR1<ffi::S32> counts, ffi::BufferR0<ffi::S32> row_begin,
                                  ffi::ResultBuffer<ffi::F32> mu_out, ffi::ResultBuffer<ffi::F32> nu_out,
                                  ffi::ResultBuffer<ffi::F32> nu_max_out, ffi::ResultBufferR1<ffi::S32> last_step_out,
                                  ffi::ResultBufferR1<ffi::S32> keys_out, ffi::ResultBuffer<ffi::F32> step_out,
                                  int64_t num_rows, int64_t cap, int64_t far_by_key, int64_t decay2_given,
                                  int64_t unique, int64_t threads) {
  if (p.element_count() != mu.element_count()) return ffi::Error::InvalidArgument("p must have mu's shape");
  const auto rows_held = mu.dimensions().size() > 0 ? mu.dimensions()[0] : 0;
  IdleRows rows{};
  if (ffi::Error e = ReadIdleRows(static_cast<int64_t>(keys.element_count()), rows_held, last_step, window, far,
                                  powers, decay2, counts, last_step_out, cap, far_by_key, decay2_given, rows);
      e.failure())
    return e;
  rows.table = p.typed_data();
  return AmsgradRows(pool, mu, nu, nu_max, keys, values, scalars, row_begin, mu_out, nu_out, nu_max_out, keys_out,
                     step_out, num_rows, unique, threads, &rows);
}

}  // namespace
}  // namespace optax_sparse_adam

// The rows handlers' operands and results after the thread pool (and AdamW's parameters).
#define OSA_ROWS_BINDING                                              \
      .Arg<ffi::Buffer<ffi::F32>>()   /* mu */                        \
      .Arg<ffi::Buffer<ffi::F32>>()   /* nu */                        \
      .Arg<ffi::BufferR1<ffi::S32>>() /* keys */                      \
      .Arg<ffi::Buffer<ffi::F32>>()   /* values */                    \
      .Arg<ffi::BufferR1<ffi::F32>>() /* scalars */                   \
      .Arg<ffi::BufferR0<ffi::S32>>() /* row_begin: first row held */ \
      .Ret<ffi::Buffer<ffi::F32>>()   /* mu */                        \
      .Ret<ffi::Buffer<ffi::F32>>()   /* nu */                        \
      .Ret<ffi::BufferR1<ffi::S32>>() /* keys, distinct first */      \
      .Ret<ffi::Buffer<ffi::F32>>()   /* step rows */                 \
      .Attr<int64_t>("num_rows")                                      \
      .Attr<int64_t>("torch_eps")                                     \
      .Attr<int64_t>("maximize")                                      \
      .Attr<int64_t>("unique")                                        \
      .Attr<int64_t>("threads")

XLA_FFI_DEFINE_HANDLER_SYMBOL(OptaxSparseAdamRows, optax_sparse_adam::RowsImpl,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>() OSA_ROWS_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(OptaxSparseAdamWRows, optax_sparse_adam::AdamwRowsImpl,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::F32>>()  // p, read only
                                  OSA_ROWS_BINDING);

#define OSA_APPLY_BINDING                                               \
  ffi::Ffi::Bind()                                                      \
      .Ctx<ffi::ThreadPool>()                                           \
      .Arg<ffi::Buffer<ffi::F32>>()   /* p */                           \
      .Arg<ffi::Buffer<ffi::F32>>()   /* mu */                          \
      .Arg<ffi::Buffer<ffi::F32>>()   /* nu */                          \
      .Arg<ffi::BufferR1<ffi::S32>>() /* keys */                        \
      .Arg<ffi::Buffer<ffi::F32>>()   /* values */                      \
      .Arg<ffi::BufferR1<ffi::F32>>() /* scalars */                     \
      .Arg<ffi::BufferR0<ffi::S32>>() /* row_begin: first row held */   \
      .Ret<ffi::Buffer<ffi::F32>>()   /* p */                           \
      .Ret<ffi::Buffer<ffi::F32>>()   /* mu */                          \
      .Ret<ffi::Buffer<ffi::F32>>()   /* nu */                          \
      .Attr<int64_t>("num_rows")                                        \
      .Attr<int64_t>("torch_eps")                                       \
      .Attr<int64_t>("maximize")                                        \
      .Attr<int64_t>("unique")                                          \
      .Attr<int64_t>("threads")

XLA_FFI_DEFINE_HANDLER_SYMBOL(OptaxSparseAdamApply, optax_sparse_adam::ApplyImpl<false>, OSA_APPLY_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(OptaxSparseAdamWApply, optax_sparse_adam::ApplyImpl<true>, OSA_APPLY_BINDING);

// The AMSGrad apply handlers' bindings: the operands before the catch-up's per-key ones, and the rest (row_begin,
// the results and the attributes).
#define OSA_AMSGRAD_APPLY_BATCH                                          \
  ffi::Ffi::Bind()                                                      \
      .Ctx<ffi::ThreadPool>()                                           \
      .Arg<ffi::Buffer<ffi::F32>>()   /* p */                           \
      .Arg<ffi::Buffer<ffi::F32>>()   /* mu */                          \
      .Arg<ffi::Buffer<ffi::F32>>()   /* nu */                          \
      .Arg<ffi::Buffer<ffi::F32>>()   /* nu_max */                      \
      .Arg<ffi::BufferR1<ffi::S32>>() /* keys */                        \
      .Arg<ffi::Buffer<ffi::F32>>()   /* values */                      \
      .Arg<ffi::BufferR1<ffi::F32>>() /* scalars */
#define OSA_AMSGRAD_APPLY_TAIL                                         \
  Arg<ffi::BufferR0<ffi::S32>>()      /* row_begin: first row held */   \
      .Ret<ffi::Buffer<ffi::F32>>()   /* p */                           \
      .Ret<ffi::Buffer<ffi::F32>>()   /* mu */                          \
      .Ret<ffi::Buffer<ffi::F32>>()   /* nu */                          \
      .Ret<ffi::Buffer<ffi::F32>>()   /* nu_max */                      \
      .Attr<int64_t>("num_rows")                                        \
      .Attr<int64_t>("unique")                                          \
      .Attr<int64_t>("threads")

XLA_FFI_DEFINE_HANDLER_SYMBOL(OptaxSparseAmsgradApply, optax_sparse_adam::AmsgradApplyImpl,
                              OSA_AMSGRAD_APPLY_BATCH.OSA_AMSGRAD_APPLY_TAIL);

XLA_FFI_DEFINE_HANDLER_SYMBOL(OptaxSparseAmsgradRows, optax_sparse_adam::AmsgradRowsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()    // mu
                                  .Arg<ffi::Buffer<ffi::F32>>()    // nu
                                  .Arg<ffi::Buffer<ffi::F32>>()    // nu_max
                                  .Arg<ffi::BufferR1<ffi::S32>>()  // keys
                                  .Arg<ffi::Buffer<ffi::F32>>()    // values
                                  .Arg<ffi::BufferR1<ffi::F32>>()  // scalars
                                  .Arg<ffi::BufferR0<ffi::S32>>()  // row_begin: first row held
                                  .Ret<ffi::Buffer<ffi::F32>>()    // mu
                                  .Ret<ffi::Buffer<ffi::F32>>()    // nu
                                  .Ret<ffi::Buffer<ffi::F32>>()    // nu_max
                                  .Ret<ffi::BufferR1<ffi::S32>>()  // keys, distinct first
                                  .Ret<ffi::Buffer<ffi::F32>>()    // step rows
                                  .Attr<int64_t>("num_rows")
                                  .Attr<int64_t>("unique")
                                  .Attr<int64_t>("threads"));

// The AMSGrad catch-up handlers' operands after p.
#define OSA_CATCH_UP_AMSGRAD_ARGS                                                        \
  Arg<ffi::Buffer<ffi::F32>>()         /* mu */                                          \
      .Arg<ffi::Buffer<ffi::F32>>()    /* nu */                                          \
      .Arg<ffi::Buffer<ffi::F32>>()    /* nu_max */                                      \
      .Arg<ffi::BufferR1<ffi::S32>>()  /* last_step: per row, the step recorded */       \
      .Arg<ffi::BufferR1<ffi::S32>>()  /* keys */                                        \
      .Arg<ffi::Buffer<ffi::F32>>()    /* values */                                      \
      .Arg<ffi::BufferR1<ffi::F32>>()  /* scalars */                                     \
      .Arg<ffi::BufferR1<ffi::F32>>()  /* window: C of rows idle 1 .. cap steps */       \
      .Arg<ffi::BufferR1<ffi::F32>>()  /* far: C of rows idle longer */                  \
      .Arg<ffi::BufferR1<ffi::F32>>()  /* powers: b1's table, then b2's */               \
      .Arg<ffi::BufferR1<ffi::F32>>()  /* decay2: b2**idle per key, or empty */          \
      .Arg<ffi::BufferR1<ffi::S32>>()  /* counts: the step's (recorded), done */         \
      .Arg<ffi::BufferR0<ffi::S32>>()  /* row_begin: first row held */

XLA_FFI_DEFINE_HANDLER_SYMBOL(OptaxSparseAdamCatchUpAmsgradApply, optax_sparse_adam::CatchUpAmsgradApplyImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()    // p
                                  .OSA_CATCH_UP_AMSGRAD_ARGS
                                  .Ret<ffi::Buffer<ffi::F32>>()    // p
                                  .Ret<ffi::Buffer<ffi::F32>>()    // mu
                                  .Ret<ffi::Buffer<ffi::F32>>()    // nu
                                  .Ret<ffi::Buffer<ffi::F32>>()    // nu_max
                                  .Ret<ffi::BufferR1<ffi::S32>>()  // last_step
                                  .Attr<int64_t>("num_rows")
                                  .Attr<int64_t>("cap")
                                  .Attr<int64_t>("far_by_key")
                                  .Attr<int64_t>("decay2")
                                  .Attr<int64_t>("unique")
                                  .Attr<int64_t>("threads"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(OptaxSparseAdamCatchUpAmsgradRows, optax_sparse_adam::CatchUpAmsgradRowsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()    // p: read only
                                  .OSA_CATCH_UP_AMSGRAD_ARGS
                                  .Ret<ffi::Buffer<ffi::F32>>()    // mu
                                  .Ret<ffi::Buffer<ffi::F32>>()    // nu
                                  .Ret<ffi::Buffer<ffi::F32>>()    // nu_max
                                  .Ret<ffi::BufferR1<ffi::S32>>()  // last_step
                                  .Ret<ffi::BufferR1<ffi::S32>>()  // keys, distinct first
                                  .Ret<ffi::Buffer<ffi::F32>>()    // the rows' updates
                                  .Attr<int64_t>("num_rows")
                                  .Attr<int64_t>("cap")
                                  .Attr<int64_t>("far_by_key")
                                  .Attr<int64_t>("decay2")
                                  .Attr<int64_t>("unique")
                                  .Attr<int64_t>("threads"));

#undef OSA_AMSGRAD_APPLY_BATCH
#undef OSA_CATCH_UP_AMSGRAD_ARGS
#undef OSA_AMSGRAD_APPLY_TAIL
