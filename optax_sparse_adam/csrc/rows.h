// Shared helpers of the row kernels: coalescing duplicate keys and splitting
// work over XLA's intra-op thread pool. Header-only; what it keeps between
// calls is a thread's scratch buffers (ScratchFloats, CoalescedBuffers), never
// numbers.
#ifndef OPTAX_SPARSE_ADAM_CSRC_ROWS_H_
#define OPTAX_SPARSE_ADAM_CSRC_ROWS_H_

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

// Portable code with AVX2/FMA and AVX-512 versions picked at load time (OSA_BASELINE_ONLY: the portable code
// alone; setup.py defines it for OPTAX_SPARSE_ADAM_BUILD_KERNELS=baseline). The clones compute the same numbers.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(OSA_BASELINE_ONLY)
#define OSA_TARGET_CLONES __attribute__((target_clones("default", "arch=x86-64-v3", "arch=x86-64-v4")))
#else
#define OSA_TARGET_CLONES
#endif

// Row functions called from the loops of OSA_TARGET_CLONES are inlined into
// them, so that each clone vectorizes them for its own ISA (a call would reach
// the baseline build, and std::fma there is a library call). GCC does not
// inline a plain `inline` function into a clone built for another -march: the
// clones called F16::Nearest out of line, once per element of their scalar
// loops, and a helper that only prefetches was dropped from them whole (a call
// without effects).
#define OSA_ROW_INLINE inline __attribute__((always_inline))

namespace optax_sparse_adam {

// Whether `key` addresses a row of a table with `num_rows` rows. Every other
// key (negative, or >= num_rows) is padding and is never dereferenced.
inline bool InRange(int32_t key, int64_t num_rows) { return key >= 0 && static_cast<int64_t>(key) < num_rows; }

// The rows a call holds: rows [begin, begin + local_rows) of a table of
// num_rows rows (all of it unless the table is sharded by rows). Keys address
// the whole table; a call reads and writes only the rows it holds.
struct Shard {
  int64_t num_rows;
  int64_t begin;
  int64_t local_rows;

  bool Owns(int32_t key) const { return key >= begin && key < begin + local_rows && InRange(key, num_rows); }
  int64_t Local(int32_t key) const { return key - begin; }
  // Checked by every handler before any row is touched.
  bool Valid() const {
    return num_rows >= 0 && num_rows <= INT32_MAX && begin >= 0 && local_rows >= 0 && begin + local_rows <= num_rows;
  }
};

// Floats per row of a table of dimensions `dims` (all but the first).
inline int64_t RowWidth(xla::ffi::Span<const int64_t> dims) {
  int64_t width = 1;
  for (size_t a = 1; a < dims.size(); ++a) width *= dims[a];
  return width;
}

// XLA passes the operand's buffer when it may alias the result (it copies
// beforehand otherwise); stay correct if it ever does not.
template <typename T>
inline void CopyIfNotAliased(T* dst, const T* src, size_t count) {
  if (dst != src && count > 0) std::memcpy(dst, src, sizeof(T) * count);
}

// A row's cache lines, ahead of time: to be written (kWrite 1) or only read (0).
template <int kWrite = 1, typename T>
OSA_ROW_INLINE void PrefetchRow(const T* row, int64_t width) {
  for (int64_t j = 0; j < width; j += 64 / static_cast<int64_t>(sizeof(T))) __builtin_prefetch(row + j, kWrite, 3);
}

OSA_ROW_INLINE uint32_t Mix(uint32_t x) {  // murmur3's 32-bit finalizer
  x ^= x >> 16;
  x *= 0x85EBCA6Bu;
  x ^= x >> 13;
  x *= 0xC2B2AE35u;
  return x ^ (x >> 16);
}

// ---- Parameters in an apply handler: float32, or bfloat16 / float16 widened to float32 exactly and rounded
// back once per step, to nearest (apply_updates: (p + u).astype(p.dtype)) or stochastically
// (apply_updates_stochastic: _round_with on the draws of _draws).

inline uint32_t Bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  return u;
}

inline float FromBits(uint32_t u) {
  float x;
  std::memcpy(&x, &u, sizeof(x));
  return x;
}

// bfloat16: the top half of a float32.
// The magnitudes compare as int32 (|x|'s bits are below 2**31): AVX2 compares signed lanes in one instruction, and
// unsigned ones in three. Both roundings select in 32-bit lanes and narrow once.
struct Bf16 {
  OSA_ROW_INLINE static float Widen(uint16_t h) { return FromBits(uint32_t{h} << 16); }
  OSA_ROW_INLINE static uint16_t Nearest(float x) { return static_cast<uint16_t>(NearestBits(Bits(x))); }
  // Stochastic rounding (_round_with): the draw's top 16 bits added below the kept half, then truncated. x goes
  // up in magnitude with probability (low half of x) / 2^16, exactly (x - lo) / (hi - lo): a bfloat16 is the top
  // half of a float32, so the float32s between two neighbours are evenly spaced (subnormals too), and a carry into
  // the exponent is the next neighbour. To nearest past the largest finite value (infinities and NaN too).
  OSA_ROW_INLINE static uint16_t Stochastic(float x, uint32_t bits) {
    const uint32_t u = Bits(x);
    const uint32_t drawn = (u + (bits >> 16)) >> 16;
    return static_cast<uint16_t>(Magnitude(u) > 0x7F7F0000 ? NearestBits(u) : drawn);
  }

 private:
  OSA_ROW_INLINE static int32_t Magnitude(uint32_t u) { return static_cast<int32_t>(u & 0x7FFFFFFFu); }
  // Round to nearest even, in the low 16 bits; a NaN stays a (quiet) NaN.
  OSA_ROW_INLINE static uint32_t NearestBits(uint32_t u) {
    const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    return Magnitude(u) > 0x7F800000 ? (u >> 16) | 0x40u : rounded;
  }
};

