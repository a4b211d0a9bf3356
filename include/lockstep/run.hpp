#pragma once
//! lockstep::run(mode, body) — runs the SPMD body once per rank.
//!
//! Modes are tags chosen at compile time (`Threads{n}`: n CPU ranks as host threads of
//! this process) or `Auto{}`, which asks detect()/decide() at run time. With Auto the body
//! must be generic (`[&](auto& ctx)`), since each mode hands it a context of its own
//! communicator type. An exception on any rank releases the others (their waits throw
//! aborted_error) and is rethrown here, on the caller's thread.

#include <exception>
#include <string>
#include <thread>
#include <vector>

#include "lockstep/context.hpp"
#include "lockstep/detect.hpp"
#include "lockstep/error.hpp"
#include "lockstep/thread_comm.hpp"

namespace lockstep {

//! Mode tag: `ranks` CPU ranks as threads of this process (0: from detect()).
struct Threads {
  int ranks = 0;
};

//! Mode tag: decide at run time from lockstep::detect().
struct Auto {};

namespace detail {

//! Runs f(r) on n threads, aborting the group on the first failure; rethrows the root
//! cause (not the aborted_errors it triggered on the other ranks).
template <class F, class Abort>
void run_ranks(int n, F&& f, Abort&& abort) {
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(n));
  std::vector<std::thread> threads;
  threads.reserve(static_cast<std::size_t>(n));
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      try {
        f(r);
      } catch (const std::exception& e) {
        errors[static_cast<std::size_t>(r)] = std::current_exception();
        abort("rank " + std::to_string(r) + " failed: " + e.what());
      } catch (...) {
        errors[static_cast<std::size_t>(r)] = std::current_exception();
        abort("rank " + std::to_string(r) + " failed with a non-standard exception");
      }
    });
  }
  for (auto& t : threads) t.join();
  std::exception_ptr first;
  for (auto& e : errors) {
    if (!e) continue;
    try {
      std::rethrow_exception(e);
    } catch (const aborted_error&) {
      if (!first) first = e;
    } catch (...) {
      std::rethrow_exception(e);
    }
  }
  if (first) std::rethrow_exception(first);
}

}  // namespace detail

template <class Body>
void run(Threads mode, Body&& body) {
  const int n = mode.ranks > 0 ? mode.ranks : decide(detect()).ranks;
  auto comms = ThreadComm::create_group(n);
  ThreadComm aborter = comms[0];
  detail::run_ranks(
      n,
      [&](int r) {
        context<ThreadComm> ctx(comms[static_cast<std::size_t>(r)], r, -1);
        body(ctx);
      },
      [&](const std::string& why) { aborter.abort(why); });
}

template <class Body>
void run(Auto, Body&& body) {
  const plan p = decide(detect());
  switch (p.kind) {
    case mode_kind::cpu_threads: return run(Threads{p.ranks}, std::forward<Body>(body));
  }
}

}  // namespace lockstep
