#pragma once
//! DistributedSampler<Order, Tail>: which samples each rank sees, epoch by epoch.
//!
//! Semantics (the same partition as PyTorch's torch.utils.data.DistributedSampler; with
//! len samples, R ranks, this rank r):
//!  1. The epoch's list: Shuffle → a permutation of 0..len-1 that depends only on
//!     (seed, epoch) — not on R or r — so all ranks agree on it; Sequential → 0..len-1.
//!  2. num_samples = size() = ceil(len / R); with DropLast and len % R != 0 it is
//!     ceil((len - R) / R) = floor(len / R). total_size() = num_samples · R.
//!  3. Pad: the list is extended to total_size by repeating it from its start, tiled as
//!     often as needed when total_size - len > len (len < R), i.e. element i of the padded
//!     list is list[i % len]. DropLast: the list is cut to total_size.
//!  4. Rank r takes list[r], list[r + R], list[r + 2R], ... (list[r : total_size : R]):
//!     the ranks are disjoint apart from the padding, together cover every index at least
//!     once (Pad) and all get the same number of samples, hence the same number of batches
//!     — nobody waits at a collective for a rank that ran out of data.
//!  5. len = 0 gives no samples on any rank.
//!
//! The permutation (documented so other implementations can reproduce it bit for bit):
//!  Fisher–Yates over a = [0, 1, ..., len-1]: for i = len-1 down to 1, j = bounded(i+1),
//!  swap(a[i], a[j]); the generator is SplitMix64 (seeding.hpp) started at state
//!  detail::sampler_key(seed, epoch); bounded(n) is Lemire's unbiased multiply-shift with
//!  rejection ("Fast random integer generation in an interval", 2019): x = next(),
//!  m = x·n (128-bit); if low64(m) < n, t = (2^64 - n) mod n and while low64(m) < t draw
//!  again; return high64(m). PyTorch shuffles with torch.randperm, so its orders differ
//!  from these; the partition rules above are the same.
//!
//! Resuming, mid-epoch too: position() counts this rank's samples already consumed this epoch
//! (advance() after each batch keeps it current); batches() starts there.
//!
//! Another number of ranks mid-epoch (repartition(), or a state saved by another number of
//! ranks): ranks that stepped together have consumed the first position()·R elements of
//! the epoch's padded list — a prefix of the list, `consumed()` elements of it. The rest
//! of the list, list[consumed() : len], is then partitioned over the new ranks by rules 2–4
//! (padded by repeating it from its own start, or cut), so no sample of the epoch is seen
//! twice or skipped (up to Pad's repeats and DropLast's cut, as in any epoch). Rank r's
//! k-th index is then list[base + (r + k·R) % (len − base)], base = consumed() at the change.
//!
//! The sampler is serializable (save/load, or state()/load_state()): epoch, position and seed, so one call
//! restores it — lockstep::add_training_state / restore_training_state put it in a
//! checkpoint beside the model's state. An epoch saved used up (position == size()) resumes
//! at the start of the next one. When the position is a multiple of the batch size the
//! batches are exactly the ones the uninterrupted run had left.
//!
//! \code
//!   lockstep::DistributedSampler sampler(train.size(), ctx, {.seed = 42});
//!   for (std::uint64_t epoch = 0; epoch < epochs; ++epoch) {
//!     sampler.set_epoch(epoch);
//!     for (auto batch : sampler.batches(64)) { train_step(batch); sampler.advance(batch.size()); }
//!   }
//! \endcode

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <numeric>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "lockstep/core/codec.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/data/seeding.hpp"

