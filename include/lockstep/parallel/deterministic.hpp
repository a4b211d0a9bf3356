#pragma once
//! lockstep::Deterministic — gradients summed in fixed point, so that the averaged gradient of a
//! global batch has the same bits however the batch is split over ranks and micro-steps, whatever
//! the bucket sizes, threads or processes, and communicator (docs/determinism.md).
//!
//! Each micro-step's gradient (one forward/backward of a fixed micro-batch size) is converted to
//! int64 with one exponent per parameter (core/detail/fixed_point.hpp), summed as integers over
//! micro-steps (in an int64 copy of the arena) and over ranks (an int64 sum all-reduce or
//! reduce-scatter), and converted back once, divided by the number of micro-batches. On a GPU,
//! a rank with one micro-step a cycle sends its gradients as they are instead (an all-to-all),
//! and each rank converts, sums and converts back its block's contributions in one pass: the
//! same integers, an all-reduce's bytes in the gradients' type. Integer sums
//! are associative: no order of any kind reaches the result. A parameter's exponent for a step is
//! the largest exponent any of its micro-gradient values had in the step before, plus
//! `margin_bits`, agreed by one small max all-reduce at the end of each step (the first step uses
//! `initial_exponent`). A value beyond its range is clamped to it (counted, and the range grows
//! for the next step); a non-finite value makes the whole step's gradients non-finite (a
//! checking scaler then skips the step on every rank); both are reported by report().
//! \code
//!   lockstep::DataParallel dp(ctx, model, lockstep::Deterministic{});
//! \endcode

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "lockstep/comm/detail/host_collectives.hpp"
#include "lockstep/core/concepts.hpp"
#include "lockstep/core/detail/fixed_point.hpp"
#include "lockstep/core/dtype.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/core/grad_group.hpp"
#include "lockstep/core/reduce_op.hpp"

namespace lockstep {

struct DeterministicOptions {
  //! A parameter's range for a step: its largest micro-gradient of the step before, times
  //! 2^margin_bits. Larger: fewer clamped values after a jump, fewer bits for small values.
  int margin_bits = 8;
  //! The first step's range: |gradient| < 2^initial_exponent for every parameter (with a loss
  //! scale, of the scaled gradients).
  int initial_exponent = 16;
};

//! What the fixed-point sums met. Counts of one step are the largest of any one rank's count of
//! the values it converted — its own contributions, or on a GPU with one micro-step a cycle its
//! blocks' values from every rank (and its own of a bucket's few leftover elements) — so they
//! depend on how the elements were split over ranks and buckets. Nonzero whenever any value
//! met the condition; not a total over the job.
struct fixed_point_report {
  std::int64_t steps = 0;              //!< steps reduced
  std::int64_t clamped = 0;            //!< last step: values beyond their range, clamped to it
  std::int64_t nonfinite = 0;          //!< last step: inf/NaN values (the step's gradients made NaN)
  std::int64_t underflowed = 0;        //!< last step: nonzero values rounded to zero
  std::int64_t clamped_total = 0;      //!< over all steps
  std::int64_t nonfinite_total = 0;    //!< over all steps
  std::int64_t underflowed_total = 0;  //!< over all steps
};

namespace detail {

//! Arena elements [offset, offset + count) belong to parameter `slot` (its exponent's index).
struct fixed_run {
  std::size_t offset = 0, count = 0, slot = 0;
};

//! One rank's state (in the communicator's memory space): per gradient arena its int64 sums;
//! the exponents; this step's largest exponents and counts (the "tail", all-reduced with max at
//! the end of a step); the counts of the last step and of all steps.
struct fixed_state {
  struct arena {
    const void* base = nullptr;
    std::size_t count = 0;
    dtype type = dtype::f32;
    std::shared_ptr<void> sums;  // int64[count]; a one-micro-step cycle's all-to-all lands here (GPU)
    bool holds = false;          // the sums hold earlier micro-steps of this cycle
  };
  std::vector<arena> arenas;
  std::size_t params = 0;
  std::shared_ptr<void> exps;    // int64[params]
  std::shared_ptr<void> tail;    // int64[params + 3]: largest exponents, clamped, nonfinite, underflowed
  std::shared_ptr<void> counts;  // int64[6]: the last step's three counts, then their totals
  std::int64_t contributions = 1;
  std::vector<fixed_run> runs;  // the last fold's (the collective after it converts them back)
  bool deferred = false;        // the last fold converted nothing: its collective does (device)
  std::int64_t steps = 0;
  bool folded = false;                                            // the tail holds folds of a step not ended yet
  std::function<void(void*, const void*, std::size_t)> download;  // for report()

