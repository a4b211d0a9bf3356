#pragma once
//! A reusable barrier for the ranks of one process, with a timeout on every wait and an
//! abort that releases every waiter at once when one rank fails.

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <mutex>
#include <string>
#include <vector>

#include "lockstep/core/error.hpp"

namespace lockstep::detail {

class local_rendezvous {
 public:
  local_rendezvous(int n, std::chrono::milliseconds timeout)
      : n_(n), timeout_(timeout), present_(static_cast<std::size_t>(n), false) {}

  int size() const { return n_; }
  std::chrono::milliseconds timeout() const { return timeout_; }

  //! Blocks until every rank arrived (or throws timeout_error / aborted_error).
  //! `what` names the operation for the messages.
  void arrive_and_wait(int rank, const char* what) {
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
    const bool done = cv_.wait_for(lk, timeout_, [&] { return generation_ != gen || aborted_; });
    if (generation_ != gen) return;
    if (aborted_) throw_if_aborted(rank);
    (void)done;
    std::string missing;
    for (int r = 0; r < n_; ++r)
      if (!present_[static_cast<std::size_t>(r)]) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
    std::string msg = "rank " + std::to_string(rank) + " waited " +
                      std::to_string(timeout_.count() / 1000.0) + " s in " + what +
                      " for rank(s) " + missing +
                      " that never arrived (raise LOCKSTEP_TIMEOUT if they are only slow; "
                      "otherwise they hang or called a different collective)";
    abort_locked(msg);
    throw timeout_error(msg);
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
  void throw_if_aborted(int rank) const {
    if (aborted_)
      throw aborted_error("rank " + std::to_string(rank) +
                          " stopped waiting because another rank failed: " + reason_);
  }

  const int n_;
  const std::chrono::milliseconds timeout_;
  mutable std::mutex m_;
  std::condition_variable cv_;
  int arrived_ = 0;
  std::size_t generation_ = 0;
  std::vector<bool> present_;
  bool aborted_ = false;
  std::string reason_;
};

}  // namespace lockstep::detail
