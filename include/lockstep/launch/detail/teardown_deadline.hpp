#pragma once
//! How long a process may take to tear down after a failure (run(Processes)): aborting its
//! communicators, joining its watchdog, destroying the communicator and freeing memory can
//! each wait for GPU work that waits for a dead peer — measured with NCCL 2.28 after kill -9
//! of a peer during CUDA graph replays: the survivor named the failure within a second, then
//! never ended — and by then the watchdog, whose grace period ends a stuck process, has been
//! stopped. arm() on a failure starts the clock; the destructor (after the communicator's)
//! stops it. Past LOCKSTEP_ABORT_GRACE (default 2 s, at least 1 s here) the process prints why
//! and exits with status 1: a survivor must never outlive the job.

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

#include "lockstep/core/detail/env.hpp"

namespace lockstep::detail {

class teardown_deadline {
 public:
  teardown_deadline() = default;
  teardown_deadline(const teardown_deadline&) = delete;
  teardown_deadline& operator=(const teardown_deadline&) = delete;
  ~teardown_deadline() {
    {
      std::lock_guard lk(m_);
      done_ = true;
    }
    cv_.notify_all();
    if (clock_.joinable()) clock_.join();
  }

  //! From now on the teardown has LOCKSTEP_ABORT_GRACE; `why` is the failure, for the message.
  //! Once; never throws (without a thread there is no deadline).
  void arm(int rank, std::string why) noexcept {
    try {
      std::lock_guard lk(m_);
      if (clock_.joinable() || done_) return;
      const auto grace = std::max(abort_grace(), std::chrono::milliseconds(1000));
      clock_ = std::thread([this, rank, grace, why = std::move(why)] {
        std::unique_lock lk(m_);
        if (cv_.wait_for(lk, grace, [&] { return done_; })) return;
        std::fprintf(stderr,
                     "lockstep: rank %d exits: %s (its teardown after the failure did not end within %lld ms, "
                     "LOCKSTEP_ABORT_GRACE: ncclCommAbort or a free still waits for GPU work that waits for a "
                     "dead peer)\n",
                     rank, why.c_str(), static_cast<long long>(grace.count()));
        std::fflush(stdout);
        std::fflush(stderr);
        std::_Exit(1);
      });
    } catch (...) {
    }
  }

 private:
  std::mutex m_;
  std::condition_variable cv_;
  bool done_ = false;
  std::thread clock_;
};

}  // namespace lockstep::detail
