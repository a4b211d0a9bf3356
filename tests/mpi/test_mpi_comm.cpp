// MpiComm: the conformance suite (tests/support/comm_conformance.hpp), each MPI process a
// rank, with float sums compared within a tolerance (MPI does not promise ThreadComm's rank
// order); again with counts split into several MPI calls (set_max_chunk); the timeout. Then
// what only MpiComm has: MPI_COMM_WORLD and run(Mpi), the placements it stages through a copy,
// works destroyed unwaited, MPI errors.
#include <doctest/doctest.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <lockstep/mpi/mpi_comm.hpp>
#include <lockstep/mpi/run_mpi.hpp>

#include "comm_conformance.hpp"
#include "mpi_util.hpp"

using namespace lockstep_mpi_test;
using lockstep::dtype;
using lockstep::reduce_op;

namespace {

// MPI has u8, i32, i64, f32 and f64 (the suite's defaults); f16/bf16 throw config_error. The
// tests run under mpirun on one host, so the ranks share a clock.
lockstep_test::conformance_options mpi_options() {
  lockstep_test::conformance_options o;
  o.seed = shared_seed();
  return o;
}

}  // namespace

TEST_SUITE("mpi") {

TEST_CASE("MpiComm::world and run(Mpi): ranks, sizes, local ranks") {
  auto comm = lockstep::MpiComm::world();
  CHECK(comm.rank() == world_rank());
  CHECK(comm.size() == world_size());
  CHECK(comm.size() >= 2);                 // the tests are meant to run under mpirun -np ≥ 2
  CHECK(comm.native() != MPI_COMM_WORLD);  // a dup: its traffic cannot meet the application's
  int calls = 0;
  lockstep::run(lockstep::Mpi{}, [&](lockstep::context<lockstep::MpiComm>& ctx) {
    ++calls;
    CHECK(ctx.rank() == world_rank());
    CHECK(ctx.size() == world_size());
    CHECK(ctx.device() == -1);
    // One node here: the local rank is the rank.
    CHECK(ctx.local_rank() == ctx.rank());
    std::vector<std::int64_t> v{ctx.rank() + 1};
    ctx.comm().all_reduce(v.data(), v.data(), 1, dtype::i64, reduce_op::sum).wait();
    CHECK(v[0] == std::int64_t{ctx.size()} * (ctx.size() + 1) / 2);
  });
  CHECK(calls == 1);
}

TEST_CASE("MpiComm conformance: every collective, element type, count and placement") {
  auto comm = lockstep::MpiComm::world();
  lockstep_test::check_collectives(comm, mpi_options());
}

TEST_CASE("MpiComm conformance: counts above the per-call limit are split into chunks") {
  auto comm = lockstep::MpiComm::world();
  comm.set_max_chunk(1000);  // as if MPI's int counts ended at 1000
  auto o = mpi_options();
  o.types = {dtype::f64, dtype::i32};
  o.counts = {999, 1000, 1001, 2501};
  o.large_counts = {};
  lockstep_test::check_all_reduce(comm, o);
  lockstep_test::check_broadcast(comm, o);
  lockstep_test::check_all_gather(comm, o);
  lockstep_test::check_reduce_scatter(comm, o);
}

TEST_CASE("MpiComm conformance: a collective a peer never joins times out instead of hanging") {
  using namespace std::chrono_literals;
  lockstep::MpiComm comm(MPI_COMM_WORLD, 800ms);
  const int absent = comm.size() - 1;
  const auto seen = lockstep_test::check_timeout(comm, mpi_options(), absent, 800ms);
  if (seen.waited) {
    CAPTURE(seen.what);
    CHECK(seen.what.find("all_reduce #0 of 3 i64 (sum)") != std::string::npos);
    CHECK(seen.what.find("0.8 s") != std::string::npos);
  }
  // MPI cannot cancel the abandoned all-reduce and may write into its buffer whenever it
  // completes: keep that alive for good.
  static std::vector<std::shared_ptr<void>> abandoned;
  abandoned.insert(abandoned.end(), seen.keep_alive.begin(), seen.keep_alive.end());
  // Let it complete so the job ends cleanly: once the others gave up, the absent rank joins it
  // (they drive MPI's progress from the barrier below).
  MPI_Barrier(MPI_COMM_WORLD);
  if (comm.rank() == absent) {
    std::vector<std::int64_t> buf{1, 2, 3};
    comm.all_reduce(buf.data(), buf.data(), buf.size(), dtype::i64, reduce_op::sum).wait();
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

TEST_CASE("MpiComm: other overlaps of send and recv are staged through a copy") {
  // Beyond the suite's in-place forms, docs/mpi.md promises reduce_scatter with recv == send
  // (MPI_IN_PLACE) and any other overlap (staged).
  auto comm = lockstep::MpiComm::world();
  const auto o = mpi_options();
  const int n = comm.size(), me = comm.rank();
  const auto un = static_cast<std::size_t>(n);
  for (std::size_t count : {std::size_t{1}, std::size_t{7}, std::size_t{4099}}) {
    CAPTURE(count);
    CAPTURE(o.seed);
    {  // all_gather with send at the start of recv: in place for rank 0 only
      const std::uint64_t salt = 300 + count;
      auto mine = lockstep_test::conformance_input(dtype::f64, o.seed, salt, me, 0, count);
      std::vector<double> recv(count * un, -1.0);
      std::memcpy(recv.data(), mine.data(), mine.size());
      comm.all_gather(recv.data(), recv.data(), count, dtype::f64).wait();
      for (int q = 0; q < n; ++q) {
        const std::string bad = lockstep_test::conformance_compare_input(
            dtype::f64, recv.data() + static_cast<std::size_t>(q) * count, count, o.seed, salt, q, 0);
        CHECK_MESSAGE(bad.empty(), "block " << q << ": " << bad);
      }
    }
    for (auto op : {reduce_op::sum, reduce_op::avg, reduce_op::max, reduce_op::min}) {
      // reduce_scatter with recv == send: the result lands at the start of send
      CAPTURE(std::string(lockstep::name_of(op)));
      const std::uint64_t salt = 400 + count + static_cast<std::uint64_t>(op);
      auto send = lockstep_test::conformance_input(dtype::i32, o.seed, salt, me, 0, count * un);
      comm.reduce_scatter(send.data(), send.data(), count, dtype::i32, op).wait();
      const std::string bad = lockstep_test::conformance_compare_reduced(
          dtype::i32, send.data(), count, o.seed, salt, n, static_cast<std::size_t>(me) * count, op, false);
      CHECK_MESSAGE(bad.empty(), bad);
    }
  }
}

TEST_CASE("works: destroyed unwaited, moved from, counted by sequence()") {
  const auto o = mpi_options();
  CAPTURE(o.seed);
  auto comm = lockstep::MpiComm::world();
  const int n = comm.size(), me = comm.rank();
  constexpr std::size_t count = 10007;
  std::vector<std::vector<unsigned char>> bufs;
  for (std::uint64_t s = 0; s < 2; ++s)
    bufs.push_back(lockstep_test::conformance_input(dtype::f64, o.seed, 500 + s, me, 0, count));
  {
    auto w0 = comm.all_reduce(bufs[0].data(), bufs[0].data(), count, dtype::f64, reduce_op::sum);
    auto w1 = comm.all_reduce(bufs[1].data(), bufs[1].data(), count, dtype::f64, reduce_op::avg);
    CHECK(comm.sequence() == 2);
    auto moved = std::move(w0);
    moved.wait();
    CHECK(moved.done());
    w0.wait();  // a moved-from work is complete
    CHECK(w0.done());
    // w1 is never waited: its destructor waits, and the average's division still happens.
  }
  const reduce_op ops[] = {reduce_op::sum, reduce_op::avg};
  for (std::size_t k = 0; k < 2; ++k) {
    CAPTURE(k);
    const std::string bad = lockstep_test::conformance_compare_reduced(dtype::f64, bufs[k].data(), count, o.seed,
                                                                       500 + k, n, 0, ops[k], false);
    CHECK_MESSAGE(bad.empty(), bad);
  }
  comm.barrier();
  CHECK(comm.sequence() == 3);
}

TEST_CASE("errors: half types, rejected calls are not numbered, failed MPI calls") {
  auto comm = lockstep::MpiComm::world();
  std::vector<std::uint16_t> h(4, 1);
  // f16/bf16 have no MPI type, whatever the collective (reductions: the suite's misuse check).
  CHECK_THROWS_AS(comm.broadcast(h.data(), 4, dtype::bf16, 0), lockstep::config_error);
  CHECK_THROWS_AS(comm.all_gather(h.data(), h.data(), 1, dtype::f16), lockstep::config_error);
  std::vector<float> f(4, 1.0f);
  CHECK_THROWS_AS(comm.broadcast(f.data(), 4, dtype::f32, comm.size()), lockstep::config_error);
  CHECK(comm.sequence() == 0);  // rejected calls are not collectives: ranks stay in step
  CHECK_THROWS_AS(comm.set_max_chunk(0), lockstep::config_error);

  // A real MPI error, returned (MPI_ERRORS_RETURN on the dup) and turned into mpi_error with
  // MPI's own text. An invalid root fails the argument check on every rank alike.
  int x = 0;
  std::string what;
  try {
    LOCKSTEP_TRY_MPI(MPI_Bcast(&x, 1, MPI_INT, comm.size() + 5, comm.native()));
  } catch (const lockstep::mpi_error& e) {
    what = e.what();
  }
  REQUIRE(!what.empty());
  CHECK(what.find("MPI_Bcast(&x, 1, MPI_INT") != std::string::npos);
  CHECK(what.find("test_mpi_comm.cpp:") != std::string::npos);
  CHECK(what.find(lockstep::detail::mpi_error_string(MPI_ERR_ROOT)) != std::string::npos);

  // The communicator is still usable afterwards.
  std::vector<std::int32_t> v{1};
  comm.all_reduce(v.data(), v.data(), 1, dtype::i32, reduce_op::sum).wait();
  CHECK(v[0] == comm.size());
}

}  // TEST_SUITE