// float16 (IEEE binary16): the conversions of the FP16 library (github.com/Maratyszcza/FP16, MIT license), exact,
// round to nearest even, overflow to infinity, a NaN kept a quiet NaN. Branch-free float32 and integer arithmetic,
// so that the row loops vectorize on any ISA (the compiler's _Float16 conversions do not).
struct F16 {
  OSA_ROW_INLINE static float Widen(uint16_t h) {
    const uint32_t w = uint32_t{h} << 16;
    const uint32_t sign = w & 0x80000000u;
    const uint32_t two_w = w + w;
    const float normalized = FromBits((two_w >> 4) + (0xE0u << 23)) * 0x1p-112f;
    const float denormalized = FromBits((two_w >> 17) | (126u << 23)) - 0.5f;
    const uint32_t denormalized_bits = Bits(denormalized), normalized_bits = Bits(normalized);
    return FromBits(sign | (two_w < (1u << 27) ? denormalized_bits : normalized_bits));
  }
  OSA_ROW_INLINE static uint16_t Nearest(float x) {
    const float base = (std::fabs(x) * 0x1p+112f) * 0x1p-110f;
    const uint32_t w = Bits(x);
    const uint32_t shl1_w = w + w;
    const uint32_t sign = w & 0x80000000u;
    const uint32_t exponent = shl1_w & 0xFF000000u;
    const uint32_t bias = exponent < 0x71000000u ? 0x71000000u : exponent;
    const uint32_t bits = Bits(FromBits((bias >> 1) + 0x07800000u) + base);
    const uint32_t nonsign = ((bits >> 13) & 0x7C00u) + (bits & 0x0FFFu);
    return static_cast<uint16_t>((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
  }
  // Stochastic rounding (_round_with): RoundStochastic (below) on the draw's top 24 bits as a fraction.
  OSA_ROW_INLINE static uint16_t Stochastic(float x, uint32_t bits);
};

OSA_ROW_INLINE bool IsFinite(float x) { return (Bits(x) & 0x7F800000u) != 0x7F800000u; }

// A catch-up rule's update of a row that sat out steps (tx.update's, or the fused step's before it adds it back):
// the difference that takes the stored p0 to `target`, the replayed row plus its step; where p0 is an infinity,
// `target` itself (inf - inf is NaN; p0 + target is the infinity the replay kept, as the dense optimizer's steps
// leave it). As _catch_up.caught_up_update computes it, bitwise.
OSA_ROW_INLINE float CaughtUpUpdate(float target, float p0) {
  const bool infinite = (Bits(p0) & 0x7FFFFFFFu) == 0x7F800000u;
  return target - (infinite ? 0.0f : p0);
}

// b ** n for an int32 n (1 where n <= 0) from b's table (t[256 i + j] = b ** (j 256**i)), as
// _catch_up.table_power computes it (the catch-up kernels' decays): the entries of n's base-256 digits multiplied
// lowest first, a product below float32's smallest normal number taken as 0 (the same whether or not denormals are
// flushed).
OSA_ROW_INLINE float TablePower(const float* t, int32_t n) {
  const uint32_t k = n > 0 ? static_cast<uint32_t>(n) : 0u;
  float x = t[k & 255u];
  for (int i = 1; i < 4; ++i) {
    x = x * t[256 * i + ((k >> (8 * i)) & 255u)];
    x = x < FLT_MIN ? 0.0f : x;
  }
  return x;
}

// The idle steps at count `done` of a row whose record is `last` (0 for a row that never moved, last == 0), as the
// catch-up rules compute them (jnp.where(last > 0, done - last, 0), int32 arithmetic wrapping as XLA's does).
OSA_ROW_INLINE int32_t IdleSince(int32_t done, int32_t last) {
  return last > 0 ? static_cast<int32_t>(static_cast<uint32_t>(done) - static_cast<uint32_t>(last)) : 0;
}

// The entry of the state's record (_catch_up.IdleRecord) for a row whose last step is `last`: last mod its length
// `record_steps` (jnp.mod: last >= 0), where `far_steps` (the last step each entry is for) says it is for `last`;
// -1 where the record does not hold it (a negative last step too), the row's idle steps not at hand.
OSA_ROW_INLINE int64_t RecordEntry(const int32_t* far_steps, int64_t record_steps, int32_t last) {
  if (last < 0) return -1;
  const int64_t at = last % record_steps;
  return far_steps[at] == last ? at : -1;
}

// _round_with for float16: x rounded up or down at random (u uniform in [0, 1)), unbiased; to nearest where the
// dtype holds x, where x is not finite, and where a neighbour is not. Branch-free, so that the row loops vectorize:
// the other candidate is the 16-bit neighbour of the nearest toward x (as jax.lax.nextafter steps, from a zero of
// either sign to the smallest subnormal of x's sign), and x goes to the upper of the two with probability
// (x - lower) / (upper - lower).
template <class Half>
OSA_ROW_INLINE uint16_t RoundStochastic(float x, float u) {
  const uint32_t nearest = Half::Nearest(x);
  const float near = Half::Widen(static_cast<uint16_t>(nearest));
  const bool up = near < x;  // the other candidate lies above
  const bool negative = (nearest & 0x8000u) != 0;
  const uint32_t stepped = up != negative ? nearest + 1 : nearest - 1;
  const uint32_t from_zero = 0x8001u - (uint32_t{up} << 15);  // 0x0001 up, 0x8001 down (a nested ?: branches)
  const uint32_t other = (nearest & 0x7FFFu) == 0 ? from_zero : stepped;
  const float far = Half::Widen(static_cast<uint16_t>(other));
  const float lo = up ? near : far, hi = up ? far : near;
  const bool to_hi = u < (x - lo) / (hi - lo);
  const uint32_t rounded = to_hi == up ? other : nearest;
  const bool exact = (near == x) | !IsFinite(x) | !IsFinite(near) | !IsFinite(far);  // | : no branches
  return static_cast<uint16_t>(exact ? nearest : rounded);
}

OSA_ROW_INLINE uint16_t F16::Stochastic(float x, uint32_t bits) {
  return RoundStochastic<F16>(x, static_cast<float>(bits >> 8) * 0x1p-24f);
}

// Stochastic rounding's draws, as _draws makes them: a row's elements draw its seed (Params::RowSeed) plus their
// position times the golden ratio, which the row loops add element by element (a row's draws are
// `for (j = 0, draw = seed; j < width; ++j, draw += kDrawStep)`): GCC's AVX2 clones computed the product from the
// loop's 64-bit counter, 19 of the 115 instructions of each 16 elements of row-wise Adam's bfloat16 row loop.
constexpr uint32_t kDrawStep = 0x9E3779B9u;

// float32 parameters: read and written as they are.
struct F32Params {
  using T = float;
  static float Load(float x) { return x; }
  uint32_t RowSeed(int64_t) const { return 0; }
  float Store(float x, uint32_t) const { return x; }
};

// bfloat16 or float16 parameters. Stochastic rounding draws as _draws does: the row's seed is murmur3's
// finalizer over the global row id and the two 32-bit seeds of the leaf's key, an element's draw that seed plus
// its position times kDrawStep (Half::Stochastic takes the bits it uses from it).
template <class Half, bool kStochastic>
struct HalfParams {
  using T = uint16_t;
  uint32_t seed0 = 0, seed1 = 0;
  int64_t first_row = 0;  // the global id of local row 0 (a row shard's first row)

  static float Load(uint16_t h) { return Half::Widen(h); }
  OSA_ROW_INLINE uint32_t RowSeed(int64_t r) const {
    return kStochastic ? Mix(Mix(static_cast<uint32_t>(r + first_row) ^ seed0) ^ seed1) : 0;
  }
  // x rounded to the table's format, stochastically with the element's draw.
  OSA_ROW_INLINE uint16_t Store(float x, uint32_t draw) const {
    if constexpr (!kStochastic) {
      return Half::Nearest(x);
    } else {
      return Half::Stochastic(x, draw);
    }
  }
};

// fn(params) with the policy for 16-bit parameters of format Half, rounded to nearest or stochastically.
template <class Half, typename F>
void WithHalfParams(bool stochastic, const uint32_t* seeds, int64_t first_row, F fn) {
  if (stochastic) {
    fn(HalfParams<Half, true>{seeds[0], seeds[1], first_row});
  } else {
    fn(HalfParams<Half, false>{seeds[0], seeds[1], first_row});
  }
}

// Calls fn(params) with the policy for parameters of `type` (F32, BF16 or F16) rounded by `rounding` (0 to
// nearest, 1 stochastically with `seeds`; float32 parameters are never rounded); an error for another type.
template <typename F>
xla::ffi::Error WithParams(xla::ffi::DataType type, int64_t rounding, const uint32_t* seeds, int64_t first_row,
                           F fn) {
  using xla::ffi::DataType;
  if (rounding != 0 && rounding != 1) return xla::ffi::Error::InvalidArgument("rounding must be 0 or 1");
  switch (type) {
    case DataType::F32:
      fn(F32Params{});
      return xla::ffi::Error::Success();
    case DataType::BF16:
      WithHalfParams<Bf16>(rounding == 1, seeds, first_row, fn);
      return xla::ffi::Error::Success();
    case DataType::F16:
      WithHalfParams<F16>(rounding == 1, seeds, first_row, fn);
      return xla::ffi::Error::Success();
    default:
      return xla::ffi::Error::InvalidArgument("the parameters must be float32, bfloat16 or float16");
  }
}

// Global-norm clipping of a summed gradient row, as optax.clip_by_global_norm
// scales it: g = (g / div) * mul, in place (div = mul = 1 where it does not
// clip). The apply handlers take div and mul as two more scalars; or, where
// the table is the only leaf the clipping sees, its max_norm alone (`norm`):
// the handler then sums the batch's rows once, their squares as the
// sum_squares handler adds them, and takes div and mul from that norm
// (ClipOfNorm) before the row pass, which reads the sums it kept (keys taken
// as distinct: the squares of their entries, EntrySquares, and nothing summed).
struct Clip {
  bool on = false;
  float div = 1.0f, mul = 1.0f;
  bool norm = false;      // div and mul still to come from the batch's norm
  float max_norm = 0.0f;  // with `norm`
};
constexpr int64_t kNumClipScalars = 2;
constexpr int64_t kNumNormClipScalars = 1;

// Whether `count` scalars are a handler's `num` and, where it `clips`, the clipping's (either form).
inline bool ScalarCountOk(int64_t count, int64_t num, bool clips) {
  return count == num || (clips && (count == num + kNumClipScalars || count == num + kNumNormClipScalars));
}

OSA_ROW_INLINE void ClipRow(const Clip& clip, float* __restrict g, int64_t width) {
  const float div = clip.div, mul = clip.mul;
  for (int64_t j = 0; j < width; ++j) g[j] = (g[j] / div) * mul;
}

// The clipping of a gradient whose squares sum to `sum_of_squares` (float32), as the XLA side computes it from
// that sum: g_norm = sqrt(sum), and where g_norm < max_norm nothing (div = mul = 1), else div = g_norm and
// mul = max_norm. A NaN norm clips every row to NaN, as there.
inline Clip ClipOfNorm(float sum_of_squares, float max_norm) {
  const float g_norm = std::sqrt(sum_of_squares);
  if (g_norm < max_norm) return Clip{true, 1.0f, 1.0f};
  return Clip{true, g_norm, max_norm};
}

// The gradient row g as the rule should see it: g itself where `clip` is off,
// else a clipped copy of it in `buf` (width floats).
OSA_ROW_INLINE const float* ClippedRow(const Clip& clip, const float* g, float* __restrict buf, int64_t width) {
  if (!clip.on) return g;
  std::memcpy(buf, g, sizeof(float) * static_cast<size_t>(width));
  ClipRow(clip, buf, width);
  return buf;
}

// The clipping's scalars where `scalars` holds them after its first `count` (div and mul, or max_norm alone);
// a clipping that is off where it holds `count` only.
inline Clip ReadClip(const xla::ffi::BufferR1<xla::ffi::F32>& scalars, int64_t count) {
  const auto n = static_cast<int64_t>(scalars.element_count());
  const float* x = scalars.typed_data();
  if (n == count + kNumClipScalars) return Clip{true, x[count], x[count + 1]};
  if (n == count + kNumNormClipScalars) return Clip{true, 1.0f, 1.0f, true, x[count]};
  return Clip{};
}

// The sum of the squares of a row in double: eight running sums, one per lane of eight elements (an in-order sum
// would not vectorize), the same order on every ISA. A float's square is exact in double.
OSA_ROW_INLINE double RowSquares(const float* __restrict row, int64_t width) {
  constexpr int64_t kLanes = 8;
  double lane[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= width; j += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) lane[l] += static_cast<double>(row[j + l]) * static_cast<double>(row[j + l]);
  }
  for (; j < width; ++j) lane[0] += static_cast<double>(row[j]) * static_cast<double>(row[j]);
  return ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
}

// The rows' sums of squares added in slot order, in double, rounded once.
inline float TotalSquares(const std::vector<double>& squares) {
  double total = 0.0;
  for (const double x : squares) total += x;
  return static_cast<float>(total);
}

// What coalescing keeps between calls on a thread: the buffers of a Coalesced, handed back when it is destroyed
// and taken by the next one on the thread (up to kKept sets, each of at most kKeep keys; larger ones are freed).
// Fresh buffers cost a batch of 8,192 keys a third of its coalescing time (allocating and clearing them).
struct CoalescedBuffers {
  static constexpr size_t kKept = 4;
  static constexpr size_t kKeep = size_t{1} << 22;
  std::vector<int32_t> row, first, next, entry, last, picked;
  std::vector<uint16_t> part_of;
  std::vector<int64_t> table;

