#pragma once
//! lockstep::run(Threads{n}, body) — the SPMD body once per CPU rank, each rank a host thread
//! of this process with a ThreadComm. An exception on any rank releases the others (their
//! waits throw aborted_error) and is rethrown here, on the caller's thread — unless the rank
//! is started again (Threads::max_restarts: it then joins the job that goes on without it, as
//! a replacement process does under `lockstep-run --elastic --max-restarts`). The other modes:
//! run(Gpus), run(Processes) (cuda/), run(Mpi) (mpi/); run(Auto) picks one (lockstep/run.hpp).

#include <atomic>
#include <exception>
#include <string>
#include <thread>
#include <vector>

#include "lockstep/comm/thread_comm.hpp"
#include "lockstep/core/context.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/launch/detail/run_ranks.hpp"
#include "lockstep/launch/detect.hpp"

namespace lockstep {

//! Mode tag: `ranks` CPU ranks as threads of this process (0: from detect()).
struct Threads {
  int ranks = 0;
  //! How many times in all a rank whose body failed — threw, other than being released by
  //! another rank's failure (aborted_error) — is started again on its thread, its context's
  //! restart_count() counting up: an ElasticGroup built on that context joins the job that
  //! went on without it (docs/elastic.md, "Growing back"). A failure followed by a restart is
  //! not rethrown by run(). 0: none.
  int max_restarts = 0;
};

template <class Body>
void run(Threads mode, Body&& body) {
  if (mode.ranks < 0)
    throw config_error("lockstep::run(Threads{" + std::to_string(mode.ranks) +
                       "}): a negative number of ranks; give the number of CPU ranks, or 0 to use "
                       "the detected count (LOCKSTEP_CPU_RANKS or the hardware threads)");
  if (mode.max_restarts < 0)
    throw config_error("lockstep::run(Threads{.max_restarts = " + std::to_string(mode.max_restarts) +
                       "}): a negative number of restarts; give how many failed ranks may be started again (0: none)");
  const int n = mode.ranks > 0 ? mode.ranks : decide(detect()).ranks;
  auto comms = ThreadComm::create_group(n);
  ThreadComm aborter = comms[0];
  std::atomic<int> restarts_left{mode.max_restarts};
  detail::run_ranks(
      n,
      [&](int r) {
        ThreadComm& mine = comms[static_cast<std::size_t>(r)];
        for (int count = 0;; ++count) {
          context<ThreadComm> ctx(mine, r, -1);
          ctx.set_restarts(count, mode.max_restarts > 0);
          try {
            body(ctx);
            break;
          } catch (const aborted_error&) {
            throw;  // released by another rank's failure
          } catch (const std::exception& e) {
            mine.fail();  // survivors of the job (ElasticGroup) need not wait for it
            if (restarts_left.fetch_sub(1) <= 0) throw;
            aborter.abort("rank " + std::to_string(r) + " failed: " + e.what());  // (the others go on without it)
          } catch (...) {
            mine.fail();
            throw;
          }
        }
        mine.leave();  // a peer still waiting in a collective for this rank fails at once
      },
      [&](const std::string& why) { aborter.abort(why); });
}

}  // namespace lockstep
