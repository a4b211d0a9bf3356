#pragma once
//! Metrics across ranks: all-reduced scalars, global accuracy, throughput and scaling
//! efficiency, and logging from rank 0 only.
//!
//! The functions taking a communicator are collectives: every rank calls them, in the same
//! order relative to its other collectives. Values are staged through comm.memory(), since a
//! communicator's buffers may be device memory.

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <iostream>
#include <limits>
#include <ostream>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "lockstep/comm/detail/host_collectives.hpp"
#include "lockstep/core/concepts.hpp"
#include "lockstep/core/dtype.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/core/reduce_op.hpp"

namespace lockstep {

//! All-reduces `values` in place with `op`: afterwards every rank holds the same result.
//! T is any element type the communicator reduces (double, float, int64, int32...).
template <communicator C, element T>
void all_reduce_scalars(C& comm, std::span<T> values, reduce_op op) {
  detail::host_all_reduce(comm, values, op);
}

//! The mean of one value over all ranks (summed in double, then divided by the rank count).
template <communicator C>
double mean_across_ranks(C& comm, double value) {
  all_reduce_scalars(comm, std::span<double>(&value, 1), reduce_op::sum);
  return value / static_cast<double>(comm.size());
}

//! Correct predictions out of evaluated samples, on one rank or (all-reduced) on all.
struct eval_counts {
  std::int64_t correct = 0;
  std::int64_t total = 0;

  //! correct / total; NaN when nothing was evaluated (an empty evaluation is not 0%).
  double accuracy() const noexcept {
    return total == 0 ? std::numeric_limits<double>::quiet_NaN()
                      : static_cast<double>(correct) / static_cast<double>(total);
  }
  eval_counts& operator+=(const eval_counts& o) noexcept {
    correct += o.correct;
    total += o.total;
    return *this;
  }
  bool operator==(const eval_counts&) const = default;
};

//! The counts summed over all ranks (exact: int64, not floating point).
template <communicator C>
eval_counts all_reduce_counts(C& comm, eval_counts local) {
  std::int64_t v[2] = {local.correct, local.total};
  all_reduce_scalars(comm, std::span<std::int64_t>(v), reduce_op::sum);
  return {v[0], v[1]};
}

//! The accuracy over every rank's samples (not the mean of per-rank accuracies, which
//! weighs ranks with fewer samples too much).
template <communicator C>
double global_accuracy(C& comm, eval_counts local) {
  return all_reduce_counts(comm, local).accuracy();
}

//! Samples per second, timed with steady_clock: either start()/stop(samples) around the
//! work, or add(samples, seconds) with times measured elsewhere (e.g. device events).
class ThroughputMeter {
 public:
  using clock = std::chrono::steady_clock;

  void start() {
    if (running_) throw config_error("ThroughputMeter::start: already started; call stop(samples) first");
    running_ = true;
    t0_ = clock::now();
  }
  //! Ends the interval begun by start(), counting `samples` processed in it.
  void stop(std::int64_t samples) {
    const auto t1 = clock::now();
    if (!running_) throw config_error("ThroughputMeter::stop: not started; call start() first");
    running_ = false;
    add(samples, std::chrono::duration<double>(t1 - t0_).count());
  }
  void add(std::int64_t samples, double seconds) {
    if (samples < 0 || !(seconds >= 0.0) || !std::isfinite(seconds))
      throw config_error("ThroughputMeter::add: samples and seconds must be >= 0 and finite, got " +
                         std::to_string(samples) + " samples in " + std::to_string(seconds) + " s");
    samples_ += samples;
    seconds_ += seconds;
  }
  void reset() noexcept {
    samples_ = 0;
    seconds_ = 0.0;
    running_ = false;
  }

  std::int64_t samples() const noexcept { return samples_; }
  double seconds() const noexcept { return seconds_; }
  bool running() const noexcept { return running_; }

  //! This rank's rate; 0 before any time was counted.
  double samples_per_s() const noexcept { return seconds_ > 0.0 ? static_cast<double>(samples_) / seconds_ : 0.0; }
  //! The job's rate estimated from this rank alone: per-rank rate × ranks (ranks in step
  //! process equal batches in equal time). No communication.
  double total_samples_per_s(int ranks) const noexcept { return samples_per_s() * static_cast<double>(ranks); }
  //! The job's rate measured (collective): samples summed over ranks divided by the longest
  //! rank's time, since the job is only as fast as its slowest rank. 0 if no time was counted.
  template <communicator C>
  double global_samples_per_s(C& comm) const {
    double s = static_cast<double>(samples_), t = seconds_;
    all_reduce_scalars(comm, std::span<double>(&s, 1), reduce_op::sum);
    all_reduce_scalars(comm, std::span<double>(&t, 1), reduce_op::max);
    return t > 0.0 ? s / t : 0.0;
  }

