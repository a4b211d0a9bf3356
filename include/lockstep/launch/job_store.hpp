#pragma once
//! The job's rendezvous store, from what the launcher said (detect_launcher()).

#include <chrono>
#include <string>

#include "lockstep/core/detail/env.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/core/progress.hpp"
#include "lockstep/launch/launch_env.hpp"
#include "lockstep/store/store.hpp"
#include "lockstep/store/tcp_store.hpp"

namespace lockstep {

//! A TcpStore that rank 0 hosts at the launcher's master_addr:master_port and every rank
//! joins with the job token, which is also the run id: a process of another run that reaches
//! the port is refused, naming both runs (docs/reliability.md, scenario 6). Every rank
//! announces itself; while some have not, rank 0 reports which (TcpStore::report_arrivals:
//! first after 5 s, then every 10 s, on stderr unless `progress` says otherwise). It does
//! not wait for them: the job's first collective does.
inline TcpStore job_store(const launch_info& info, std::chrono::milliseconds timeout = detail::default_timeout(),
                          store_limits limits = {}, const progress_options& progress = {}) {
  if (info.world > 1 && (info.master_addr.empty() || info.master_port == 0))
    throw config_error("TcpStore: the launcher (" + info.launcher +
                       ") gave no store address; set MASTER_ADDR and MASTER_PORT "
                       "(or LOCKSTEP_MASTER_ADDR/PORT) to the host and a free port of rank 0");
  (void)detail::progress_allowed_by_env();  // a malformed LOCKSTEP_PROGRESS stops every rank, not rank 0 alone
  const std::string host = info.master_addr.empty() ? std::string("127.0.0.1") : info.master_addr;
  TcpStore store(host, info.master_port, info.rank == 0, info.world, info.job_token, timeout, limits);
  if (info.rank == 0) store.report_arrivals(progress);
  store.announce(info.rank);
  return store;
}

}  // namespace lockstep
