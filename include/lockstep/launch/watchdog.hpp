#pragma once
//! lockstep::Watchdog — notices that another process of the job died, stopped or failed, and
//! tells this one, so that no rank waits forever on a peer that is gone.
//!
//! Each process runs one Watchdog: a thread with its own connection to the job's TcpStore
//! (the one rank 0 hosts). The connection `watch`es the key "lockstep/failed" (see
//! store/detail/wire.hpp): the store server sets it to "rank R left: ..." when the
//! connection of rank R closes before a clean stop() — R was killed or exited early — and to
//! "rank R stopped responding: ..." when R sent no heartbeat for `timeout`. Every `period`
//! the thread sends a heartbeat that also reads the key, runs the caller's `poll` (e.g.
//! "did NCCL report an error?", "is a collective overdue?") and, on the first failure seen —
//! the key, a poll result, or a lost store (rank 0 gone) — calls `on_failure` once with a
//! text naming the rank and what happened. run(Processes) passes a callback that aborts the
//! NCCL communicator: the main thread's next call then throws instead of hanging.
//!
//! If the main thread has not returned (stop() or the destructor) `grace` after the failure
//! was seen — whether or not on_failure itself returned — the watchdog prints the reason and
//! ends the process with exit status 1: a rank stuck in a host-side wait must not outlive the
//! job. grace = 0 disables this.
//!
//! Failures first reported by this process (report()) reach the others the same way. The
//! first failure of a job wins: later ones (e.g. the survivors shutting down) never
//! overwrite it, so every rank prints the same cause.
//!
//! \code
//!   lockstep::Watchdog dog(info.master_addr, info.master_port, info.rank, info.world, info.job_token,
//!                          [&](const std::string& why) { comm.abort(why); });
//!   train(comm);  // ... a watched job
//!   dog.stop();   // a clean leave: before the job's last barrier
//! \endcode

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>

#include "lockstep/core/detail/env.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/store/store.hpp"
#include "lockstep/store/tcp_store.hpp"

namespace lockstep {

struct watchdog_options {
  //! A rank silent this long is reported lost; also the store's request bound.
  std::chrono::milliseconds timeout = detail::default_timeout();
  //! Heartbeat and poll interval.
  std::chrono::milliseconds period = std::chrono::milliseconds(200);
  //! After a failure, how long the main thread has to return before the process is ended
  //! (exit status 1). 0: never end it.
  std::chrono::milliseconds grace = std::chrono::seconds(5);
  //! The key watched and reported to (failure_key; an elastic job one per membership, whose
  //! "<key>/rank R" then says which ranks are gone: store/detail/wire.hpp).
  std::string key = "lockstep/failed";
};

class Watchdog {
 public:
  //! Called once, from the watchdog thread, with the first failure's text.
  using failure_fn = std::function<void(const std::string&)>;
  //! Called every period from the watchdog thread; a returned text is a failure of this rank.
  using poll_fn = std::function<std::optional<std::string>()>;

  static constexpr const char* failure_key = "lockstep/failed";
  //! Set (first one wins) by a rank whose body returned: it issues no more collectives.
  static constexpr const char* departure_key = "lockstep/left";

  //! host/port: the job's TcpStore (rank 0 connects over loopback). Connects, registers the
  //! watch and starts the thread; throws like TcpStore when the store cannot be reached.
  Watchdog(const std::string& host, int port, int rank, int world, const std::string& token, failure_fn on_failure,
           poll_fn poll = {}, watchdog_options opt = {})
      : rank_(rank), world_(world), port_(port), host_(rank == 0 ? std::string("127.0.0.1") : host), token_(token),
        opt_(opt), on_failure_(std::move(on_failure)), poll_(std::move(poll)) {
    if (opt_.period.count() <= 0 || opt_.timeout.count() <= 0 || opt_.grace.count() < 0)
      throw config_error("Watchdog: period and timeout must be positive and grace not negative");
    if (!on_failure_) throw config_error("Watchdog: on_failure is empty; pass what to do when a peer fails");
    // Requests are bounded by half the timeout (a check() may take two bounds), so a stopped
    // rank 0 is noticed within `timeout`, like any other stopped rank.
    store_ = std::make_unique<TcpStore>(host_, port_, false, world_, token_,
                                        std::max(opt_.timeout / 2, std::chrono::milliseconds(1)));
    store_->watch(opt_.key, "rank " + std::to_string(rank), opt_.timeout);
    thread_ = std::thread([this] { loop(); });
  }

  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;
  ~Watchdog() { stop(); }

  //! This rank failed: tell every rank (unless an earlier failure was reported). Never throws.
  //! A no-op once this watchdog has seen a failure: that one is the job's cause, and the
  //! store may be gone with it (rank 0 lost). Uses a connection of its own, bounded by 2 s,
  //! so a heartbeat in flight never delays it.
  void report(const std::string& what) noexcept {
    if (failure()) return;
    try {
      TcpStore once(host_, port_, false, world_, token_, std::chrono::seconds(2));
      once.set_if_absent(opt_.key, bytes_of(what));
    } catch (const std::exception& e) {
      std::fprintf(stderr, "lockstep: rank %d could not report its failure (%s): %s\n", rank_, what.c_str(), e.what());
    }
  }

