#pragma once
//! lockstep::run(Threads{n}, body) — the SPMD body once per CPU rank, each rank a host thread
//! of this process with a ThreadComm. An exception on any rank releases the others (their
//! waits throw aborted_error) and is rethrown here, on the caller's thread. The other modes:
//! run(Gpus), run(Processes) (cuda/), run(Mpi) (mpi/); run(Auto) picks one (lockstep/run.hpp).

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
};

template <class Body>
void run(Threads mode, Body&& body) {
  if (mode.ranks < 0)
    throw config_error("lockstep::run(Threads{" + std::to_string(mode.ranks) +
                       "}): a negative number of ranks; give the number of CPU ranks, or 0 to use "
                       "the detected count (LOCKSTEP_CPU_RANKS or the hardware threads)");
  const int n = mode.ranks > 0 ? mode.ranks : decide(detect()).ranks;
  auto comms = ThreadComm::create_group(n);
  ThreadComm aborter = comms[0];
  detail::run_ranks(
      n,
      [&](int r) {
        context<ThreadComm> ctx(comms[static_cast<std::size_t>(r)], r, -1);
        try {
          body(ctx);
        } catch (const aborted_error&) {
          throw;  // released by another rank's failure
        } catch (...) {
          comms[static_cast<std::size_t>(r)].fail();  // survivors of the job (ElasticGroup) need not wait for it
          throw;
        }
        ctx.comm().leave();  // a peer still waiting in a collective for this rank fails at once
      },
      [&](const std::string& why) { aborter.abort(why); });
}

}  // namespace lockstep