namespace lockstep {

// ---- policy tags: DistributedSampler<Order, Tail> ------------------------------------------
//! Order: a fresh pseudo-random permutation of the data set for each (seed, epoch).
struct Shuffle {};
//! Order: 0, 1, ..., len-1 (evaluation, debugging).
struct Sequential {};

//! Tail: when len is not divisible by the number of ranks, repeat indices from the start of
//! the epoch's list until every rank has ceil(len / ranks) samples (PyTorch's default).
struct Pad {};
//! Tail: drop the last len % ranks indices of the epoch's list, so every rank has
//! floor(len / ranks) samples (PyTorch's drop_last=True).
struct DropLast {};

//! Tuning values for DistributedSampler. `seed` must be the same on every rank.
struct SamplerOptions {
  std::uint64_t seed = 0;
};

//! Where a DistributedSampler stands: what a checkpoint keeps to resume it.
struct sampler_state {
  std::uint64_t seed = 0;
  std::uint64_t epoch = 0;
  std::uint64_t position = 0;      //!< samples of this rank consumed in `epoch`
  std::uint64_t dataset_size = 0;  //!< to refuse a resume over different data
  std::int64_t world = 1;          //!< the ranks `position` counts over
  std::uint64_t base = 0;          //!< elements of the epoch's list consumed before this partition
  bool operator==(const sampler_state&) const = default;
};

//! What batches() does with a last batch smaller than B.
enum class LastBatch {
  keep_partial,  //!< yield it (PyTorch DataLoader's drop_last=False)
  drop_partial,  //!< drop it: every batch has exactly B indices
};

namespace detail {

//! Anything that knows its rank and the number of ranks (a context, a communicator).
template <class G>
concept rank_group = requires(const G& g) {
  { g.rank() } -> std::convertible_to<int>;
  { g.size() } -> std::convertible_to<int>;
};

//! (a · b) as (high, low) 64-bit halves from 32-bit pieces: for compilers without a
//! 128-bit integer (MSVC); kept always compiled so the tests check it against the other.
constexpr std::pair<std::uint64_t, std::uint64_t> mul_64x64_portable(std::uint64_t a, std::uint64_t b) noexcept {
  const std::uint64_t a_lo = a & 0xffffffffULL, a_hi = a >> 32;
  const std::uint64_t b_lo = b & 0xffffffffULL, b_hi = b >> 32;
  const std::uint64_t ll = a_lo * b_lo, lh = a_lo * b_hi, hl = a_hi * b_lo, hh = a_hi * b_hi;
  const std::uint64_t mid = (ll >> 32) + (lh & 0xffffffffULL) + (hl & 0xffffffffULL);
  return {hh + (lh >> 32) + (hl >> 32) + (mid >> 32), (mid << 32) | (ll & 0xffffffffULL)};
}

//! (a · b) as (high, low) 64-bit halves, the same on every platform.
constexpr std::pair<std::uint64_t, std::uint64_t> mul_64x64(std::uint64_t a, std::uint64_t b) noexcept {
#if defined(__SIZEOF_INT128__)
  __extension__ using u128 = unsigned __int128;  // __extension__: quiet under -Wpedantic
  const u128 m = static_cast<u128>(a) * b;
  return {static_cast<std::uint64_t>(m >> 64), static_cast<std::uint64_t>(m)};
#else
  return mul_64x64_portable(a, b);
#endif
}

//! A uniform integer in [0, n), n >= 1, without modulo bias (Lemire 2019).
constexpr std::uint64_t bounded(SplitMix64& gen, std::uint64_t n) noexcept {
  auto m = mul_64x64(gen.next(), n);  // (high, low): high is the candidate
  if (m.second < n) {
    const std::uint64_t threshold = (0 - n) % n;  // 2^64 mod n: the biased low values
    while (m.second < threshold) m = mul_64x64(gen.next(), n);
  }
  return m.first;
}

//! The documented Fisher–Yates shuffle of [0, len) for (seed, epoch).
inline std::vector<std::size_t> permutation(std::size_t len, std::uint64_t seed, std::uint64_t epoch) {
  std::vector<std::size_t> a(len);
  std::iota(a.begin(), a.end(), std::size_t{0});
  SplitMix64 gen(sampler_key(seed, epoch));
  for (std::size_t i = len; i > 1; --i) {
    const auto j = static_cast<std::size_t>(bounded(gen, i));
    std::swap(a[i - 1], a[j]);
  }
  return a;
}

}  // namespace detail

//! Splits a data set of `len` samples across `world` ranks; see the top of this file.
//! Order: lockstep::Shuffle or lockstep::Sequential. Tail: lockstep::Pad or
//! lockstep::DropLast.
template <class Order = Shuffle, class Tail = Pad>
class DistributedSampler {
  static_assert(std::is_same_v<Order, Shuffle> || std::is_same_v<Order, Sequential>,
                "DistributedSampler<Order, Tail>: Order must be lockstep::Shuffle or "
                "lockstep::Sequential");
  static_assert(std::is_same_v<Tail, Pad> || std::is_same_v<Tail, DropLast>,
                "DistributedSampler<Order, Tail>: Tail must be lockstep::Pad or "
                "lockstep::DropLast");