  static std::vector<CoalescedBuffers>& Kept() {
    thread_local std::vector<CoalescedBuffers> kept;
    return kept;
  }
};

// The distinct in-range keys of a batch, in order of first occurrence, with
// the entries of each chained in entry order (so sums of duplicates are taken
// in the order XLA's scatter-add takes them).
struct Coalesced : CoalescedBuffers {
  // row[d]: the d-th distinct key; first[d]: its first entry; next[i]: the next entry with entry i's key, or -1
  // (unset for a skipped entry); entry[i]: the distinct row d entry i adds to, or -1 for a skipped entry.
  // (last and table: Coalesce's own.)
  int64_t size = 0;  // number of distinct keys
  int64_t taken = -1;  // with parts: the number of the part's entries, listed in picked (in entry order); else -1
  // A part's (CoalescedParts): each of the batch's first entries' place among all the parts' distinct rows, by entry.
  const int32_t* slot_of_first = nullptr;

  // Distinct row d's place in the batch's order of first occurrence: d itself, or for a part, its place among all
  // the parts' rows (where its step row goes).
  OSA_ROW_INLINE int64_t Slot(int64_t d) const { return slot_of_first == nullptr ? d : slot_of_first[first[d]]; }

  Coalesced() {
    auto& kept = Kept();
    if (!kept.empty()) {
      static_cast<CoalescedBuffers&>(*this) = std::move(kept.back());
      kept.pop_back();
    }
  }
  ~Coalesced() {
    auto& kept = Kept();
    if (kept.size() < kKept && entry.capacity() <= kKeep && table.capacity() <= 2 * kKeep)
      kept.push_back(std::move(static_cast<CoalescedBuffers&>(*this)));
  }
  Coalesced(const Coalesced&) = delete;
  Coalesced& operator=(const Coalesced&) = delete;
};

// Distinct row d's first two entries' gradient rows, read ahead of SumChain: a chain visits the batch's entries out
// of order, where the hardware's prefetcher does not follow, and most of a Zipf batch's rows have one or two entries.
// With the batch out of the caches, the chain's loads took about two thirds of the plain Adam kernel's time.
OSA_ROW_INLINE void PrefetchChain(const Coalesced& c, int64_t d, const float* values, int64_t width) {
  const int32_t first = c.first[d];
  PrefetchRow<0>(values + first * width, width);
  if (const int32_t second = c.next[first]; second >= 0) PrefetchRow<0>(values + second * width, width);
}

// Distinct row d's gradient into g: its entries summed from 0 in entry order,
// as XLA's scatter-add sums duplicates.
OSA_ROW_INLINE void SumChain(const Coalesced& c, int64_t d, const float* values, int64_t width, float* __restrict g) {
  const float* row = values + static_cast<int64_t>(c.first[d]) * width;
  for (int64_t j = 0; j < width; ++j) g[j] = 0.0f + row[j];
  for (int32_t e = c.next[c.first[d]]; e >= 0; e = c.next[e]) {
    const float* ge = values + static_cast<int64_t>(e) * width;
    for (int64_t j = 0; j < width; ++j) g[j] += ge[j];
  }
}

// The slots of an open-addressing table for k keys: the smallest power of two of at least 2k (and 16), so that
// probes stay short. A key's home slot is the top bits of key * 2**32 / phi (Fibonacci hashing: one multiply,
// and keys in arithmetic progression, the usual ids, land far apart); a probe moves to the next slot.
struct KeySlots {
  uint32_t mask;
  int shift;