 private:
  std::int64_t samples_ = 0;
  double seconds_ = 0.0;
  bool running_ = false;
  clock::time_point t0_{};
};

//! Which rank was slowest in the last accumulation cycle, by the host time its model took
//! (sync_stats::model_seconds): a straggler slows every rank, since each waits for it in the
//! gradient collectives, and shows here as a ratio well above 1.
struct straggler_report {
  int slowest_rank = 0;
  double slowest_seconds = 0;
  double median_seconds = 0;  //!< over all ranks (the lower middle one for an even count)
  double ratio() const noexcept { return median_seconds > 0 ? slowest_seconds / median_seconds : 1.0; }
};

//! Collective (one all-gather of a double): every rank gets the same report. dp: a DataParallel.
template <class DP>
straggler_report stragglers(DP& dp) {
  auto& comm = dp.comm();
  const double mine = dp.stats().model_seconds;
  std::vector<double> all(static_cast<std::size_t>(comm.size()));
  auto mem = comm.memory();
  auto send = mem.allocate(sizeof(double)), recv = mem.allocate(sizeof(double) * all.size());
  mem.upload(send.get(), &mine, sizeof(double));
  comm.all_gather(send.get(), recv.get(), 1, dtype::f64).wait();
  mem.download(all.data(), recv.get(), sizeof(double) * all.size());
  straggler_report r;
  r.slowest_rank = static_cast<int>(std::max_element(all.begin(), all.end()) - all.begin());
  r.slowest_seconds = all[static_cast<std::size_t>(r.slowest_rank)];
  std::vector<double> sorted = all;
  std::sort(sorted.begin(), sorted.end());
  r.median_seconds = sorted[(sorted.size() - 1) / 2];
  return r;
}

//! How much of n ranks' ideal speed-up a run achieves: total / (n · one_rank), 1.0 = perfect.
//! Both rates are whole-job samples per second (one rank alone; n ranks together).
inline double scaling_efficiency(double one_rank_samples_per_s, double n_rank_total_samples_per_s, int n) {
  if (n < 1) throw config_error("scaling_efficiency: n must be >= 1, got " + std::to_string(n));
  if (!(one_rank_samples_per_s > 0.0) || !std::isfinite(one_rank_samples_per_s))
    throw config_error("scaling_efficiency: the one-rank rate must be finite and > 0, got " +
                       std::to_string(one_rank_samples_per_s));
  return n_rank_total_samples_per_s / (static_cast<double>(n) * one_rank_samples_per_s);
}

//! "epoch 3 | step 120/469 | loss 0.432100 | 12345.6 samples/s"
inline std::string progress_line(int epoch, std::int64_t step, std::int64_t steps, double loss, double samples_per_s) {
  char buf[160];
  std::snprintf(buf, sizeof buf, "epoch %d | step %lld/%lld | loss %.6f | %.1f samples/s", epoch,
                static_cast<long long>(step), static_cast<long long>(steps), loss, samples_per_s);
  return buf;
}

//! Writes only on rank 0, so N ranks print one log. Not thread-safe: one logger per rank.
class Rank0Logger {
 public:
  explicit Rank0Logger(int rank, std::ostream& out = std::cout) : out_(&out), rank_(rank) {}
  template <communicator C>
  explicit Rank0Logger(const C& comm, std::ostream& out = std::cout) : Rank0Logger(comm.rank(), out) {}

  bool active() const noexcept { return rank_ == 0; }

  //! One line: the arguments streamed with operator<<, then '\n'. Ends an open progress line.
  template <class... Args>
  void log(const Args&... args) {
    if (!active()) return;
    end_progress();
    ((*out_) << ... << args) << '\n';
    out_->flush();
  }
  template <class... Args>
  void operator()(const Args&... args) {
    log(args...);
  }

  //! A progress line. overwrite: returns to the start of the line ('\r') and rewrites it,
  //! padding with spaces over a longer previous one (for a terminal); otherwise one line each
  //! (for a log file).
  void progress(std::string_view line, bool overwrite = true) {
    if (!active()) return;
    if (!overwrite) {
      log(line);
      return;
    }
    *out_ << '\r' << line;
    if (line.size() < open_) *out_ << std::string(open_ - line.size(), ' ');
    open_ = line.size() == 0 ? 1 : line.size();  // a line is open, even if empty
    out_->flush();
  }
  //! Finishes an open progress line with '\n' (no-op if none is open).
  void end_progress() {
    if (!active() || open_ == 0) return;
    *out_ << '\n';
    open_ = 0;
  }

 private:
  std::ostream* out_;
  int rank_;
  std::size_t open_ = 0;  // length of the open '\r' line, 0 when none
};

//! One line on rank 0 only: log0(rank, "epoch ", e, " loss ", l). To std::cout, or to `out`.
template <class... Args>
void log0(int rank, const Args&... args) {
  Rank0Logger(rank).log(args...);
}
template <class... Args>
void log0(std::ostream& out, int rank, const Args&... args) {
  Rank0Logger(rank, out).log(args...);
}

}  // namespace lockstep
