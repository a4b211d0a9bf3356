// LOCKSTEP_DEBUG=1 (set by ctest for this program): before each collective the ranks compare
// (sequence, kind, count, type, op, root); a rank that calls something else makes every rank
// throw the same mismatch_error, naming both calls, instead of hanging or mixing buffers.
#include <doctest/doctest.h>

#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include <lockstep/mpi/comm.hpp>

#include "mpi_util.hpp"

using namespace lockstep_mpi_test;
using lockstep::dtype;
using lockstep::reduce_op;

namespace {

// Runs `call` on every rank; returns the mismatch_error's message ("" if none was thrown).
template <class F>
std::string mismatch_of(F&& call) {
  try {
    call();
  } catch (const lockstep::mismatch_error& e) {
    return e.what();
  }
  return {};
}

bool has(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

}  // namespace

TEST_SUITE("mpi") {

TEST_CASE("LOCKSTEP_DEBUG=1 is set for this program") {
  const char* v = std::getenv("LOCKSTEP_DEBUG");
  REQUIRE(v != nullptr);
  CHECK(std::string(v) == "1");
}

TEST_CASE("order check: matching collectives pass") {
  auto comm = lockstep::MpiComm::world();
  const int n = comm.size();
  std::vector<float> a(5, 1.0f), g(5 * static_cast<std::size_t>(n), 0.0f);
  comm.all_reduce(a.data(), a.data(), 5, dtype::f32, reduce_op::sum).wait();
  comm.broadcast(a.data(), 5, dtype::f32, n - 1).wait();
  comm.all_gather(a.data(), g.data(), 5, dtype::f32).wait();
  comm.reduce_scatter(g.data(), a.data(), 5, dtype::f32, reduce_op::max).wait();
  comm.barrier();
  CHECK(a == std::vector<float>(5, static_cast<float>(n)));
  CHECK(comm.sequence() == 5);
}

TEST_CASE("order check: a rank with another count → mismatch_error on every rank") {
  auto comm = lockstep::MpiComm::world();
  const int me = comm.rank();
  std::vector<double> v(5, 1.0);
  const std::size_t count = me == 1 ? 5 : 4;
  const auto msg = mismatch_of([&] { comm.all_reduce(v.data(), v.data(), count, dtype::f64, reduce_op::sum).wait(); });
  CAPTURE(me);
  CAPTURE(msg);
  CHECK(all_ranks(!msg.empty()));
  CHECK(has(msg, "rank 0 called all_reduce #0 of 4 f64 (sum)"));
  CHECK(has(msg, "rank 1 called all_reduce #0 of 5 f64 (sum)"));
  CHECK(v == std::vector<double>(5, 1.0));  // nothing was reduced
  // Every rank stopped before the collective: the communicator is still in step.
  v.assign(5, 1.0);
  comm.all_reduce(v.data(), v.data(), 5, dtype::f64, reduce_op::sum).wait();
  CHECK(v == std::vector<double>(5, static_cast<double>(comm.size())));
}

TEST_CASE("order check: another collective, type, op or root → mismatch_error on every rank") {
  auto comm = lockstep::MpiComm::world();
  const int me = comm.rank(), n = comm.size();
  std::vector<std::int32_t> v(3, 1), g(3 * static_cast<std::size_t>(n), 0);
  const int odd = n - 1;  // the rank that calls something else

  auto msg = mismatch_of([&] {
    if (me == odd) comm.broadcast(v.data(), 3, dtype::i32, 0).wait();
    else comm.all_reduce(v.data(), v.data(), 3, dtype::i32, reduce_op::sum).wait();
  });
  CAPTURE(msg);
  CHECK(all_ranks(!msg.empty()));
  CHECK(has(msg, "rank " + std::to_string(odd) + " called broadcast #0 of 3 i32 from root 0"));

  msg = mismatch_of([&] {
    comm.all_reduce(v.data(), v.data(), me == odd ? 6 : 3, me == odd ? dtype::u8 : dtype::i32,
                    reduce_op::sum).wait();
  });
  CHECK(all_ranks(!msg.empty()));
  CHECK(has(msg, "#1 of 6 u8"));

  msg = mismatch_of([&] {
    comm.all_reduce(v.data(), v.data(), 3, dtype::i32, me == odd ? reduce_op::max : reduce_op::sum).wait();
  });
  CHECK(all_ranks(!msg.empty()));
  CHECK(has(msg, "#2 of 3 i32 (max)"));

  msg = mismatch_of([&] { comm.broadcast(v.data(), 3, dtype::i32, me == odd ? 1 : 0).wait(); });
  CHECK(all_ranks(!msg.empty()));
  CHECK(has(msg, "from root 1"));

  // A rank that waits in a barrier while the others reduce.
  msg = mismatch_of([&] {
    if (me == odd) comm.barrier();
    else comm.all_reduce(v.data(), v.data(), 3, dtype::i32, reduce_op::sum).wait();
  });
  CHECK(all_ranks(!msg.empty()));
  CHECK(has(msg, "rank 0 called all_reduce #4 of 3 i32 (sum) but rank " + std::to_string(odd) +
                     " called barrier #4"));
  CHECK(comm.sequence() == 5);
}

}  // TEST_SUITE