 public:
  using order_type = Order;
  using tail_type = Tail;

  //! Rank `rank` of `world` ranks; every rank must pass the same len and opts.seed.
  DistributedSampler(std::size_t len, int rank, int world, SamplerOptions opts = {})
      : len_(len), rank_(rank), world_(world), seed_(opts.seed) {
    check_rank(rank, world, "DistributedSampler");
    fill();
  }

  //! Takes rank and world from a context or communicator (anything with rank(), size()).
  template <detail::rank_group G>
  DistributedSampler(std::size_t len, const G& group, SamplerOptions opts = {})
      : DistributedSampler(len, static_cast<int>(group.rank()), static_cast<int>(group.size()), opts) {}

  //! This rank's number of samples per epoch (PyTorch's num_samples); the same on all ranks.
  //! After a change of ranks mid-epoch: of the rest of the epoch.
  std::size_t size() const noexcept { return num_samples_; }
  //! size() · world(): the padded (Pad) or truncated (DropLast) length of the epoch's list.
  std::size_t total_size() const noexcept { return num_samples_ * static_cast<std::size_t>(world_); }
  std::size_t dataset_size() const noexcept { return len_; }
  int rank() const noexcept { return rank_; }
  int world() const noexcept { return world_; }
  std::uint64_t seed() const noexcept { return seed_; }

  //! This rank's indices for the current epoch, in the order they are to be used.
  const std::vector<std::size_t>& indices() const noexcept { return indices_; }

  std::uint64_t epoch() const noexcept { return epoch_; }
  //! Selects the epoch (and so, with Shuffle, the order) and resets position() to 0.
  void set_epoch(std::uint64_t epoch) {
    position_ = 0;
    if (epoch == epoch_ && base_ == 0) return;  // same (seed, epoch) → same indices
    epoch_ = epoch;
    base_ = 0;
    fill();
  }

  //! Elements of the epoch's list consumed by every rank together (position() on each, the
  //! same on all, as ranks that step together have), counting those consumed before the last
  //! change of ranks; at most dataset_size().
  std::size_t consumed() const noexcept { return consumed_by(base_, position_, world_, len_); }
  //! The rest of this epoch, from consumed(), partitioned over `world` ranks (this one
  //! `rank`); position() starts again at 0. Call it on every rank that goes on, at the same
  //! step (e.g. after ranks left or joined: every survivor at the same position). Later
  //! epochs are partitioned over `world` ranks from their start.
  void repartition(int rank, int world) {
    check_rank(rank, world, "DistributedSampler::repartition");
    base_ = consumed();
    rank_ = rank;
    world_ = world;
    position_ = 0;
    fill();
  }

  //! How many of this rank's samples were consumed this epoch (for checkpoints).
  std::size_t position() const noexcept { return position_; }
  //! Resume after `k` consumed samples of the current epoch; 0 <= k <= size().
  void set_position(std::size_t k) {
    if (k > num_samples_)
      throw config_error("DistributedSampler::set_position(" + std::to_string(k) + "): this rank has only " +
                         std::to_string(num_samples_) +
                         " samples per epoch; a checkpoint from a different data set size "
                         "or number of ranks cannot be resumed mid-epoch");
    position_ = k;
  }
  //! Marks `n` more samples consumed (call after each step to keep position() current).
  void advance(std::size_t n) { set_position(position_ + n); }

