// MpiComm's order check, made immediate by LOCKSTEP_DEBUG=1 (set by ctest for this program): the
// conformance suite's order checks (tests/support/comm_conformance.hpp), and the deferred one. Before each collective
// the ranks compare (sequence, kind, count, type, op, root); a rank that calls something else
// makes every rank throw mismatch_error naming both calls, instead of hanging or mixing buffers.
#include <doctest/doctest.h>

#include <cstdlib>
#include <string>

#include <lockstep/mpi/mpi_comm.hpp>

#include "comm_conformance.hpp"
#include "mpi_util.hpp"

namespace {

lockstep_test::conformance_options order_options() {
  lockstep_test::conformance_options o;
  o.seed = lockstep_mpi_test::shared_seed();
  return o;
}

}  // namespace

TEST_SUITE("mpi") {

TEST_CASE("LOCKSTEP_DEBUG=1 is set for this program") {
  const char* v = std::getenv("LOCKSTEP_DEBUG");
  REQUIRE(v != nullptr);
  CHECK(std::string(v) == "1");
}

// Each check wants a communicator that has issued no collective yet: a fresh dup, whose order
// check is on because LOCKSTEP_DEBUG=1 (set_check_order(true) would do the same).
TEST_CASE("MpiComm conformance: the order check names both calls on every rank") {
  auto comm = lockstep::MpiComm::world();
  lockstep_test::check_order(comm, order_options());
  CHECK(comm.sequence() == 13);
}

TEST_CASE("MpiComm conformance: the deferred order check (the default) names a bucket paired with another") {
  auto comm = lockstep::MpiComm::world();
  comm.set_order_check(lockstep::order_check_mode::deferred);  // this program runs with LOCKSTEP_DEBUG=1
  lockstep_test::check_order_deferred(comm, order_options());
}

TEST_CASE("MpiComm conformance: the order check tells a barrier from an all_reduce") {
  auto comm = lockstep::MpiComm::world();
  lockstep_test::check_order_barrier(comm, order_options());
}

}  // TEST_SUITE