  explicit KeySlots(int64_t k) {
    int log_t = 4;
    while ((int64_t{1} << log_t) < 2 * k) ++log_t;
    mask = static_cast<uint32_t>((uint64_t{1} << log_t) - 1);
    shift = 32 - log_t;
  }
  size_t count() const { return size_t{mask} + 1; }
  uint32_t Home(int32_t key) const { return (static_cast<uint32_t>(key) * 0x9E3779B1u) >> shift; }
  uint32_t Next(uint32_t h) const { return (h + 1) & mask; }
};

// Whether two of the keys in [0, num_rows) are equal: the check behind a
// `unique` promise, so that a broken one is summed like any batch instead of
// racing. Open addressing over at least 2k slots: O(k) expected.
inline bool HasDuplicate(const int32_t* keys, int64_t k, int64_t num_rows) {
  const KeySlots slots(k);
  thread_local std::vector<int32_t> kept;  // reused by the thread's next check (freed past kKeep slots)
  std::vector<int32_t> own;
  std::vector<int32_t>& slot = slots.count() <= CoalescedBuffers::kKeep ? kept : own;
  slot.assign(slots.count(), -1);
  for (int64_t i = 0; i < k; ++i) {
    const int32_t key = keys[i];
    if (!InRange(key, num_rows)) continue;
    uint32_t h = slots.Home(key);
    while (slot[h] >= 0 && slot[h] != key) h = slots.Next(h);
    if (slot[h] == key) return true;
    slot[h] = key;
  }
  return false;
}

// The most parts a batch's keys are split into by KeyPart (a part's number fits 16 bits, kNoPart aside).
constexpr int64_t kMaxKeyParts = 1 << 15;
constexpr uint16_t kNoPart = 0xFFFF;

// The part of [0, parts) a key falls in, where a batch's keys are split by key over parts that each coalesce their
// own (Coalesce with parts > 1): the top 16 bits of murmur3's mix of the key, scaled to [0, parts) by a multiply
// (no division a key, and in 32 bits, so that a loop of them vectorizes). Independent of KeySlots::Home, so that a
// part's keys spread over its table.
OSA_ROW_INLINE uint32_t KeyPart(uint32_t key, uint32_t parts) { return ((Mix(key) >> 16) * parts) >> 16; }

// part_of[i]: the part of [0, parts) of key i (KeyPart), or kNoPart where the key is outside [first, first + span).
// A loop of its own, built for each ISA (its AVX2 and AVX-512 clones multiply eight or sixteen keys at once; the
// baseline x86-64 has no 32-bit vector multiply).
OSA_TARGET_CLONES inline void KeyParts(const int32_t* __restrict keys, int64_t k, uint32_t first, uint32_t span,
                                       uint32_t parts, uint16_t* __restrict part_of) {
  for (int64_t i = 0; i < k; ++i) {
    const auto key = static_cast<uint32_t>(keys[i]);
    part_of[i] = key - first < span ? static_cast<uint16_t>(KeyPart(key, parts)) : kNoPart;
  }
}

// The keys in [lo, hi) are coalesced, the others skipped; with parts > 1, only the keys of part `part` (KeyPart),
// the others skipped too, and the part's distinct rows numbered from 0 in their order of first occurrence. Open
// addressing over a table of at least twice the slots of the entries taken, each slot a key and its distinct row in
// one word (one load a probe): O(k) expected. Each entry's distinct row is recorded as it is hashed
// (Coalesced::entry).
inline void Coalesce(const int32_t* keys, int64_t k, int64_t hi, int64_t lo, Coalesced& out, int64_t part = 0,
                     int64_t parts = 1) {
  out.next.resize(k);
  out.entry.resize(k);
  int32_t* __restrict next = out.next.data();
  int32_t* __restrict entry = out.entry.data();
  // With parts, the part's entries are listed first, without a branch (a key's part is as good as random: a branch
  // on it would miss half the time), and the per-row buffers and the table sized for them alone. Every key's part
  // is computed first, in a loop of its own built for each ISA (KeyParts): hashed inside the listing's loop, the
  // keys took a part 17 us to list of a batch of 8,192 Zipf keys, against 8 us so on AVX2 (one of two parts,
  // the whole of Coalesce, in 34 us instead of 44; 2 cores of an AMD EPYC).
  int64_t n = k;
  int32_t* __restrict picked = nullptr;
  if (parts > 1) {
    out.picked.resize(k);
    out.part_of.resize(k);
    picked = out.picked.data();
    KeyParts(keys, k, static_cast<uint32_t>(lo), static_cast<uint32_t>(hi - lo), static_cast<uint32_t>(parts),
             out.part_of.data());
    const uint16_t* __restrict part_of = out.part_of.data();  // read only from here on (restrict's rule)
    std::fill(entry, entry + k, -1);
    const auto mine = static_cast<uint16_t>(part);
    n = 0;
    for (int64_t i = 0; i < k; ++i) {
      picked[n] = static_cast<int32_t>(i);
      n += part_of[i] == mine;
    }
  }
  out.taken = picked != nullptr ? n : -1;
  out.slot_of_first = nullptr;
  out.row.resize(n);
  out.first.resize(n);
  out.last.resize(n);  // last[d]: the latest entry of distinct row d
  out.size = 0;
  const KeySlots slots(n);
  out.table.assign(slots.count(), -1);  // (distinct row << 32) | key, or -1 for an empty slot
  int64_t* __restrict table = out.table.data();
  int32_t* __restrict last = out.last.data();
  int32_t* __restrict row = out.row.data();
  int32_t* __restrict first = out.first.data();
  int32_t size = 0;  // kept here, not in `out`, which the table's stores would otherwise reload it from
  const auto add = [&](int64_t i, int32_t key) __attribute__((always_inline)) {
    uint32_t h = slots.Home(key);
    int64_t slot;
    while ((slot = table[h]) >= 0 && static_cast<int32_t>(slot & 0xFFFFFFFF) != key) h = slots.Next(h);
    const auto e = static_cast<int32_t>(i);
    next[i] = -1;
    if (slot >= 0) {
      const auto d = static_cast<int32_t>(slot >> 32);
      next[last[d]] = e;
      last[d] = e;
      entry[i] = d;
    } else {
      const int32_t d = size++;
      table[h] = (int64_t{d} << 32) | static_cast<uint32_t>(key);
      row[d] = key;
      first[d] = e;
      last[d] = e;
      entry[i] = d;
    }
  };
  if (picked != nullptr) {
    for (int64_t j = 0; j < n; ++j) add(picked[j], keys[picked[j]]);
  } else {
    for (int64_t i = 0; i < k; ++i) {
      const int32_t key = keys[i];
      if (key < lo || key >= hi) {
        entry[i] = -1;
        continue;
      }
      add(i, key);
    }
  }
  out.size = size;
}

// Entry i's gradient row added to its distinct row's sum, where that row (row_of[i]) is in [lo, hi) (`sums`: the
// sums of the rows [lo, hi), (hi - lo) x width).
OSA_ROW_INLINE void SumEntry(const int32_t* row_of, int64_t i, const float* values, int64_t width, int64_t lo,
                             int64_t hi, float* sums) {
  const int64_t d = row_of[i];
  if (d < lo || d >= hi) return;
  float* __restrict g = sums + (d - lo) * width;
  const float* __restrict v = values + i * width;
  for (int64_t j = 0; j < width; ++j) g[j] = g[j] + v[j];
}

// The gradient rows of the distinct rows [lo, hi) of a coalesced batch of k entries (row_of: Coalesced::entry),
// summed into `sums` ((hi - lo) x width, zeros on entry): each from 0 in entry order, as XLA's scatter-add sums
// them, reading the entries in order (following each row's chain of entries instead misses the cache at every one).
OSA_ROW_INLINE void SumEntries(const int32_t* row_of, int64_t k, const float* values, int64_t width, int64_t lo,
                               int64_t hi, float* sums) {
  for (int64_t i = 0; i < k; ++i) SumEntry(row_of, i, values, width, lo, hi, sums);
}

// SumEntries on a batch of k entries coalesced as `c` (the summing pass of the norm-clipped steps, SummedParts). A
// part's coalescing (Coalesce with parts) lists its entries: they are read from that list, each a few entries ahead
// of its turn (they are spread over the batch, where the hardware's prefetcher does not follow: without it, a
// row-wise Adagrad step at 1e6 x 128 with 8,192 uniform ids and the batch out of the caches took 0.68 ms against
// 0.49 coalesced on one thread, when its row loop summed this way; with it, about 0.58, and reading 16 entries
// ahead measured the same).
OSA_ROW_INLINE void SumEntries(const Coalesced& c, int64_t k, const float* values, int64_t width, int64_t lo,
                               int64_t hi, float* sums) {
  if (c.taken < 0) {
    SumEntries(c.entry.data(), k, values, width, lo, hi, sums);
    return;
  }
  constexpr int64_t kAhead = 8;
  const int32_t* picked = c.picked.data();
  for (int64_t j = 0; j < c.taken; ++j) {
    if (j + kAhead < c.taken) PrefetchRow<0>(values + static_cast<int64_t>(picked[j + kAhead]) * width, width);
    SumEntry(c.entry.data(), picked[j], values, width, lo, hi, sums);
  }
}

// Runs fn(lo, hi) over [0, n) split into `parts` contiguous ranges, part 0 on
// the calling thread and the others on XLA's intra-op pool. Parts are claimed
// through a shared counter, so the caller runs any part no pool thread has
// started: it never waits on a task that has not begun, whatever the pool's
// size. State the late tasks may still touch lives in a shared_ptr.
template <typename F>
void ParallelFor(xla::ffi::ThreadPool& pool, int64_t n, int64_t parts, F fn) {
  parts = std::max<int64_t>(1, std::min(parts, n));
  if (parts == 1) {
    if (n > 0) fn(int64_t{0}, n);
    return;
  }
  struct Shared {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
  };
  auto shared = std::make_shared<Shared>();
  auto run_parts = [shared, n, parts, &fn] {
    for (int64_t p; (p = shared->next.fetch_add(1, std::memory_order_acq_rel)) < parts;) {
      fn(n * p / parts, n * (p + 1) / parts);
      shared->done.fetch_add(1, std::memory_order_acq_rel);
    }
  };
  for (int64_t t = 1; t < parts; ++t) pool.Schedule([run_parts] { run_parts(); });
  run_parts();
  while (shared->done.load(std::memory_order_acquire) < parts) std::this_thread::yield();
}

// Runs fn(lo, hi) over the slots [0, size) that a batch's k entries fall in (slot_of[i]: entry i's slot, or -1 for
// none), split into contiguous ranges of about equal work for up to `threads` threads, a slot weighing its entries
// plus `row_weight` (what reading and writing its state costs, in entries read). Split by slots alone, the thread
// holding a Zipf batch's first rows (its hot ids, first seen early) would add most of the batch's entries while the
// other read and wrote as many rows with few entries each. Each slot is still one thread's, so the numbers do not
// depend on the split.
template <typename F>
void ParallelForSlots(xla::ffi::ThreadPool& pool, const int32_t* slot_of, int64_t k, int64_t size,
                      int64_t row_weight, int64_t threads, F fn) {
  // work[d + 1]: the work of the slots up to d.
  std::vector<int64_t> work(static_cast<size_t>(size) + 1, 0);
  for (int64_t i = 0; i < k; ++i) {
    if (slot_of[i] >= 0) ++work[slot_of[i] + 1];
  }
  for (int64_t d = 0; d < size; ++d) work[d + 1] += work[d] + row_weight;
  const int64_t total = work[size];
  // A thread is worth its scheduling past a few dozen rows.
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(threads, size / 32 + 1));
  // The first slot whose work starts in part p's share of it.
  const auto bound = [&](int64_t p) {
    return p == parts ? size
                      : static_cast<int64_t>(std::lower_bound(work.begin(), work.end() - 1, total * p / parts) -
                                             work.begin());
  };
  ParallelFor(pool, parts, parts, [&](int64_t part_lo, int64_t part_hi) {
    for (int64_t part = part_lo; part < part_hi; ++part) {
      const int64_t lo = part == 0 ? 0 : bound(part), hi = bound(part + 1);
      if (lo < hi) fn(lo, hi);
    }
  });
}

