// The row loop of the lazy row kernels (rowwise.cc, elementwise.cc): a batch's touched rows, duplicates summed,
// split over XLA's intra-op thread pool, each handed to a rule that updates its state and its parameters (or
// writes its step rows). Header-only, in the kernels' namespace; what a handler adds is its rule.
#ifndef OPTAX_SPARSE_ADAM_CSRC_ROW_LOOP_H_
#define OPTAX_SPARSE_ADAM_CSRC_ROW_LOOP_H_

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "rows.h"
#include "xla/ffi/api/ffi.h"

namespace optax_sparse_adam {

constexpr int kPrefetchDistance = 4;

struct Options {
  int64_t unique;  // 0: keys may repeat; 1: distinct by the user's promise, checked; 2: known distinct
  int64_t threads;
  Clip clip = {};  // apply handlers: each summed gradient row clipped before the rule sees it
};

// A rule updates one touched row. Its members: kApply (whether it adds the
// step to the parameters, or writes the step rows to `out`), `out` and
// `width`, Scratch() (floats of scratch a thread needs), Prefetch(r) (the
// local row r's state, ahead of time), and Row(g, r, slot, entry, scratch):
// the row's state at local row r updated from its gradient row g (duplicates
// summed), the step written to `out` at `slot` or added to the parameters'
// row r; `entry` is one of the row's entries (for per-entry operands). A rule
// whose Row returns a bool may decline a row (false: its state and parameters
// as they were, its step row NaN): the loop then calls Declined(e) for each
// of the row's entries e, which the caller takes by another path.

// Rule::Row on a row, and where the rule declines it, Declined on each of its entries (those from `first` on,
// chained by `next`; nullptr for a row of one entry).
template <class Rule>
OSA_ROW_INLINE void RowOrDecline(const Rule& rule, const float* g, int64_t r, int64_t slot, int32_t first,
                                 const int32_t* next, float* scratch) {
  if constexpr (std::is_same_v<decltype(rule.Row(g, r, slot, first, scratch)), bool>) {
    if (rule.Row(g, r, slot, first, scratch)) return;
    for (int32_t e = first; e >= 0; e = next != nullptr ? next[e] : -1) rule.Declined(e);
  } else {
    rule.Row(g, r, slot, first, scratch);
  }
}

// The distinct rows [lo, hi) of a coalesced batch; with `summed`, their gradient rows summed already (c.size x
// width, clipped here in place). Without, each row's entries are summed as its turn comes (SumChain, into a row
// of scratch, its first two entries read ahead with the rows' state), as the Adam kernels sum them: summing the
// part's entries into a buffer of all its rows first wrote and read that buffer once more per row, a pass of its
// own where the rows have few entries each (2 MB a thread at 1e6 x 128 with 8,192 uniform ids).
template <class Rule>
OSA_TARGET_CLONES void CoalescedRows(const Rule& rule, const Clip& clip, const Coalesced& c,
                                     const Shard& shard, const float* values, int64_t lo, int64_t hi,
                                     float* summed = nullptr) {
  const int64_t width = rule.width;
  std::vector<float> own(summed == nullptr ? static_cast<size_t>(width) : 0);
  if (summed != nullptr && clip.on) ClipRow(clip, summed + lo * width, (hi - lo) * width);
  std::vector<float> scratch(static_cast<size_t>(rule.Scratch()));
  for (int64_t d = lo; d < hi; ++d) {
    if (d + kPrefetchDistance < hi && shard.Owns(c.row[d + kPrefetchDistance])) {
      rule.Prefetch(shard.Local(c.row[d + kPrefetchDistance]));
      if (summed == nullptr) PrefetchChain(c, d + kPrefetchDistance, values, width);
    }
    if (!shard.Owns(c.row[d])) {  // another shard's row
      if constexpr (!Rule::kApply)
        std::memset(rule.out + c.Slot(d) * width, 0, sizeof(*rule.out) * static_cast<size_t>(width));
      continue;
    }
    float* g = summed != nullptr ? summed + d * width : own.data();
    if (summed == nullptr) {
      SumChain(c, d, values, width, g);
      if (clip.on) ClipRow(clip, g, width);
    }
    RowOrDecline(rule, g, shard.Local(c.row[d]), c.Slot(d), c.first[d], c.next.data(), scratch.data());
  }
}

// The entries [lo, hi) of a batch whose in-range keys are distinct.
template <class Rule>
OSA_TARGET_CLONES void UniqueRows(const Rule& rule, const Clip& clip, const int32_t* keys, const Shard& shard,
                                  const float* values, int64_t lo, int64_t hi) {
  const int64_t width = rule.width;
  std::vector<float> scratch(static_cast<size_t>(rule.Scratch()));
  std::vector<float> clipped(clip.on ? static_cast<size_t>(width) : 0);
  for (int64_t i = lo; i < hi; ++i) {
    if (i + kPrefetchDistance < hi && shard.Owns(keys[i + kPrefetchDistance]))
      rule.Prefetch(shard.Local(keys[i + kPrefetchDistance]));
    if (!shard.Owns(keys[i])) {
      if constexpr (!Rule::kApply) std::memset(rule.out + i * width, 0, sizeof(float) * static_cast<size_t>(width));
      continue;
    }
    RowOrDecline(rule, ClippedRow(clip, values + i * width, clipped.data(), width), shard.Local(keys[i]), i,
                 static_cast<int32_t>(i), nullptr, scratch.data());
  }
}

// An apply handler's step whose clipping takes its norm from the batch itself (Clip::norm), its keys possibly
// repeating: the norm of every row in range (a row shard's call too sums the whole gradient), then the row pass,
// clipping by it. (Keys taken as distinct take their entries' norm instead: Run.)
template <class Rule>
void RunNormClipped(xla::ffi::ThreadPool& pool, const Rule& rule, const Options& o, const int32_t* keys, int64_t k,
                    const Shard& shard, const float* values) {
  ForEachCoalescedPartNormClipped(pool, keys, k, values, rule.width, shard.num_rows, o.threads, o.clip.max_norm,
                                  [&](const Coalesced& c, float* sums, const Clip& clip) {
                                    CoalescedRows(rule, clip, c, shard, values, 0, c.size, sums);
                                  });
}

// Runs `rule` on every row the batch touches; with out_keys (the rows
// handlers), the keys packed as the step rows are.
template <class Rule>
void Run(xla::ffi::ThreadPool& pool, const Rule& rule, const Options& o, const int32_t* keys, int64_t k,
         const Shard& shard, const float* values, int32_t* out_keys) {
  if constexpr (Rule::kApply) {
    if (o.clip.norm && o.unique != 0) {
      // Keys taken as distinct: their entries' norm, as the sum_squares handler takes it (EntrySquares), then the
      // step as given the clipping's two scalars (a broken promise's rows are still summed first).
      Options clipped = o;
      clipped.clip = ClipOfNorm(EntrySquares(pool, keys, k, values, rule.width, shard.num_rows, o.threads),
                                o.clip.max_norm);
      Run(pool, rule, clipped, keys, k, shard, values, out_keys);
      return;
    }
    if (o.clip.norm) {
      RunNormClipped(pool, rule, o, keys, k, shard, values);
      return;
    }
  }
  const int64_t width = rule.width;
  const auto pad = static_cast<int32_t>(shard.num_rows);
  // A broken promise (a key twice) takes the coalescing path: its rows are
  // summed as without it, and no two threads ever write one row. Keys the
  // library made distinct itself skip the check.
  if (o.unique == 2 || (o.unique == 1 && !HasDuplicate(keys, k, shard.num_rows))) {
    if (out_keys != nullptr) {
      for (int64_t i = 0; i < k; ++i) out_keys[i] = InRange(keys[i], shard.num_rows) ? keys[i] : pad;
    }
    ParallelForOwned(pool, keys, k, shard, o.threads,
                     [&](int64_t lo, int64_t hi) { UniqueRows(rule, o.clip, keys, shard, values, lo, hi); });
    return;
  }
  if constexpr (Rule::kApply) {
    // The tables only need this shard's rows: each thread coalesces its share of them (ForEachCoalescedPart).
    ForEachCoalescedPart(pool, keys, k, shard.begin + shard.local_rows, shard.begin, o.threads,
                         [&](const Coalesced& c) {
                           CoalescedRows(rule, o.clip, c, shard, values, 0, c.size);
                         });
  } else {
    ForEachCoalescedPartInOrder(pool, keys, k, shard.num_rows, o.threads, rule.out, width, out_keys, pad,
                                [&](const Coalesced& c) {
                                  CoalescedRows(rule, o.clip, c, shard, values, 0, c.size);
                                });
  }
}

// The parameters of an apply handler, checked: of the dtype `p_out` has, one row of `width` entries per local row.
inline xla::ffi::Error CheckParams(const xla::ffi::AnyBuffer& p, xla::ffi::Result<xla::ffi::AnyBuffer>& p_out,
                       const xla::ffi::BufferR1<xla::ffi::U32>& seeds, int64_t local_rows, int64_t width) {
  if (p_out->element_type() != p.element_type()) return xla::ffi::Error::InvalidArgument("p_out must have p's dtype");
  if (static_cast<int64_t>(p.element_count()) != local_rows * width)
    return xla::ffi::Error::InvalidArgument("p must have one row of the values' width per row of the state");
  if (seeds.element_count() != 3)
    return xla::ffi::Error::InvalidArgument("seeds must hold three values (two seeds, then the draws' row offset)");
  return xla::ffi::Error::Success();
}

// The row id the draws give local row 0: the shard's first row, plus the third word of `seeds`, where a table
// inside shard_map (whose every call is a block of its own, row_begin 0) puts its block's first row, so that its
// rows draw as the whole table's do (RowSharding.update_and_apply with a key).
inline int64_t DrawsFirstRow(const Shard& shard, const xla::ffi::BufferR1<xla::ffi::U32>& seeds) {
  return shard.begin + static_cast<int64_t>(seeds.typed_data()[2]);
}

}  // namespace optax_sparse_adam

#endif  // OPTAX_SPARSE_ADAM_CSRC_ROW_LOOP_H_
