#pragma once
//! What an MpiComm and its works share (mpi/mpi_comm.hpp): the MPI communicator, its timeout, the
//! order check's seals in flight, and whether it broke; the polled wait every MPI wait uses.

#include <mpi.h>

#include <chrono>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "lockstep/comm/collective.hpp"
#include "lockstep/comm/order_check.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/mpi/detail/mpi_util.hpp"

namespace lockstep {

namespace detail {

//! What a communicator and its works share: the MPI communicator and whether it broke.
struct mpi_state {
  MPI_Comm comm = MPI_COMM_NULL;
  int rank = 0, size = 1;
  std::chrono::milliseconds timeout{};
  order_check_mode order = order_check_mode::deferred;
  std::size_t max_chunk = INT_MAX;
  std::size_t seq = 0;
  std::string broken;  //!< why it can no longer be used; empty while healthy
  //! A seal (comm/order_check.hpp) in flight: this rank's words, then every rank's.
  struct seal {
    MPI_Request req = MPI_REQUEST_NULL;
    std::vector<std::int64_t> words;
  };
  std::deque<seal> seals;  //!< deferred: issued, not yet compared, oldest first
  std::string mismatch;    //!< the first mismatch the deferred check found: every later call throws it

  ~mpi_state() {
    int finalized = 1;
    MPI_Finalized(&finalized);
    // Seals still in flight: a healthy communicator's complete as soon as the peers' do (they
    // issued the same), so give them up to 2 s (an MPI request left open makes MPI_Finalize
    // erroneous); what is left then is left to MPI, its buffers leaked on purpose.
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(2);
    while (!finalized && broken.empty() && !seals.empty() && std::chrono::steady_clock::now() < until) {
      int done = 0;
      if (MPI_Test(&seals.front().req, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS) break;
      if (done) seals.pop_front();
      else std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
    for (auto& sl : seals)
      if (sl.req != MPI_REQUEST_NULL) new std::vector<std::int64_t>(std::move(sl.words));
    if (comm != MPI_COMM_NULL && !finalized) MPI_Comm_free(&comm);
  }

  void live() const {
    if (!mismatch.empty()) throw mismatch_error(mismatch);
    if (!broken.empty())
      throw aborted_error("MpiComm (rank " + std::to_string(rank) + "): unusable after an earlier failure: " + broken);
  }

  //! Issues the seal of `c` (all-gathered with MPI_Iallgather); immediate: waits for it and
  //! throws mismatch_error before the collective starts, leaving the ranks in step.
  void issue_seal(const collective& c) {
    if (order == order_check_mode::off || size == 1) return;  // one rank has nobody to disagree with
    seal& sl = seals.emplace_back();
    const auto mine = encode_order(c);
    sl.words.assign(order_words * (1 + static_cast<std::size_t>(size)), 0);
    std::copy(mine.begin(), mine.end(), sl.words.begin());
    constexpr int k = static_cast<int>(order_words);
    const int rc = MPI_Iallgather(sl.words.data(), k, MPI_INT64_T, sl.words.data() + k, k, MPI_INT64_T, comm, &sl.req);
    if (rc != MPI_SUCCESS) {
      seals.pop_back();
      broken = "the order check of " + c.describe() + " failed to start: " + mpi_error_string(rc);
      throw mpi_error(call_failure("MPI_Iallgather (order check)", __FILE__, __LINE__, mpi_error_string(rc)));
    }
    if (order == order_check_mode::immediate) check_seals(true);
  }

  //! Compares the seals that have arrived, oldest first (all: every one, waiting for them up to
  //! the timeout); the first mismatch is thrown (deferred: and kept, see live()).
  void check_seals(bool all) {
    const auto start = std::chrono::steady_clock::now();
    while (!seals.empty()) {
      seal& sl = seals.front();
      int done = 0;
      const int rc = MPI_Test(&sl.req, &done, MPI_STATUS_IGNORE);
      if (rc != MPI_SUCCESS) {
        broken = "the order check failed: " + mpi_error_string(rc);
        throw mpi_error(call_failure("MPI_Test (order check)", __FILE__, __LINE__, mpi_error_string(rc)));
      }
      if (!done) {
        if (!all) return;
        if (std::chrono::steady_clock::now() - start >= timeout) {
          broken = "the order check timed out";
          throw timeout_error(timeout_message("the order check (a small all-gather before every collective)"));
        }
        std::this_thread::yield();
        continue;
      }
      const auto why = seal_mismatch(std::span<const std::int64_t>(sl.words).subspan(order_words), size, [&] {
        return order_check_how(order, "") + ", seen on rank " + std::to_string(rank);
      });
      seals.pop_front();
      if (!why) continue;
      if (order == order_check_mode::deferred) {  // collectives may be in flight on mismatched calls
        mismatch = *why;
        broken = "the order check found mismatched collectives";
      }
      throw mismatch_error(*why);
    }
  }

  //! Polls until every request completed (true) or the deadline passed (false). Spins briefly,
  //! then yields, then sleeps: ranks often share cores (oversubscribed CPU jobs).
  bool poll(std::vector<MPI_Request>& reqs, const std::string& what) {
    if (reqs.empty()) return true;
    const auto start = std::chrono::steady_clock::now();
    const auto deadline = start + timeout;
    // A mismatch the seals show is the cause of whatever follows (a wait that never ends, an
    // MPI error on mismatched sizes), so it is what this throws — once these requests have
    // completed, if they do within a second (a skipped bucket pairs with one of the same size:
    // then MPI writes nothing into buffers the caller may free as the exception unwinds).
    std::optional<std::chrono::steady_clock::time_point> found;
    for (;;) {
      int done = 0;
      int rc = MPI_Testall(static_cast<int>(reqs.size()), reqs.data(), &done, MPI_STATUSES_IGNORE);
      if (!found) {
        try {
          check_seals(false);
        } catch (const mismatch_error&) {
          found = std::chrono::steady_clock::now();
        }
      }
      if (rc != MPI_SUCCESS) {
        if (found) throw mismatch_error(mismatch);
        broken = what + " failed: " + mpi_error_string(rc);
        throw mpi_error(call_failure("MPI_Testall", __FILE__, __LINE__, mpi_error_string(rc) + " (in " + what + ")"));
      }
      if (done) {
        reqs.clear();
        if (found) throw mismatch_error(mismatch);
        return true;
      }
      const auto now = std::chrono::steady_clock::now();
      if (found && (now - *found >= std::chrono::seconds(1) || now >= deadline)) throw mismatch_error(mismatch);
      if (now >= deadline) return false;
      if (now - start < std::chrono::microseconds(200)) continue;
      if (now - start < std::chrono::milliseconds(5)) std::this_thread::yield();
      else std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }

  std::string timeout_message(const std::string& what) const {
    char secs[32];
    std::snprintf(secs, sizeof secs, "%g", static_cast<double>(timeout.count()) / 1000.0);
    return "MpiComm (rank " + std::to_string(rank) + "): " + what + " did not complete within " + secs +
           " s (LOCKSTEP_TIMEOUT): another rank is stuck, has died, or called a different "
           "collective (LOCKSTEP_DEBUG=1 checks the order of collectives). The communicator "
           "cannot be used again; end the job (lockstep::run(Mpi{}) calls MPI_Abort).";
  }
};

}  // namespace detail

}  // namespace lockstep