// The parts a batch of k keys is split into for ForEachCoalescedPart: one a thread, up to `threads`, where a thread
// is worth its scheduling (past a few dozen keys, as past a few dozen rows in ParallelForSlots).
inline int64_t CoalescingParts(int64_t k, int64_t threads) {
  return std::max<int64_t>(1, std::min<int64_t>({threads, k / 32 + 1, kMaxKeyParts}));
}

// An apply handler's pass over a batch whose keys may repeat, with no coalescing before it on one thread: the keys
// in [lo, hi) split by key over up to `threads` parts (KeyPart), each part coalescing its own keys on the thread
// that takes it (Coalesce) and handing them to fn(c), their distinct rows [0, c.size). Every row is one part's, its
// entries chained and summed in entry order, so the numbers are the one-thread coalescing's. A part computes every
// key's part (KeyParts, vectorized) but hashes only its own: of a Zipf batch of 8,192 keys on one thread, Coalesce
// takes 44 us for the whole batch (one part) and 34 for either of two parts, whose keys, spread over the batch,
// cost more each (AVX2, 2 cores of an AMD EPYC; a fused Adam step at 1e6 x 64 takes about 500). A part's buffers hold
// 14 bytes an entry of the batch and 28 a key of its own, each thread's kept for its next call (CoalescedBuffers).
// (Where rows must come out in the batch's order of first occurrence, CoalescedParts numbers the parts' rows in it.)
template <typename F>
void ForEachCoalescedPart(xla::ffi::ThreadPool& pool, const int32_t* keys, int64_t k, int64_t hi, int64_t lo,
                          int64_t threads, F fn) {
  const int64_t parts = CoalescingParts(k, threads);
  ParallelFor(pool, parts, parts, [&](int64_t part_lo, int64_t part_hi) {
    for (int64_t part = part_lo; part < part_hi; ++part) {
      Coalesced c;
      Coalesce(keys, k, hi, lo, c, part, parts);
      if (c.size > 0) fn(c);
    }
  });
}