  arena& find(const void* p, const char* who) {
    for (auto& a : arenas) {
      const auto* b = static_cast<const char*>(a.base);
      if (p >= b && static_cast<const char*>(p) < b + a.count * size_of(a.type)) return a;
    }
    throw config_error(std::string("lockstep::Deterministic::") + who +
                       ": the buffer is not one of DataParallel's gradient arenas (the hook sums whole "
                       "arenas: use it as DataParallel's bucket hook only)");
  }
  std::int64_t* sums_of(arena& a, const void* p) const {
    return static_cast<std::int64_t*>(a.sums.get()) + (static_cast<const char*>(p) - static_cast<const char*>(a.base)) /
                                                          static_cast<std::ptrdiff_t>(size_of(a.type));
  }
};

//! The host side of the sums (host communicators): loops over the runs.
template <class T>
void host_fold(fixed_state& st, T* src, std::int64_t* sums, bool overwrite, bool zero_source) {
  const auto* exps = static_cast<const std::int64_t*>(st.exps.get());
  auto* tail = static_cast<std::int64_t*>(st.tail.get());
  const int f = fixed::frac_bits(st.contributions);
  std::int64_t clamped = 0, nonfinite = 0, under = 0;
  for (const auto& r : st.runs) {
    const int e = static_cast<int>(exps[r.slot]);
    std::int64_t largest = tail[r.slot];
    for (std::size_t i = r.offset; i < r.offset + r.count; ++i) {
      const double x = static_cast<double>(src[i]);
      fixed::fold_flags fl;
      const std::int64_t q = fixed::to_fixed(x, e, f, fl);
      // wrapping addition (unsigned): the sum mod 2^64 is exact whenever the total fits
      sums[i] = overwrite
                    ? q
                    : static_cast<std::int64_t>(static_cast<std::uint64_t>(sums[i]) + static_cast<std::uint64_t>(q));
      if (!fl.nonfinite && x != 0.0) largest = std::max<std::int64_t>(largest, fixed::exponent_of(x));
      clamped += fl.clamped;
      nonfinite += fl.nonfinite;
      under += fl.underflow;
      if (zero_source) src[i] = T(0);
    }
    tail[r.slot] = largest;
  }
  tail[st.params] += clamped;
  tail[st.params + 1] += nonfinite;
  tail[st.params + 2] += under;
}

template <class T>
void host_unfold(const fixed_state& st, const std::int64_t* sums, T* dst, std::size_t lo, std::size_t hi) {
  const auto* exps = static_cast<const std::int64_t*>(st.exps.get());
  const int f = fixed::frac_bits(st.contributions);
  for (const auto& r : st.runs) {
    const std::size_t b = std::max(lo, r.offset), e = std::min(hi, r.offset + r.count);
    for (std::size_t i = b; i < e; ++i)
      dst[i] = static_cast<T>(fixed::from_fixed(sums[i], static_cast<int>(exps[r.slot]), f, st.contributions));
  }
}

//! The tail as no fold left it (largest exponents none, counts 0), on the host.
inline void host_reset_tail(fixed_state& st) {
  auto* tail = static_cast<std::int64_t*>(st.tail.get());
  for (std::size_t p = 0; p < st.params; ++p) tail[p] = fixed::no_exponent;
  for (int k = 0; k < 3; ++k) tail[st.params + k] = 0;
}

//! The end of a step's sums, on the host: the tail agreed (max), the next exponents, the counts;
//! every gradient group made non-finite when any value was.
template <class Comm>
void host_end_step(Comm& comm, fixed_state& st, std::span<const grad_group> groups, int margin) {
  auto* tail = static_cast<std::int64_t*>(st.tail.get());
  auto* exps = static_cast<std::int64_t*>(st.exps.get());
  auto* counts = static_cast<std::int64_t*>(st.counts.get());
  if (comm.size() > 1) host_all_reduce(comm, std::span<std::int64_t>(tail, st.params + 3), reduce_op::max);
  for (std::size_t p = 0; p < st.params; ++p) {
    exps[p] = fixed::next_exponent(tail[p], exps[p], margin);
    tail[p] = fixed::no_exponent;
  }
  for (int k = 0; k < 3; ++k) {
    counts[k] = tail[st.params + k];
    counts[3 + k] += counts[k];
    tail[st.params + k] = 0;
  }
  if (counts[1] == 0) return;
  for (const auto& g : groups)
    for (const auto& s : g.segments) {
      if (s.count == 0) continue;
      if (g.type == dtype::f32) *static_cast<float*>(s.ptr) = std::numeric_limits<float>::quiet_NaN();
      else *static_cast<double*>(s.ptr) = std::numeric_limits<double>::quiet_NaN();
      break;
    }
}

template <class Comm>
inline constexpr bool device_communicator = requires(Comm& c) { c.comm_stream(); };

}  // namespace detail

class Deterministic {
 public:
  Deterministic() = default;
  explicit Deterministic(DeterministicOptions o) : opts_(o) {
    if (o.margin_bits < 0 || o.margin_bits > 60)
      throw config_error("DeterministicOptions::margin_bits must be in [0, 60], got " + std::to_string(o.margin_bits));
    if (o.initial_exponent < detail::fixed::min_exponent || o.initial_exponent > detail::fixed::max_exponent)
      throw config_error("DeterministicOptions::initial_exponent must be in [-300, 300], got " +
                         std::to_string(o.initial_exponent));
  }
  //! A copy takes the options, not the sums: every rank's DataParallel keeps its own.
  Deterministic(const Deterministic& o) : opts_(o.opts_) {}
  Deterministic& operator=(const Deterministic& o) {
    if (this != &o) {
      opts_ = o.opts_;
      st_.reset();
    }
    return *this;
  }
  const DeterministicOptions& options() const noexcept { return opts_; }

