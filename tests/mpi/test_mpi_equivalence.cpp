// The key property over MPI: N processes with batch B each end with the same parameters as
// one rank with batch N·B over the same samples (DataParallel<TestMlp<T>, MpiComm>), with
// accumulation, tiny buckets, zero-copy or packed gradients, with and without overlap hooks.
// Every process computes the one-rank reference itself (plain loop, no lockstep).
#include <doctest/doctest.h>

#include <cstdint>
#include <random>
#include <type_traits>
#include <vector>

#include <lockstep/lockstep.hpp>
#include <lockstep/mpi/mpi_comm.hpp>
#include <lockstep/mpi/run_mpi.hpp>

#include "equivalence.hpp"
#include "mlp.hpp"
#include "mpi_util.hpp"

using namespace lockstep_test;
using namespace lockstep_mpi_test;

namespace {

struct config {
  std::size_t batch = 4;  // per rank, per micro-step
  int accumulate = 1;
  int steps = 4;  // optimizer steps
  bool hooks = true;
  lockstep::BucketPolicy buckets{};
};

// One rank, batch N·K·B per optimizer step.
template <class T>
std::vector<T> reference(const dataset& d, const config& c, int ranks, std::uint64_t init_seed, double lr) {
  return one_rank_reference<T>(d, c.batch, ranks, c.accumulate, c.steps, init_seed, lr);
}

// This process' rank of the data-parallel run: batch B of the N·K·B samples of each step.
template <class T, bool Bindable, class Acc>
std::vector<T> data_parallel(lockstep::context<lockstep::MpiComm>& ctx, const dataset& d, const config& c,
                             std::uint64_t init_seed, double lr, Acc acc, lockstep::sync_stats& stats) {
  // Different initial values per rank: construction must broadcast rank 0's.
  TestMlp<T, Bindable> m(d.dims, init_seed + static_cast<std::uint64_t>(ctx.rank()) * 7919);
  lockstep::DataParallel<TestMlp<T, Bindable>, lockstep::MpiComm, Acc> dp(ctx, m, {.buckets = c.buckets}, acc);
  const int ranks = ctx.size();
  const std::size_t global = c.batch * static_cast<std::size_t>(ranks * c.accumulate);
  for (int s = 0; s < c.steps; ++s) {
    for (int k = 0; k < c.accumulate; ++k) {
      auto step = dp.step();
      CHECK(step.synchronizes() == (k + 1 == c.accumulate));
      std::vector<std::size_t> rows(c.batch);
      const std::size_t first =
          static_cast<std::size_t>(s) * global + (static_cast<std::size_t>(k) * ranks + ctx.rank()) * c.batch;
      for (std::size_t i = 0; i < c.batch; ++i) rows[i] = (first + i) % d.samples;
      if (c.hooks) m.forward_backward(inputs<T>(d), d.y, rows, step.on_gradient_ready());
      else m.forward_backward(inputs<T>(d), d.y, rows, [](std::size_t) {});
      auto r = step.finish();
      CHECK(r.synced == (k + 1 == c.accumulate));
      if (r) m.sgd(lr);
    }
  }
  stats = dp.stats();
  return m.flat_values();
}

template <class T, bool Bindable>
void check_equivalence(lockstep::context<lockstep::MpiComm>& ctx, const config& c) {
  const auto seed = shared_seed();
  CAPTURE(seed);
  CAPTURE(ctx.rank());
  CAPTURE(ctx.size());
  CAPTURE(c.batch);
  CAPTURE(c.accumulate);
  CAPTURE(c.hooks);
  CAPTURE(Bindable);
  CAPTURE(c.buckets.cap_bytes);
  const double tol = std::is_same_v<T, double> ? 1e-12 : 1e-5;
  const auto d = make_data(seed, 997);
  const double lr = 0.2;
  const auto ref = reference<T>(d, c, ctx.size(), seed + 1, lr);
  lockstep::sync_stats st;
  std::vector<T> got;
  if (c.accumulate == 1) got = data_parallel<T, Bindable>(ctx, d, c, seed + 1, lr, lockstep::EveryStep{}, st);
  else got = data_parallel<T, Bindable>(ctx, d, c, seed + 1, lr, lockstep::Accumulate<>(c.accumulate), st);
  // The parameters moved (the comparison is not between initial values).
  TestMlp<T> init(d.dims, seed + 1);
  CHECK(max_rel_diff(init.flat_values(), ref) > 1e-3);
  CHECK(max_rel_diff(got, ref) <= tol);
  CHECK(same_on_all_ranks(got));  // all processes agree bit for bit
  CHECK(st.zero_copy == Bindable);
  CHECK(st.buckets_reduced > 0);
  CHECK(st.syncs == static_cast<std::uint64_t>(c.steps));
}

template <class T>
void check_all_variants(lockstep::context<lockstep::MpiComm>& ctx) {
  config c;
  check_equivalence<T, true>(ctx, c);
  check_equivalence<T, false>(ctx, c);
  for (int k : {2, 3}) {
    config a;
    a.accumulate = k;
    a.batch = 3;
    check_equivalence<T, true>(ctx, a);
    check_equivalence<T, false>(ctx, a);
  }
  config tiny;
  tiny.buckets = {.first_bytes = 40, .cap_bytes = 136};  // weights span many buckets
  check_equivalence<T, true>(ctx, tiny);
  check_equivalence<T, false>(ctx, tiny);
  tiny.hooks = false;  // a model that never reports: everything is reduced in finish()
  check_equivalence<T, true>(ctx, tiny);
  tiny.accumulate = 2;
  check_equivalence<T, false>(ctx, tiny);
}

}  // namespace

TEST_SUITE("mpi") {

TEST_CASE_TEMPLATE("equivalence over MPI: N processes × batch B == 1 rank × batch N·B", T, double, float) {
  lockstep::run(lockstep::Mpi{}, [](lockstep::context<lockstep::MpiComm>& ctx) { check_all_variants<T>(ctx); });
}

TEST_CASE("frozen parameters over MPI: rank 0's table on every process after construction") {
  lockstep::context<lockstep::MpiComm> ctx(lockstep::MpiComm::world(), 0, -1);
  const auto seed = shared_seed();
  CAPTURE(seed);
  const TestMlpWithFrozen<double> rank0({5, 4, 3}, seed, seed + 100);
  const auto r = static_cast<std::uint64_t>(ctx.rank());
  TestMlpWithFrozen<double> m({5, 4, 3}, seed + r, seed + 100 + r);
  if (ctx.size() > 1 && ctx.rank() == 1) REQUIRE(m.table() != rank0.table());
  lockstep::DataParallel dp(ctx, m);
  CHECK(m.table() == rank0.table());
  CHECK(dp.parameters().size() == 4);
}

TEST_CASE("Accumulate<4> at compile time over MPI matches the reference") {
  lockstep::context<lockstep::MpiComm> ctx(lockstep::MpiComm::world(), 0, -1);
  const auto seed = shared_seed();
  CAPTURE(seed);
  const auto d = make_data(seed, 301);
  config c;
  c.accumulate = 4;
  c.batch = 2;
  lockstep::sync_stats st;
  auto got = data_parallel<double, true>(ctx, d, c, seed, 0.1, lockstep::Accumulate<4>{}, st);
  CHECK(max_rel_diff(got, reference<double>(d, c, ctx.size(), seed, 0.1)) <= 1e-12);
  CHECK(same_on_all_ranks(got));
}

}  // TEST_SUITE