// A batch's keys coalesced in parts as ForEachCoalescedPart splits them, every part kept for passes after all have
// coalesced, and each part's distinct rows numbered in the batch's order of first occurrence over all the parts
// (Coalesced::Slot): their numbers in the one-thread coalescing, so that rows packed, and squares added, in that
// order come out as one thread's, bitwise. Each part marks its rows' first entries as it coalesces; one pass over
// the k entries then numbers them (a count of the marks before each).
class CoalescedParts {
 public:
  // The keys in [lo, hi) of a batch of k, coalesced in up to `threads` parts on the pool; each(t, c) runs on part
  // t's thread right after it coalesces (a pass over the part's entries while they are in that core's caches).
  template <typename F>
  CoalescedParts(xla::ffi::ThreadPool& pool, const int32_t* keys, int64_t k, int64_t hi, int64_t lo,
                 int64_t threads, F each)
      : part_(static_cast<size_t>(CoalescingParts(k, threads))), slot_(static_cast<size_t>(k), 0) {
    const auto n = static_cast<int64_t>(part_.size());
    int32_t* mark = slot_.data();  // every part marks entries of its own: no two threads write one element
    ParallelFor(pool, n, n, [&](int64_t t_lo, int64_t t_hi) {
      for (int64_t t = t_lo; t < t_hi; ++t) {
        Coalesced& c = part_[t];
        Coalesce(keys, k, hi, lo, c, t, n);
        for (int64_t d = 0; d < c.size; ++d) mark[c.first[d]] = 1;
        each(t, static_cast<const Coalesced&>(c));
      }
    });
    int32_t seen = 0;  // slot_[i]: the number of first entries before entry i
    for (int64_t i = 0; i < k; ++i) {
      const int32_t first = slot_[i];
      slot_[i] = seen;
      seen += first;
    }
    size_ = seen;
    offset_.resize(part_.size());
    for (int64_t t = 0, at = 0; t < n; at += part_[t].size, ++t) {
      offset_[t] = at;
      part_[t].slot_of_first = slot_.data();
    }
  }
  CoalescedParts(xla::ffi::ThreadPool& pool, const int32_t* keys, int64_t k, int64_t hi, int64_t lo, int64_t threads)
      : CoalescedParts(pool, keys, k, hi, lo, threads, [](int64_t, const Coalesced&) {}) {}