  // ---- bucket_hook: the sums of the bucket over ranks, converted back into it ----------

  //! data (a range of a gradient arena, folded by fold()) ← the mean over every micro-batch.
  template <communicator Comm>
  auto reduce(Comm& comm, void* data, std::size_t count, dtype t) {
    auto& st = state("reduce");
    auto& a = st.find(data, "reduce");
    std::int64_t* sums = st.sums_of(a, data);
    if constexpr (detail::device_communicator<Comm>) {
      static_assert(
          requires { fixed_point_all_reduce(comm, st, a, sums, count); },
          "lockstep::Deterministic on a device communicator: include lockstep/cuda.cuh (its kernels)");
      return fixed_point_all_reduce(comm, st, a, sums, count);
    } else {
      // The int64 sums reduce-scattered, each rank's block converted back, the gradients
      // all-gathered (f32: 1.5x an f32 all-reduce's bytes, not 2x); the rest all-reduced.
      check_type(t);
      const auto lo = static_cast<std::size_t>(sums - static_cast<std::int64_t*>(a.sums.get()));
      const auto n = static_cast<std::size_t>(comm.size()), me = static_cast<std::size_t>(comm.rank());
      const std::size_t per = n > 1 ? count / n : 0, split = per * n;
      if (per > 0) {
        comm.reduce_scatter(sums, sums + me * per, per, dtype::i64, reduce_op::sum).wait();
        unfold_host(st, a, lo + me * per, lo + (me + 1) * per);
        comm.all_gather(static_cast<char*>(data) + me * per * size_of(t), data, per, t).wait();
      }
      if (n > 1 && split < count)
        comm.all_reduce(sums + split, sums + split, count - split, dtype::i64, reduce_op::sum).wait();
      unfold_host(st, a, lo + split, lo + count);
      return decltype(comm.all_reduce(data, data, count, t, reduce_op::sum)){};
    }
  }

  //! Block rank() of data (size()·per elements of an arena) ← the mean over every micro-batch.
  template <communicator Comm>
  auto reduce_scatter(Comm& comm, void* data, void* mine, std::size_t per, dtype t) {
    auto& st = state("reduce_scatter");
    auto& a = st.find(data, "reduce_scatter");
    std::int64_t* sums = st.sums_of(a, data);
    std::int64_t* my_sums = sums + static_cast<std::size_t>(comm.rank()) * per;
    if constexpr (detail::device_communicator<Comm>) {
      static_assert(
          requires { fixed_point_reduce_scatter(comm, st, a, sums, my_sums, per); },
          "lockstep::Deterministic on a device communicator: include lockstep/cuda.cuh (its kernels)");
      (void)mine;
      return fixed_point_reduce_scatter(comm, st, a, sums, my_sums, per);
    } else {
      check_type(t);
      (void)mine;
      if (comm.size() > 1) comm.reduce_scatter(sums, my_sums, per, dtype::i64, reduce_op::sum).wait();
      const auto lo = static_cast<std::size_t>(my_sums - static_cast<std::int64_t*>(a.sums.get()));
      unfold_host(st, a, lo, lo + per);
      return decltype(comm.reduce_scatter(data, mine, per, t, reduce_op::sum)){};
    }
  }