  //! Where the sampler stands (for checkpoints; the same on every rank but the position's
  //! meaning, which is per rank — and equal on every rank that steps in lockstep).
  sampler_state state() const noexcept { return {seed_, epoch_, position_, len_, world_, base_}; }
  //! Resumes a saved state: its seed and epoch, and its position — or, when the epoch was
  //! used up, the start of the next epoch. A state saved mid-epoch by another number of
  //! ranks resumes with the rest of that epoch partitioned over this job's ranks (as
  //! repartition() does). A state from another data set size is refused. Throws
  //! checkpoint_error; the sampler is unchanged then.
  void load_state(const sampler_state& st) {
    if (st.dataset_size != len_)
      throw checkpoint_error("DistributedSampler: the saved state is for a data set of " +
                             std::to_string(st.dataset_size) + " samples, this sampler has " + std::to_string(len_) +
                             "; resume over the same data");
    if (st.world < 1)
      throw checkpoint_error("DistributedSampler: the saved state names " + std::to_string(st.world) +
                             " ranks; the state is damaged");
    if (st.base > len_)
      throw checkpoint_error("DistributedSampler: the saved state consumed " + std::to_string(st.base) +
                             " samples before its partition, more than the data set's " + std::to_string(len_) +
                             "; the state is damaged");
    const std::uint64_t rest = len_ - st.base;
    const std::uint64_t saved_size = samples_per_rank(static_cast<std::size_t>(rest), static_cast<int>(st.world));
    std::uint64_t epoch = st.epoch, position = st.position, base = st.base;
    if (position > saved_size)
      throw checkpoint_error("DistributedSampler: the saved position " + std::to_string(position) +
                             " is past the epoch's " + std::to_string(saved_size) + " samples; the state is damaged");
    if (position == saved_size) {
      ++epoch;  // used up: the next epoch, from its start
      position = base = 0;
    } else if (st.world != world_) {  // the rest of the epoch over this job's ranks
      base = consumed_by(static_cast<std::size_t>(base), static_cast<std::size_t>(position), static_cast<int>(st.world),
                         len_);
      position = 0;
    }
    const bool refill = st.seed != seed_ || epoch != epoch_ || base != base_;
    seed_ = st.seed;
    epoch_ = epoch;
    base_ = static_cast<std::size_t>(base);
    position_ = static_cast<std::size_t>(position);
    if (refill) fill();
  }

  //! serializable: the state, for Checkpoint::add / restore.
  void save(byte_writer& w) const {
    const auto st = state();
    w.write(st.seed);
    w.write(st.epoch);
    w.write(st.position);
    w.write(st.dataset_size);
    // A partition that starts mid-epoch: the ranks negated, then the base (a reader older
    // than repartition() refuses the negative count rather than misreading the position).
    w.write(st.base == 0 ? st.world : -st.world);
    if (st.base != 0) w.write(st.base);
  }
  void load(byte_reader& r) {
    sampler_state st;
    st.seed = r.read<std::uint64_t>();
    st.epoch = r.read<std::uint64_t>();
    st.position = r.read<std::uint64_t>();
    st.dataset_size = r.read<std::uint64_t>();
    st.world = r.read<std::int64_t>();
    if (st.world < 0) {
      st.world = -st.world;
      st.base = r.read<std::uint64_t>();
    }
    load_state(st);
  }

  //! The rest of this epoch (from position()) cut into batches of `batch_size` indices.
  //! The spans point into indices(): they stay valid until set_epoch() with a new epoch
  //! or the sampler's destruction.
  std::vector<std::span<const std::size_t>> batches(std::size_t batch_size,
                                                    LastBatch last = LastBatch::keep_partial) const {
    if (batch_size == 0) throw config_error("DistributedSampler::batches: batch size is 0; pass at least 1");
    const std::span<const std::size_t> rest = std::span(indices_).subspan(position_);
    std::size_t n = rest.size() / batch_size;
    if (last == LastBatch::keep_partial && rest.size() % batch_size != 0) ++n;
    std::vector<std::span<const std::size_t>> out;
    out.reserve(n);
    for (std::size_t b = 0; b < n; ++b) {
      const std::size_t begin = b * batch_size;
      out.push_back(rest.subspan(begin, std::min(batch_size, rest.size() - begin)));
    }
    return out;
  }

