// ThreadComm, the reference communicator: the conformance suite (tests/support/
// comm_conformance.hpp) on 1 to 4 ranks as threads, with float sums compared bit for bit
// (ThreadComm sums in rank order 0..N−1, as the suite's reference does); then what only
// ThreadComm and run(Threads) have: the group's timeout naming the missing rank, one rank's
// exception releasing the others, create_group's checks.
#include <doctest/doctest.h>

#include <chrono>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <lockstep/comm/thread_comm.hpp>
#include <lockstep/launch/run_threads.hpp>

#include "comm_conformance.hpp"
#include "test_util.hpp"

namespace {

void collectives_on(int n) {
  const auto o = lockstep_test::thread_comm_options(lockstep_test::fresh_seed());
  lockstep::run(lockstep::Threads{n},
                [&](lockstep::context<lockstep::ThreadComm>& ctx) { lockstep_test::check_collectives(ctx.comm(), o); });
}

}  // namespace

TEST_SUITE("cpu") {

TEST_CASE("ThreadComm conformance: every collective on 1 rank") { collectives_on(1); }
TEST_CASE("ThreadComm conformance: every collective on 2 ranks") { collectives_on(2); }
TEST_CASE("ThreadComm conformance: every collective on 3 ranks") { collectives_on(3); }
TEST_CASE("ThreadComm conformance: every collective on 4 ranks") { collectives_on(4); }

TEST_CASE("ThreadComm conformance: a collective mismatch is named on every rank instead of hanging") {
  // ThreadComm checks every call: no switch to turn on. Each check wants a fresh group.
  const auto o = lockstep_test::thread_comm_options(lockstep_test::fresh_seed());
  lockstep::run(lockstep::Threads{3},
                [&](lockstep::context<lockstep::ThreadComm>& ctx) { lockstep_test::check_order(ctx.comm(), o); });
  lockstep::run(lockstep::Threads{3}, [&](lockstep::context<lockstep::ThreadComm>& ctx) {
    lockstep_test::check_order_barrier(ctx.comm(), o);
  });
}

TEST_CASE("ThreadComm conformance: a rank that never arrives times out - naming it") {
  const auto timeout = std::chrono::milliseconds(300);
  auto comms = lockstep::ThreadComm::create_group(3, timeout);
  const auto o = lockstep_test::thread_comm_options(lockstep_test::fresh_seed());
  std::vector<lockstep_test::timeout_outcome> seen(3);
  std::vector<std::thread> ranks;
  for (int r = 0; r < 3; ++r)
    ranks.emplace_back([&, r] {
      seen[static_cast<std::size_t>(r)] =
          lockstep_test::check_timeout(comms[static_cast<std::size_t>(r)], o, 2, timeout);
    });
  for (auto& t : ranks) t.join();
  // Whichever waiting rank times out first throws timeout_error and aborts the group; the other
  // throws aborted_error carrying that reason. Both name the missing rank.
  for (int r = 0; r < 2; ++r) {
    const auto& what = seen[static_cast<std::size_t>(r)].what;
    CAPTURE(what);
    CHECK(what.find("rank(s) 2 that never arrived") != std::string::npos);
  }
}

TEST_CASE("run(): one rank's exception releases the others and is rethrown on the caller") {
  auto t0 = std::chrono::steady_clock::now();
  CHECK_THROWS_WITH_AS(lockstep::run(lockstep::Threads{4},
                                     [&](auto& ctx) {
                                       if (ctx.rank() == 2) throw std::runtime_error("boom on rank 2");
                                       ctx.comm().barrier();  // would wait forever for rank 2
                                     }),
                       "boom on rank 2", std::runtime_error);
  CHECK(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() < 10.0);
}

TEST_CASE("ThreadComm rejects an empty group") {
  CHECK_THROWS_AS(lockstep::ThreadComm::create_group(0), lockstep::config_error);
}

}  // TEST_SUITE
