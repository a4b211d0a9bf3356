// MpiComm's collectives against references computed from every rank's input: each rank can
// generate every rank's input (deterministic from a seed broadcast by rank 0), so it checks
// its own result without trusting the communicator. Lengths 0, 1, odd and ≥ 1M; every
// element type with MPI arithmetic, every op, in place and out of place; large counts split
// into chunks (set_max_chunk).
#include <doctest/doctest.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include <lockstep/launch/run.hpp>
#include <lockstep/mpi/comm.hpp>
#include <lockstep/mpi/run.hpp>

#include "mpi_util.hpp"

using namespace lockstep_mpi_test;
using lockstep::dtype;
using lockstep::reduce_op;

namespace {

constexpr reduce_op all_ops[] = {reduce_op::sum, reduce_op::avg, reduce_op::max, reduce_op::min};
constexpr std::size_t large = (std::size_t{1} << 20) + 3;

// The reduction of element i over ranks 0..n-1, in rank order, in T (integers wrap, as
// ThreadComm); floats are summed in long double (compared with a tolerance).
template <class T>
T reduce_ref(std::uint64_t seed, std::uint64_t salt, int n, std::size_t i, reduce_op op) {
  if constexpr (std::is_floating_point_v<T>) {
    long double acc = value<T>(seed, salt, 0, i);
    for (int r = 1; r < n; ++r) {
      const long double x = value<T>(seed, salt, r, i);
      acc = op == reduce_op::max ? std::max(acc, x) : op == reduce_op::min ? std::min(acc, x) : acc + x;
    }
    if (op == reduce_op::avg) acc /= n;
    return static_cast<T>(acc);
  } else {
    T acc = value<T>(seed, salt, 0, i);
    for (int r = 1; r < n; ++r) {
      const T x = value<T>(seed, salt, r, i);
      acc = op == reduce_op::max ? std::max(acc, x) : op == reduce_op::min ? std::min(acc, x) : static_cast<T>(acc + x);
    }
    if (op == reduce_op::avg) acc = static_cast<T>(static_cast<std::int64_t>(acc) / n);
    return acc;
  }
}

// Number of elements that differ from the reference beyond the tolerance (floats: sums are
// reordered by MPI; max/min are exact).
template <class T>
std::size_t count_wrong(const T* got, std::size_t count, std::uint64_t seed, std::uint64_t salt, int n,
                        reduce_op op, std::size_t first = 0) {
  std::size_t wrong = 0;
  const double tol = std::is_floating_point_v<T> && (op == reduce_op::sum || op == reduce_op::avg)
                         ? 4.0 * n * n * std::numeric_limits<T>::epsilon()
                         : 0.0;
  for (std::size_t i = 0; i < count; ++i) {
    const T ref = reduce_ref<T>(seed, salt, n, first + i, op);
    if (std::is_floating_point_v<T> ? !(std::fabs(static_cast<double>(got[i]) - static_cast<double>(ref)) <= tol)
                                    : got[i] != ref)
      ++wrong;
  }
  return wrong;
}

template <class T>
void check_all_reduce(lockstep::MpiComm& comm, std::uint64_t seed, std::size_t count) {
  const int n = comm.size(), me = comm.rank();
  std::uint64_t salt = 100;
  for (auto op : all_ops)
    for (bool in_place : {false, true}) {
      ++salt;
      CAPTURE(std::string(lockstep::name_of(lockstep::dtype_of<T>)));
      CAPTURE(count); CAPTURE(std::string(lockstep::name_of(op))); CAPTURE(in_place); CAPTURE(me);
      auto send = input<T>(seed, salt, me, count);
      const auto original = send;
      std::vector<T> recv(count, T(1));
      void* out = in_place ? static_cast<void*>(send.data()) : recv.data();
      comm.all_reduce(send.data(), out, count, lockstep::dtype_of<T>, op).wait();
      const auto& got = in_place ? send : recv;
      CHECK(count_wrong<T>(got.data(), count, seed, salt, n, op) == 0);
      if (!in_place) CHECK(send == original);  // out of place leaves the input alone
      CHECK(same_on_all_ranks(got));           // every rank holds the same bits
    }
}

template <class T>
void check_broadcast(lockstep::MpiComm& comm, std::uint64_t seed, std::size_t count) {
  const int n = comm.size(), me = comm.rank();
  for (int root : {0, n - 1}) {
    const std::uint64_t salt = 200 + static_cast<std::uint64_t>(root);
    CAPTURE(count); CAPTURE(root); CAPTURE(me);
    auto buf = input<T>(seed, salt, me, count);
    comm.broadcast(buf.data(), count, lockstep::dtype_of<T>, root).wait();
    CHECK(buf == input<T>(seed, salt, root, count));
  }
}

template <class T>
void check_all_gather(lockstep::MpiComm& comm, std::uint64_t seed, std::size_t count) {
  const int n = comm.size(), me = comm.rank();
  std::vector<T> ref;
  for (int r = 0; r < n; ++r) {
    auto part = input<T>(seed, 300, r, count);
    ref.insert(ref.end(), part.begin(), part.end());
  }
  CAPTURE(count); CAPTURE(me);
  {  // out of place
    auto send = input<T>(seed, 300, me, count);
    std::vector<T> recv(count * static_cast<std::size_t>(n), T(1));
    comm.all_gather(send.data(), recv.data(), count, lockstep::dtype_of<T>).wait();
    CHECK(recv == ref);
  }
  {  // in place: this rank's block already sits in recv
    std::vector<T> recv(count * static_cast<std::size_t>(n), T(1));
    auto mine = input<T>(seed, 300, me, count);
    std::copy(mine.begin(), mine.end(), recv.begin() + static_cast<std::ptrdiff_t>(count * static_cast<std::size_t>(me)));
    comm.all_gather(recv.data() + count * static_cast<std::size_t>(me), recv.data(), count,
                    lockstep::dtype_of<T>).wait();
    CHECK(recv == ref);
  }
  {  // send at the start of recv: in place for rank 0, an overlap staged through a copy elsewhere
    std::vector<T> recv(count * static_cast<std::size_t>(n), T(1));
    auto mine = input<T>(seed, 300, me, count);
    std::copy(mine.begin(), mine.end(), recv.begin());
    comm.all_gather(recv.data(), recv.data(), count, lockstep::dtype_of<T>).wait();
    CHECK(recv == ref);
  }
}

template <class T>
void check_reduce_scatter(lockstep::MpiComm& comm, std::uint64_t seed, std::size_t count) {
  const int n = comm.size(), me = comm.rank();
  const std::size_t total = count * static_cast<std::size_t>(n), first = count * static_cast<std::size_t>(me);
  std::uint64_t salt = 400;
  for (auto op : all_ops)
    for (int mode : {0, 1, 2}) {  // 0 out of place, 1 recv == send, 2 recv = send + rank·count
      ++salt;
      CAPTURE(std::string(lockstep::name_of(lockstep::dtype_of<T>)));
      CAPTURE(count); CAPTURE(std::string(lockstep::name_of(op))); CAPTURE(mode); CAPTURE(me);
      auto send = input<T>(seed, salt, me, total);
      const auto original = send;
      std::vector<T> recv(count, T(1));
      T* out = mode == 0 ? recv.data() : mode == 1 ? send.data() : send.data() + first;
      comm.reduce_scatter(send.data(), out, count, lockstep::dtype_of<T>, op).wait();
      CHECK(count_wrong<T>(out, count, seed, salt, n, op, first) == 0);
      if (mode == 0) CHECK(send == original);
    }
}

template <class T>
void check_everything(lockstep::MpiComm& comm, std::uint64_t seed, std::vector<std::size_t> counts) {
  for (auto c : counts) {
    check_all_reduce<T>(comm, seed, c);
    check_broadcast<T>(comm, seed, c);
    // Gather and reduce-scatter move size()·count elements: keep the large case near 1M in all.
    const std::size_t per_rank = c >= large ? (c / static_cast<std::size_t>(comm.size())) | 1 : c;
    check_all_gather<T>(comm, seed, per_rank);
    check_reduce_scatter<T>(comm, seed, per_rank);
  }
}

}  // namespace