  //! Stops the thread. After no failure this is a clean leave (the watch is withdrawn, so
  //! closing the connection is not taken for a death). Idempotent; never throws. Called
  //! from on_failure it only asks the thread to end (the destructor joins it).
  void stop() noexcept { end(false); }

  //! Stops the thread and withdraws the watch even after a failure: this rank goes on (in a
  //! smaller membership of an elastic job, under a watchdog of its own), so closing this
  //! connection must not report it gone. Idempotent; never throws; not from on_failure.
  void retire() noexcept { end(true); }

  //! The first failure seen, if any.
  std::optional<std::string> failure() const {
    std::lock_guard lk(m_);
    return failure_;
  }

  //! What the first rank whose body returned wrote at departure_key ("rank R"), once a
  //! heartbeat has seen it. A rank still waiting in a collective then waits for nobody.
  std::optional<std::string> departed() const {
    std::lock_guard lk(m_);
    return departed_;
  }

 private:
  void end(bool going_on) noexcept {
    {
      std::lock_guard lk(m_);
      stopping_ = true;
    }
    cv_.notify_all();
    if (std::this_thread::get_id() == thread_.get_id()) return;
    if (thread_.joinable()) thread_.join();
    if (reaper_.joinable()) reaper_.join();
    std::lock_guard lk(store_m_);
    if (!store_) return;
    if (failure() && !going_on) {
      // Rank 0's process hosts the store: keep it up a little longer, so every rank reads the
      // cause at its next heartbeat instead of seeing only "rank 0 left".
      if (rank_ == 0) std::this_thread::sleep_for(std::max(2 * opt_.period, std::chrono::milliseconds(500)));
    } else {
      try {
        store_->unwatch();
      } catch (...) {  // the store is gone: nobody is left to mistake our leave for a death
      }
    }
    store_.reset();
  }

  void loop() noexcept {
    std::unique_lock lk(m_);
    while (!stopping_) {
      lk.unlock();
      std::optional<std::string> why;
      try {
        why = probe();
      } catch (const std::exception& e) {
        why = std::string("the watchdog of rank ") + std::to_string(rank_) + " failed: " + e.what();
      }
      lk.lock();
      if (why) {
        failure_ = *why;
        break;
      }
      cv_.wait_for(lk, opt_.period, [&] { return stopping_; });
    }
    if (!failure_) return;
    const std::string why = *failure_;
    // The grace period runs from here, on a thread of its own: a callback that hangs (an
    // abort that does not return) must not keep the process alive either.
    if (opt_.grace.count() > 0) {
      try {
        reaper_ = std::thread([this, why] { end_after_grace(why); });
      } catch (...) {
      }
    }
    lk.unlock();
    std::fprintf(stderr, "lockstep: rank %d stops: %s\n", rank_, why.c_str());
    std::fflush(stderr);
    try {
      on_failure_(why);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "lockstep: rank %d: the failure callback threw: %s\n", rank_, e.what());
    }
  }

  void end_after_grace(const std::string& why) noexcept {
    std::unique_lock lk(m_);
    if (cv_.wait_for(lk, opt_.grace, [&] { return stopping_; })) return;
    std::fprintf(stderr,
                 "lockstep: rank %d exits: %s (its main thread did not return within %s of the failure; "
                 "watchdog_options::grace)\n",
                 rank_, why.c_str(), detail::seconds_text(opt_.grace).c_str());
    std::fflush(stderr);
    std::_Exit(1);
  }

  //! One heartbeat: the job's failure key (set by the store or a peer), then the poll.
  std::optional<std::string> probe() {
    {
      std::lock_guard lk(store_m_);
      try {
        if (store_->check({opt_.key})) return string_of(store_->get(opt_.key));
        if (!departed() && store_->check({departure_key})) {
          auto who = string_of(store_->get(departure_key));
          std::lock_guard lk(m_);
          departed_ = std::move(who);
        }
      } catch (const timeout_error& e) {
        if (rank_ == 0) throw;
        return std::string("rank 0 stopped responding: the store it hosts did not answer in time (") + e.what() + ")";
      } catch (const aborted_error& e) {
        if (rank_ == 0) throw;
        return std::string("rank 0 left: the store it hosts closed (rank 0 exited or was killed; ") + e.what() + ")";
      }
    }
    if (poll_) {
      if (auto mine = poll_()) {
        report(*mine);
        return mine;
      }
    }
    return std::nullopt;
  }

  int rank_;
  int world_;
  int port_;
  std::string host_;
  std::string token_;
  watchdog_options opt_;
  failure_fn on_failure_;
  poll_fn poll_;
  std::mutex store_m_;  // store_ is used by the thread and by stop()
  std::unique_ptr<TcpStore> store_;
  mutable std::mutex m_;
  std::condition_variable cv_;
  bool stopping_ = false;
  std::optional<std::string> failure_;
  std::optional<std::string> departed_;
  std::thread thread_;
  std::thread reaper_;  // after a failure with grace > 0: ends the process unless stop() comes first
};

}  // namespace lockstep