  // ---- what DataParallel calls (detail::fixed_point_hook) ----------------------------------

  //! The gradient arenas (base, elements, type) of a new layout, and the number of parameters.
  template <communicator Comm>
  void attach(Comm& comm, std::span<void* const> bases, std::span<const std::size_t> counts,
              std::span<const dtype> types, std::size_t params) {
    auto mem = comm.memory();
    auto old = std::move(st_);
    st_ = std::make_unique<detail::fixed_state>();
    auto& st = *st_;
    for (std::size_t k = 0; k < bases.size(); ++k) {
      check_type(types[k]);
      detail::fixed_state::arena a{bases[k], counts[k], types[k], mem.allocate(counts[k] * 8), false};
      mem.zero(a.sums.get(), counts[k] * 8);
      st.arenas.push_back(std::move(a));
    }
    st.params = params;
    std::vector<std::int64_t> tail(params + 3, 0);
    for (std::size_t p = 0; p < params; ++p) tail[p] = detail::fixed::no_exponent;
    st.tail = upload(mem, tail);
    if (old && old->params == params) {  // a rebuilt layout keeps the exponents and counts
      st.exps = std::move(old->exps);
      st.counts = std::move(old->counts);
      st.steps = old->steps;
    } else {
      st.exps = upload(mem, std::vector<std::int64_t>(params, opts_.initial_exponent));
      st.counts = upload(mem, std::vector<std::int64_t>(6, 0));
    }
    st.download = [mem](void* dst, const void* src, std::size_t bytes) { mem.download(dst, src, bytes); };
  }

  //! An accumulation cycle begins: the next fold of each arena starts its sums afresh. What
  //! folds of a cycle cut short (an exception before its end) left in the tail is dropped, so
  //! that it changes neither the next exponents nor the counts.
  template <communicator Comm>
  void begin_cycle(Comm& comm) {
    if (!st_) return;
    for (auto& a : st_->arenas) a.holds = false;
    if (!std::exchange(st_->folded, false)) return;
    if constexpr (detail::device_communicator<Comm>) fixed_point_reset_tail(comm, *st_);
    else detail::host_reset_tail(*st_);
  }

  //! Converts runs of the arena at `base` (its elements [offset, offset + count) of each run,
  //! one micro-step's gradients) into its int64 sums; contributions: the micro-batches the
  //! cycle's mean is over (over all ranks). zero_source: the micro-step does not synchronise —
  //! every run of the arena is given, and its gradients are zeroed for the next micro-step.
  template <communicator Comm>
  void fold(Comm& comm, void* base, std::span<const detail::fixed_run> runs, std::int64_t contributions,
            bool zero_source) {
    auto& st = state("fold");
    if (contributions < 1 || contributions > (std::int64_t{1} << detail::fixed::max_headroom))
      throw config_error("lockstep::Deterministic: a step's mean over " + std::to_string(contributions) +
                         " micro-batches is out of range (1 to 2^30)");
    auto& a = st.find(base, "fold");
    st.contributions = contributions;
    st.runs.assign(runs.begin(), runs.end());
    auto* sums = static_cast<std::int64_t*>(a.sums.get());
    if constexpr (detail::device_communicator<Comm>) {
      static_assert(
          requires { fixed_point_fold(comm, st, a, zero_source); },
          "lockstep::Deterministic on a device communicator: include lockstep/cuda.cuh (its kernels)");
      // This rank's only micro-step of the cycle: its gradients are its one contribution, so
      // the conversion waits for the collective, which sends them as they are and converts
      // every rank's contribution to a block in one pass (cuda/deterministic_sum.cuh).
      st.deferred = !zero_source && !a.holds;
      if (!st.deferred) fixed_point_fold(comm, st, a, zero_source);
    } else {
      (void)comm;
      if (a.type == dtype::f32) detail::host_fold(st, static_cast<float*>(base), sums, !a.holds, zero_source);
      else detail::host_fold(st, static_cast<double*>(base), sums, !a.holds, zero_source);
    }
    if (zero_source) a.holds = true;
    st.folded = true;
  }