TEST_SUITE("mpi") {

TEST_CASE("MpiComm::world and run(Mpi): ranks, sizes, local ranks") {
  auto comm = lockstep::MpiComm::world();
  CHECK(comm.rank() == world_rank());
  CHECK(comm.size() == world_size());
  CHECK(comm.size() >= 2);  // the tests are meant to run under mpirun -np ≥ 2
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

TEST_CASE_TEMPLATE("every collective matches the reference (lengths 0, 1, 7, 2^20+3)", T, double, float,
                   std::int32_t) {
  const auto seed = shared_seed();
  CAPTURE(seed);
  auto comm = lockstep::MpiComm::world();
  check_everything<T>(comm, seed, {0, 1, 7, large});
}

TEST_CASE_TEMPLATE("every collective matches the reference (small lengths)", T, std::int64_t, std::uint8_t) {
  const auto seed = shared_seed();
  CAPTURE(seed);
  auto comm = lockstep::MpiComm::world();
  check_everything<T>(comm, seed, {0, 1, 7, 4099});
}

TEST_CASE_TEMPLATE("counts above the per-call limit are split into chunks", T, double, std::int32_t) {
  const auto seed = shared_seed();
  CAPTURE(seed);
  auto comm = lockstep::MpiComm::world();
  comm.set_max_chunk(1000);  // as if MPI's int counts ended at 1000
  check_everything<T>(comm, seed, {999, 1000, 1001, 2501});
}

TEST_CASE_TEMPLATE("MpiComm agrees with ThreadComm (the reference communicator)", T, double, std::int32_t) {
  // Each process replays the whole job with ThreadComm (one thread per MPI rank, on every
  // rank's input) and compares its own rank's result.
  const auto seed = shared_seed();
  CAPTURE(seed);
  auto comm = lockstep::MpiComm::world();
  const int n = comm.size(), me = comm.rank();
  constexpr std::size_t count = 3001;
  const auto t = lockstep::dtype_of<T>;
  for (auto op : all_ops) {
    CAPTURE(std::string(lockstep::name_of(op)));
    const std::uint64_t salt = 600 + static_cast<std::uint64_t>(op);
    std::vector<std::vector<T>> ar(static_cast<std::size_t>(n)), rs(ar.size());
    lockstep::run(lockstep::Threads{n}, [&](lockstep::context<lockstep::ThreadComm>& ctx) {
      const auto r = static_cast<std::size_t>(ctx.rank());
      ar[r] = input<T>(seed, salt, ctx.rank(), count);
      ctx.comm().all_reduce(ar[r].data(), ar[r].data(), count, t, op).wait();
      auto send = input<T>(seed, salt + 50, ctx.rank(), count * static_cast<std::size_t>(n));
      rs[r].resize(count);
      ctx.comm().reduce_scatter(send.data(), rs[r].data(), count, t, op).wait();
    });
    auto mine = input<T>(seed, salt, me, count);
    comm.all_reduce(mine.data(), mine.data(), count, t, op).wait();
    auto send = input<T>(seed, salt + 50, me, count * static_cast<std::size_t>(n));
    std::vector<T> block(count);
    comm.reduce_scatter(send.data(), block.data(), count, t, op).wait();
    const double tol = std::is_floating_point_v<T> ? 1e-14 : 0.0;
    CHECK(lockstep_test::max_rel_diff(mine, ar[static_cast<std::size_t>(me)]) <= tol);
    CHECK(lockstep_test::max_rel_diff(block, rs[static_cast<std::size_t>(me)]) <= tol);
  }
}

TEST_CASE("works: in flight together, waited out of order, destroyed unwaited") {
  const auto seed = shared_seed();
  CAPTURE(seed);
  auto comm = lockstep::MpiComm::world();
  const int n = comm.size(), me = comm.rank();
  constexpr std::size_t count = 10007;
  std::vector<std::vector<double>> bufs;
  for (std::uint64_t s = 0; s < 3; ++s) bufs.push_back(input<double>(seed, 500 + s, me, count));
  {
    auto w0 = comm.all_reduce(bufs[0].data(), bufs[0].data(), count, dtype::f64, reduce_op::sum);
    auto w1 = comm.all_reduce(bufs[1].data(), bufs[1].data(), count, dtype::f64, reduce_op::avg);
    auto w2 = comm.all_reduce(bufs[2].data(), bufs[2].data(), count, dtype::f64, reduce_op::max);
    CHECK(comm.sequence() == 3);
    w2.wait();
    CHECK(w2.done());
    auto moved = std::move(w0);  // the moved-to handle owns the collective
    moved.wait();
    w0.wait();                   // a moved-from work is complete
    // w1 is never waited: its destructor waits, and the average's division still happens.
  }
  const reduce_op ops[] = {reduce_op::sum, reduce_op::avg, reduce_op::max};
  for (std::size_t k = 0; k < 3; ++k) {
    CAPTURE(k);
    CHECK(count_wrong<double>(bufs[k].data(), count, seed, 500 + k, n, ops[k]) == 0);
  }
  comm.barrier();
  CHECK(comm.sequence() == 4);
}

TEST_CASE("errors: unsupported types, bad roots, failed MPI calls") {
  auto comm = lockstep::MpiComm::world();
  std::vector<std::uint16_t> h(4, 1);
  CHECK_THROWS_AS(comm.all_reduce(h.data(), h.data(), 4, dtype::f16, reduce_op::sum), lockstep::config_error);
  CHECK_THROWS_AS(comm.broadcast(h.data(), 4, dtype::bf16, 0), lockstep::config_error);
  std::vector<float> f(4, 1.0f);
  CHECK_THROWS_AS(comm.broadcast(f.data(), 4, dtype::f32, comm.size()), lockstep::config_error);
  CHECK_THROWS_AS(comm.broadcast(f.data(), 4, dtype::f32, -1), lockstep::config_error);
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

TEST_CASE("a collective a peer never joins times out instead of hanging") {
  // A private communicator that rank 0 alone uses: its all-reduce can never complete.
  lockstep::MpiComm lonely(MPI_COMM_WORLD, std::chrono::milliseconds(800));
  const int me = lonely.rank();
  // MPI may write into the buffer whenever the collective completes: keep it alive.
  static std::vector<std::int64_t> buf(3, 7);
  if (me == 0) {
    const auto t0 = std::chrono::steady_clock::now();
    std::string what;
    try {
      lonely.all_reduce(buf.data(), buf.data(), buf.size(), dtype::i64, reduce_op::sum).wait();
    } catch (const lockstep::timeout_error& e) {
      what = e.what();
    }
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    CHECK(secs >= 0.79);
    CHECK(secs < 10.0);
    CHECK(what.find("all_reduce #0 of 3 i64 (sum)") != std::string::npos);
    CHECK(what.find("0.8 s") != std::string::npos);
    // Broken from now on: no second wait for a peer that is not coming.
    CHECK_THROWS_AS(lonely.barrier(), lockstep::aborted_error);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  // Let rank 0's orphaned all-reduce complete so the job ends cleanly (rank 0 drives MPI's
  // progress from the barrier below).
  if (me != 0) lonely.all_reduce(buf.data(), buf.data(), buf.size(), dtype::i64, reduce_op::sum).wait();
  MPI_Barrier(MPI_COMM_WORLD);
}

}  // TEST_SUITE
