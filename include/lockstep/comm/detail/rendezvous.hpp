#pragma once
//! A reusable barrier for the ranks of one process, with a timeout on every wait and an
//! abort that releases every waiter at once when one rank fails.

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "lockstep/core/error.hpp"

namespace lockstep::detail {

class local_rendezvous {
 public:
  //! names: the job's rank number of each member, for messages (default: 0..n−1; a group
  //! split from the job's names its members as the job does).
  local_rendezvous(int n, std::chrono::milliseconds timeout, std::vector<int> names = {})
      : n_(n), timeout_(timeout), present_(static_cast<std::size_t>(n), false),
        left_(static_cast<std::size_t>(n), false), names_(std::move(names)) {
    if (names_.size() != static_cast<std::size_t>(n)) {
      names_.resize(static_cast<std::size_t>(n));
      for (int r = 0; r < n; ++r) names_[static_cast<std::size_t>(r)] = r;
    }
  }

  int size() const { return n_; }
  std::chrono::milliseconds timeout() const { return timeout_; }

  //! Blocks until every rank arrived (or throws timeout_error / aborted_error, or
  //! mismatch_error when a rank it waits for has left). `what` names the operation.
  void arrive_and_wait(int rank, const std::string& what) {
    std::unique_lock lk(m_);
    throw_if_aborted(rank);
    const std::size_t gen = generation_;
    present_[static_cast<std::size_t>(rank)] = true;
    if (++arrived_ == n_) {
      arrived_ = 0;
      std::fill(present_.begin(), present_.end(), false);
      ++generation_;
      cv_.notify_all();
      return;
    }
    int gone = -1;
    const bool done = cv_.wait_for(lk, timeout_, [&] {
      gone = departed_missing();
      return generation_ != gen || aborted_ || gone >= 0;
    });
    if (generation_ != gen) return;
    if (aborted_) throw_if_aborted(rank);
    if (gone >= 0) {
      // That rank will never come: fail now (and release the others) instead of at the timeout.
      const std::string msg = "rank " + name(gone) + " has left the training body; rank " + name(rank) +
                              " is waiting for it in " + what +
                              " — uneven inputs? Every rank must issue the same collectives; with "
                              "different numbers of batches per rank, use dp.join() (lockstep::Join)";
      abort_locked(msg);
      throw mismatch_error(msg);
    }
    (void)done;
    std::string missing;
    for (int r = 0; r < n_; ++r)
      if (!present_[static_cast<std::size_t>(r)]) missing += (missing.empty() ? "" : ", ") + name(r);
    std::string msg = "rank " + name(rank) + " waited " + std::to_string(timeout_.count() / 1000.0) + " s in " + what +
                      " for rank(s) " + missing +
                      " that never arrived (raise LOCKSTEP_TIMEOUT if they are only slow; "
                      "otherwise they hang or called a different collective)";
    abort_locked(msg);
    throw timeout_error(msg);
  }

  //! `rank` will not arrive again (its body returned): a rank that waits for it fails at once.
  void leave(int rank) {
    std::lock_guard lk(m_);
    left_[static_cast<std::size_t>(rank)] = true;
    cv_.notify_all();
  }

  //! Marks the group failed: every current and future wait throws aborted_error.
  void abort(const std::string& reason) {
    std::lock_guard lk(m_);
    abort_locked(reason);
  }
  bool aborted() const {
    std::lock_guard lk(m_);
    return aborted_;
  }

 private:
  void abort_locked(const std::string& reason) {
    if (!aborted_) {
      aborted_ = true;
      reason_ = reason;
    }
    cv_.notify_all();
  }
  // A rank that left and has not arrived in the current round, or -1.
  int departed_missing() const {
    for (int r = 0; r < n_; ++r)
      if (left_[static_cast<std::size_t>(r)] && !present_[static_cast<std::size_t>(r)]) return r;
    return -1;
  }
  void throw_if_aborted(int rank) const {
    if (aborted_)
      throw aborted_error("rank " + name(rank) + " stopped waiting because another rank failed: " + reason_, reason_);
  }

  std::string name(int r) const { return std::to_string(names_[static_cast<std::size_t>(r)]); }

  const int n_;
  const std::chrono::milliseconds timeout_;
  mutable std::mutex m_;
  std::condition_variable cv_;
  int arrived_ = 0;
  std::size_t generation_ = 0;
  std::vector<bool> present_;
  std::vector<bool> left_;
  bool aborted_ = false;
  std::string reason_;
  std::vector<int> names_;
};

}  // namespace lockstep::detail
