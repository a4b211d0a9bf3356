#pragma once
//! The job's rendezvous store, from what the launcher said (detect_launcher()).

#include <chrono>
#include <string>

#include "lockstep/core/env.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/launch/launch_env.hpp"
#include "lockstep/store/store.hpp"
#include "lockstep/store/tcp_store.hpp"

namespace lockstep {

//! A TcpStore that rank 0 hosts at the launcher's master_addr:master_port and every rank
//! joins with the job token, which is also the run id: a process of another run that reaches
//! the port is refused, naming both runs (docs/reliability.md, scenario 6).
inline TcpStore job_store(const launch_info& info, std::chrono::milliseconds timeout = detail::default_timeout(),
                          store_limits limits = {}) {
  if (info.world > 1 && (info.master_addr.empty() || info.master_port == 0))
    throw config_error("TcpStore: the launcher (" + info.launcher +
                       ") gave no store address; set MASTER_ADDR and MASTER_PORT "
                       "(or LOCKSTEP_MASTER_ADDR/PORT) to the host and a free port of rank 0");
  const std::string host = info.master_addr.empty() ? std::string("127.0.0.1") : info.master_addr;
  return TcpStore(host, info.master_port, info.rank == 0, info.world, info.job_token, timeout, limits);
}

}  // namespace lockstep