 private:
  // Rule 2 above.
  static std::size_t samples_per_rank(std::size_t len, int world) {
    const auto r = static_cast<std::size_t>(world);
    if constexpr (std::is_same_v<Tail, DropLast>) return len / r;  // == ceil((len - R) / R) when len % R != 0
    else return len / r + (len % r != 0 ? 1 : 0);
  }

  // Elements of the epoch's list consumed: `base` before the partition, then `position` on
  // each of `world` ranks (the padded list's repeats count no further than its end).
  static std::size_t consumed_by(std::size_t base, std::size_t position, int world, std::size_t len) {
    return base + std::min(position * static_cast<std::size_t>(world), len - base);
  }

  static void check_rank(int rank, int world, const char* who) {
    if (world < 1)
      throw config_error(std::string(who) + ": world size is " + std::to_string(world) +
                         "; it must be at least 1 (the number of ranks)");
    if (rank < 0 || rank >= world)
      throw config_error(std::string(who) + ": rank " + std::to_string(rank) + " is outside [0, " +
                         std::to_string(world) + "); pass this process's rank and the number of ranks");
  }

  // Rank r's k-th index is list[base + (r + k·R) % (len − base)] (rules 3 and 4 above in one
  // formula, over the rest of the list from base; base is 0 but after a change of ranks).
  void fill() {
    const std::size_t rest = len_ - base_;
    num_samples_ = samples_per_rank(rest, world_);
    indices_.resize(num_samples_);
    if (num_samples_ == 0) return;
    const auto r = static_cast<std::size_t>(rank_), w = static_cast<std::size_t>(world_);
    if constexpr (std::is_same_v<Order, Shuffle>) {
      const std::vector<std::size_t> list = detail::permutation(len_, seed_, epoch_);
      for (std::size_t k = 0; k < num_samples_; ++k) indices_[k] = list[base_ + (r + k * w) % rest];
    } else {
      for (std::size_t k = 0; k < num_samples_; ++k) indices_[k] = base_ + (r + k * w) % rest;
    }
  }

  std::size_t len_;
  int rank_;
  int world_;
  std::uint64_t seed_;
  std::uint64_t epoch_ = 0;
  std::size_t base_ = 0;  // elements of the epoch's list consumed before this partition
  std::size_t num_samples_ = 0;
  std::size_t position_ = 0;
  std::vector<std::size_t> indices_;
};

//! This rank's micro-batches of one global batch, by global position: the batch is cut into
//! micro-batches of `micro` samples (micro-batch j = global_batch[j·micro, (j+1)·micro)) and
//! rank `rank` of `world` takes j = rank, rank + world, rank + 2·world, ... — one per
//! micro-step. A micro-batch holds the same samples however many ranks share the batch, which
//! lockstep::Deterministic needs for parameters that do not depend on the number of ranks
//! (docs/determinism.md). Walk the epoch with a sampler of one rank (every rank the same
//! list: `DistributedSampler(len, 0, 1)`) and split each of its batches here. The spans point
//! into global_batch.
inline std::vector<std::span<const std::size_t>> micro_batches(std::span<const std::size_t> global_batch,
                                                               std::size_t micro, int rank, int world) {
  if (world < 1 || rank < 0 || rank >= world)
    throw config_error("lockstep::micro_batches: rank " + std::to_string(rank) + " of " + std::to_string(world) +
                       " ranks; pass this rank and the number of ranks");
  const auto w = static_cast<std::size_t>(world);
  if (micro == 0 || global_batch.size() % (micro * w) != 0)
    throw config_error("lockstep::micro_batches: a batch of " + std::to_string(global_batch.size()) +
                       " samples does not split into micro-batches of " + std::to_string(micro) + " over " +
                       std::to_string(world) + " ranks; make the batch a multiple of micro-batch x ranks (" +
                       std::to_string(micro * w) + ")");
  std::vector<std::span<const std::size_t>> out;
  for (std::size_t j = static_cast<std::size_t>(rank); j * micro < global_batch.size(); j += w)
    out.push_back(global_batch.subspan(j * micro, micro));
  return out;
}

}  // namespace lockstep