  int64_t parts() const { return static_cast<int64_t>(part_.size()); }
  const Coalesced& part(int64_t t) const { return part_[t]; }
  int64_t size() const { return size_; }  // distinct rows over all parts
  int64_t offset(int64_t t) const { return offset_[t]; }  // distinct rows in the parts before part t

  // fn(t, c) for every part with distinct rows, each on a thread of the pool.
  template <typename F>
  void ForEach(xla::ffi::ThreadPool& pool, F fn) const {
    const int64_t n = parts();
    ParallelFor(pool, n, n, [&](int64_t t_lo, int64_t t_hi) {
      for (int64_t t = t_lo; t < t_hi; ++t) {
        if (part_[t].size > 0) fn(t, part_[t]);
      }
    });
  }

 private:
  std::vector<Coalesced> part_;
  std::vector<int32_t> slot_;
  std::vector<int64_t> offset_;
  int64_t size_ = 0;
};

// A step's padding slots [size, k) (k slots of width floats at out, the first `size` of them the distinct rows
// [0, size)) zeroed: with lo < hi, the share of the part holding rows [lo, hi) (CoalescedParts::offset), in
// proportion (the parts' shares tile the slots), so that the threads write them together (one thread wrote the
// 6,145 slots of a Zipf batch of 8,192 ids, 1.5 MB at width 64, while the others waited); with no distinct rows (no
// part runs), every slot.
template <typename T>
inline void ZeroPadding(T* out, int64_t width, int64_t size, int64_t k, int64_t lo, int64_t hi) {
  const int64_t pad = k - size;
  const int64_t a = size == 0 ? 0 : size + pad * lo / size, b = size == 0 ? k : size + pad * hi / size;
  std::memset(out + a * width, 0, sizeof(T) * static_cast<size_t>((b - a) * width));
}

// An update handler's pass over a batch of k entries whose keys may repeat, its step packed over all rows in the
// batch's order of first occurrence (so that every shard packs alike): the keys in [0, num_rows) coalesced in parts
// (CoalescedParts); the step's keys written (out_keys, where given: each distinct key at its slot, then `pad`); its
// padding slots zeroed (k slots of `width` T at `out`, each part its share); and fn(c) for every part, on the pool,
// whose rows write their step rows at their slots (Coalesced::Slot). Returns the number of distinct rows.
template <typename T, typename F>
int64_t ForEachCoalescedPartInOrder(xla::ffi::ThreadPool& pool, const int32_t* keys, int64_t k, int64_t num_rows,
                                 int64_t threads, T* out, int64_t width, int32_t* out_keys, int32_t pad, F fn) {
  const CoalescedParts parts(pool, keys, k, num_rows, 0, threads);
  const int64_t size = parts.size();
  if (out_keys != nullptr) std::fill(out_keys + size, out_keys + k, pad);
  if (size == 0) ZeroPadding(out, width, 0, k, 0, 0);  // no part runs
  parts.ForEach(pool, [&](int64_t t, const Coalesced& c) {
    if (out_keys != nullptr) {
      for (int64_t d = 0; d < c.size; ++d) out_keys[c.Slot(d)] = c.row[d];
    }
    ZeroPadding(out, width, size, k, parts.offset(t), parts.offset(t) + c.size);
    fn(c);
  });
  return size;
}

// A handler's temporary floats: a buffer of at least n, reused by the next call on this thread where it is at
// most kKeep floats (16 MiB), else freed with this object. A fresh allocation of that size comes back from the
// system with pages that fault on first touch, which cost a pass over a large batch's rows about as much as the
// pass itself. One at a time per thread; the pool's threads may write through data().
class ScratchFloats {
 public:
  static constexpr size_t kKeep = size_t{1} << 22;

  explicit ScratchFloats(size_t n) {
    thread_local std::vector<float> kept;
    if (n > kKeep) {
      own_.reset(new float[n]);
      data_ = own_.get();
      return;
    }
    if (kept.size() < n) kept.resize(n);
    data_ = kept.data();
  }
  float* data() const { return data_; }

 private:
  std::unique_ptr<float[]> own_;
  float* data_ = nullptr;
};

// The distinct rows [lo, hi) of a coalesced batch: each one's entries summed into `sums` (the part's first row
// first) from 0, in entry order (SumEntries), and its sum of squares into its slot of `squares`. Cloned per ISA as
// the row loops are (a pool task's body is not inlined into them; built for the baseline x86-64, this loop moved 16
// bytes at a time). The arithmetic is the same on every ISA: no contraction, and RowSquares' lanes are fixed.
OSA_TARGET_CLONES inline void SumAndSquareRows(const Coalesced& c, int64_t k, const float* values, int64_t width,
                                               int64_t lo, int64_t hi, float* sums, double* squares) {
  std::memset(sums, 0, sizeof(float) * static_cast<size_t>((hi - lo) * width));
  SumEntries(c, k, values, width, lo, hi, sums);
  for (int64_t d = lo; d < hi; ++d) squares[d] = RowSquares(sums + (d - lo) * width, width);
}

// The entries [lo, hi) of a batch taken as distinct: each in-range one's sum of squares into its slot of
// `squares`. Cloned per ISA as SumAndSquareRows is.
OSA_TARGET_CLONES inline void SquareEntries(const int32_t* keys, const float* values, int64_t width, int64_t num_rows,
                                            int64_t lo, int64_t hi, double* squares) {
  for (int64_t i = lo; i < hi; ++i) {
    if (InRange(keys[i], num_rows)) squares[i] = RowSquares(values + i * width, width);
  }
}