  //! After every unit of a step was reduced: the exponents of the next step agreed, the counts
  //! taken; with a non-finite value anywhere, the first element of each group made NaN.
  template <communicator Comm>
  void end_step(Comm& comm, std::span<const grad_group> groups) {
    auto& st = state("end_step");
    ++st.steps;
    if constexpr (detail::device_communicator<Comm>) fixed_point_end_step(comm, st, groups, opts_.margin_bits);
    else detail::host_end_step(comm, st, groups, opts_.margin_bits);
    st.folded = false;  // (after the collective: one that throws leaves the tail to begin_cycle)
  }

  //! What the sums met so far (on a GPU: waits for the device).
  fixed_point_report report() const {
    fixed_point_report r;
    if (!st_) return r;
    std::int64_t c[6];
    st_->download(c, st_->counts.get(), sizeof c);
    r.steps = st_->steps;
    r.clamped = c[0];
    r.nonfinite = c[1];
    r.underflowed = c[2];
    r.clamped_total = c[3];
    r.nonfinite_total = c[4];
    r.underflowed_total = c[5];
    return r;
  }

  //! The exponents the next step uses, one per parameter (for checkpoints: a resumed run needs
  //! them to reduce as the uninterrupted one would).
  std::vector<std::int64_t> exponents() const {
    if (!st_) return {};
    std::vector<std::int64_t> e(st_->params);
    st_->download(e.data(), st_->exps.get(), e.size() * 8);
    return e;
  }
  //! Restores exponents() saved by a run of the same model (same on every rank).
  template <communicator Comm>
  void load_exponents(Comm& comm, std::span<const std::int64_t> e) {
    auto& st = state("load_exponents");
    if (e.size() != st.params)
      throw checkpoint_error("lockstep::Deterministic: the saved exponents are for " + std::to_string(e.size()) +
                             " parameters, this model has " + std::to_string(st.params));
    for (auto x : e)
      if (x < detail::fixed::min_exponent || x > detail::fixed::max_exponent)
        throw checkpoint_error("lockstep::Deterministic: a saved exponent (" + std::to_string(x) + ") is out of range");
    comm.memory().upload(st.exps.get(), e.data(), e.size() * 8);
  }

 private:
  static void check_type(dtype t) {
    if (t != dtype::f32 && t != dtype::f64)
      throw config_error(std::string("lockstep::Deterministic sums f32 and f64 gradients; this model has ") +
                         name_of(t) +
                         " gradients (keep fp32 gradients for fp16/bf16 parameters, e.g. "
                         "FullySharded{.param_dtype} or autocast)");
  }
  detail::fixed_state& state(const char* who) {
    if (!st_)
      throw config_error(std::string("lockstep::Deterministic::") + who +
                         " before DataParallel attached its arenas: use it as DataParallel's bucket hook");
    return *st_;
  }
  // Sums [lo, hi) of arena a back into its gradients.
  static void unfold_host(detail::fixed_state& st, detail::fixed_state::arena& a, std::size_t lo, std::size_t hi) {
    const auto* sums = static_cast<const std::int64_t*>(a.sums.get());
    if (a.type == dtype::f32) detail::host_unfold(st, sums, static_cast<float*>(const_cast<void*>(a.base)), lo, hi);
    else detail::host_unfold(st, sums, static_cast<double*>(const_cast<void*>(a.base)), lo, hi);
  }
  template <class Memory>
  static std::shared_ptr<void> upload(Memory& mem, const std::vector<std::int64_t>& v) {
    auto p = mem.allocate(v.size() * 8);
    mem.upload(p.get(), v.data(), v.size() * 8);
    return p;
  }

  DeterministicOptions opts_{};
  std::unique_ptr<detail::fixed_state> st_;
};

namespace detail {
//! A bucket hook that sums in fixed point (DataParallel then folds every micro-step into it).
template <class H>
inline constexpr bool fixed_point_hook_v = std::is_same_v<H, Deterministic>;
}  // namespace detail

}  // namespace lockstep