// A batch whose keys may repeat coalesced in parts (CoalescedParts, the keys in [0, num_rows): a norm is the whole
// gradient's, every shard's), each part's rows summed into a buffer of the part's own on its thread, each with its
// sum of squares (SumAndSquareRows), and the squares of all added in the batch's order of first occurrence, as
// TotalSquares adds the one-thread coalescing's (bitwise): the norm behind the sum_squares handler and global-norm
// clipping in a handler (Clip::norm), whose row pass then reads the sums.
class SummedParts {
 public:
  SummedParts(xla::ffi::ThreadPool& pool, const int32_t* keys, int64_t k, const float* values, int64_t width,
              int64_t num_rows, int64_t threads)
      : sums_(static_cast<size_t>(CoalescingParts(k, threads))),
        squares_(sums_.size()),
        parts_(pool, keys, k, num_rows, 0, threads, [&](int64_t t, const Coalesced& c) {
          sums_[t].reset(new float[static_cast<size_t>(c.size * width)]);
          squares_[t].resize(static_cast<size_t>(c.size));
          SumAndSquareRows(c, k, values, width, 0, c.size, sums_[t].get(), squares_[t].data());
        }) {
    std::vector<double> in_order(static_cast<size_t>(parts_.size()));
    for (int64_t t = 0; t < parts_.parts(); ++t) {
      const Coalesced& c = parts_.part(t);
      for (int64_t d = 0; d < c.size; ++d) in_order[c.Slot(d)] = squares_[t][d];
    }
    total_ = TotalSquares(in_order);
  }

  const CoalescedParts& parts() const { return parts_; }
  float* sums(int64_t t) const { return sums_[t].get(); }  // part t's rows summed, c.size x width
  float squares() const { return total_; }                 // the sum of their squares

 private:
  std::vector<std::unique_ptr<float[]>> sums_;
  std::vector<std::vector<double>> squares_;
  CoalescedParts parts_;  // after the buffers its constructor fills
  float total_ = 0.0f;
};

// Global-norm clipping with the norm computed in the handler (Clip::norm), for a batch whose keys may repeat, on
// every thread: the batch summed in parts with its norm (SummedParts), then fn(c, sums, clip) for every part, on
// the pool, whose row pass reads the part's sums and clips them by that norm.
template <typename F>
void ForEachCoalescedPartNormClipped(xla::ffi::ThreadPool& pool, const int32_t* keys, int64_t k, const float* values,
                                     int64_t width, int64_t num_rows, int64_t threads, float max_norm, F fn) {
  const SummedParts summed(pool, keys, k, values, width, num_rows, threads);
  const Clip clip = ClipOfNorm(summed.squares(), max_norm);
  summed.parts().ForEach(pool, [&](int64_t t, const Coalesced& c) { fn(c, summed.sums(t), clip); });
}

// The sum of the squares of a batch whose keys are taken as distinct (the library made them so, or the user
// promised it), as the XLA side takes the norm of such a leaf: each entry its own row. Each in-range entry's row
// squared as RowSquares squares it, the rows' sums added in entry order (the order of first occurrence the
// coalescing kernels add them in, so keys that are distinct get their sum, bitwise), in double, rounded once.
// Nothing is summed or written: the row pass reads the entries.
inline float EntrySquares(xla::ffi::ThreadPool& pool, const int32_t* keys, int64_t k, const float* values,
                          int64_t width, int64_t num_rows, int64_t threads) {
  std::vector<double> squares(static_cast<size_t>(k), 0.0);
  // A thread is worth its scheduling past a few dozen rows.
  ParallelFor(pool, k, std::min<int64_t>(threads, k / 32 + 1),
              [&](int64_t lo, int64_t hi) { SquareEntries(keys, values, width, num_rows, lo, hi, squares.data()); });
  return TotalSquares(squares);  // a padding entry's 0.0 adds nothing: the total starts at +0 and never goes below
}

// ParallelFor over the entries [0, k) of a batch whose keys are distinct, in
// parts holding about equal numbers of the entries this shard owns rather than
// of entries: padding and other shards' keys cost nothing to skip, but split by
// entries they leave threads idle (a coalesced leaf holds its distinct keys in
// the leading slots and padding after them, three quarters of the slots of a
// Zipf batch, and an even split by entries gave one thread every row). Every
// entry, skipped ones too, falls in exactly one part: fn(lo, hi) runs over
// [lo, hi), the first part from 0 and the last to k.
template <typename F>
void ParallelForOwned(xla::ffi::ThreadPool& pool, const int32_t* keys, int64_t k, const Shard& shard,
                      int64_t threads, F fn) {
  std::vector<int32_t> owned;
  owned.reserve(static_cast<size_t>(k));
  for (int64_t i = 0; i < k; ++i) {
    if (shard.Owns(keys[i])) owned.push_back(static_cast<int32_t>(i));
  }
  const auto n = static_cast<int64_t>(owned.size());
  if (n == 0) {
    if (k > 0) fn(int64_t{0}, k);
    return;
  }
  // A thread is worth its scheduling past a few dozen rows.
  ParallelFor(pool, n, std::min<int64_t>(threads, n / 32 + 1),
              [&](int64_t lo, int64_t hi) {
                fn(lo == 0 ? int64_t{0} : int64_t{owned[lo]}, hi == n ? k : int64_t{owned[hi]});
              });
}

// The entries of a batch split over `parts` by key: part t gets, in entry
// order, the entries whose in-range key hashes to t, so that every row is
// written by one part only and its entries are taken in entry order.
// fn(entries, count) runs once per part with a non-empty list, on the pool.
template <typename F>
void ForEachKeyPart(xla::ffi::ThreadPool& pool, const int32_t* keys, int64_t k, const Shard& shard, int64_t parts,
                    F fn) {
  parts = std::max<int64_t>(1, std::min<int64_t>(parts, k / 256 + 1));  // a part is worth a thread past ~256 rows
  ParallelFor(pool, parts, parts, [&](int64_t lo, int64_t hi) {
    std::vector<int32_t> entries;
    for (int64_t part = lo; part < hi; ++part) {
      entries.clear();
      for (int64_t i = 0; i < k; ++i) {
        if (shard.Owns(keys[i]) && (parts == 1 || Mix(static_cast<uint32_t>(keys[i])) % parts == part))
          entries.push_back(static_cast<int32_t>(i));
      }
      if (!entries.empty()) fn(entries.data(), static_cast<int64_t>(entries.size()));
    }
  });
}

}  // namespace optax_sparse_adam

#endif  // OPTAX_SPARSE_ADAM_CSRC_ROWS_H_
