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

#include "deterministic_grads.hpp"
#include "equivalence.hpp"
#include "equivalence_run.hpp"
#include "mlp.hpp"
#include "mpi_util.hpp"

using namespace lockstep_test;
using namespace lockstep_mpi_test;

namespace {

using config = equivalence_config;

template <class T, bool Bindable>
void check_equivalence(lockstep::context<lockstep::MpiComm>& ctx, const config& c) {
  const auto seed = shared_seed();
  CAPTURE(seed);
  CAPTURE(ctx.rank());
  CAPTURE(ctx.size());
  CAPTURE(c);  // batch, accumulate, hooks, bucket size
  CAPTURE(Bindable);
  const auto d = make_data(seed, 997);
  lockstep::sync_stats st;
  const auto [ref, got] = reference_and_run<T>(d, c, ctx.size(), seed + 1, [&](auto acc) {
    return data_parallel_rank<T, Bindable>(ctx, d, c, seed + 1, equivalence_lr, acc, st);
  });
  CHECK(max_rel_diff(got, ref) <= equivalence_tolerance<T>);
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
  const config c{.batch = 2, .accumulate = 4};
  lockstep::sync_stats st;
  auto got = data_parallel_rank<double, true>(ctx, d, c, seed, 0.1, lockstep::Accumulate<4>{}, st);
  CHECK(max_rel_diff(got, equivalence_reference<double>(d, c, ctx.size(), seed, 0.1)) <= 1e-12);
  CHECK(same_on_all_ranks(got));
}

TEST_CASE("deterministic_over_mpi: the same bits as ThreadComm ranks splitting the batch otherwise") {
  // 12 micro-batches a step over the processes (np 2: 6 micro-steps each; np 4: 3); the
  // reference, in every process: 3 ThreadComm ranks × 4. Values over 20 binades, one clamped.
  lockstep::context<lockstep::MpiComm> ctx(lockstep::MpiComm::world(), 0, -1);
  const auto seed = shared_seed();
  CAPTURE(seed);
  REQUIRE(12 % ctx.size() == 0);
  std::mt19937_64 rng(seed);
  auto v = random_grads(rng, 3, 12, -20, 0);
  v[1][5][2][9] = 5.0f;
  const lockstep::DeterministicOptions o{.margin_bits = 2, .initial_exponent = 1};
  const auto ref = run_grads(v, {3, 4}, o);
  grad_run got;
  grads_on_rank(ctx, v, {ctx.size(), 12 / ctx.size()}, o, nullptr, got);
  if (ctx.rank() == 0) {
    CHECK(got.grads == ref.grads);
    CHECK(got.exponents == ref.exponents);
    CHECK(got.reports[1].clamped == ref.reports[1].clamped);
  }
}
TEST_CASE_TEMPLATE("low-precision wires over MPI: the numbers of ThreadComm ranks bit for bit", Wire,
                   lockstep::Bf16Wire, lockstep::Int8Wire) {
  // Every process draws every rank's bucket (a shared seed); the reference, in every process:
  // the same wire on as many ThreadComm ranks. The all-reduce's count is a multiple of 4 (a tail
  // is each communicator's own fp32 mean, summed in MPI's order), the reduce-scatter's any.
  lockstep::context<lockstep::MpiComm> ctx(lockstep::MpiComm::world(), 0, -1);
  const auto seed = shared_seed();
  CAPTURE(seed);
  const int n = ctx.size();
  const std::size_t count = 4 * 777, per = 301;
  std::mt19937_64 rng(seed);
  std::vector<std::vector<float>> x;
  for (int r = 0; r < n; ++r)
    x.push_back(random_vector<float>(count + per * static_cast<std::size_t>(n), rng, -3.0, 3.0));
  // Rank r's all-reduce result, then its reduce-scatter block.
  const auto on = [&](auto& comm, int r) {
    auto a = x[static_cast<std::size_t>(r)];
    float* b = a.data() + count;
    Wire w;
    w.reduce(comm, a.data(), count, lockstep::dtype::f32).wait();
    w.reduce_scatter(comm, b, b + static_cast<std::size_t>(r) * per, per, lockstep::dtype::f32).wait();
    std::vector<float> out(a.begin(), a.begin() + static_cast<std::ptrdiff_t>(count));
    out.insert(out.end(), b + static_cast<std::size_t>(r) * per, b + static_cast<std::size_t>(r + 1) * per);
    return out;
  };
  std::vector<std::vector<float>> ref(static_cast<std::size_t>(n));
  lockstep::run(lockstep::Threads{n},
                [&](auto& tctx) { ref[static_cast<std::size_t>(tctx.rank())] = on(tctx.comm(), tctx.rank()); });
  const auto got = on(ctx.comm(), ctx.rank());
  CHECK(got == ref[static_cast<std::size_t>(ctx.rank())]);
  CHECK(got !=
        std::vector<float>(x[static_cast<std::size_t>(ctx.rank())].begin(),
                           x[static_cast<std::size_t>(ctx.rank())].begin() + static_cast<std::ptrdiff_t>(got.size())));
}
// ShardedOptimizer::gather_wire's all-gather (parallel/detail/value_wire.hpp) over MPI: every
// process draws every rank's master and one replica (a shared seed); the result equals the same
// gather on as many ThreadComm ranks, bit for bit, for both codecs, deltas and values.
TEST_CASE("value gather wire over MPI: the numbers of ThreadComm ranks bit for bit") {
  lockstep::context<lockstep::MpiComm> ctx(lockstep::MpiComm::world(), 0, -1);
  const auto seed = shared_seed();
  CAPTURE(seed);
  const int n = ctx.size();
  const std::size_t per = 611;
  std::mt19937_64 rng(seed);
  const auto replica = random_vector<float>(per * static_cast<std::size_t>(n), rng, -2.0, 2.0);
  std::vector<std::vector<float>> masters;
  for (int r = 0; r < n; ++r) {
    masters.push_back(replica);  // near the replica, as after an update
    auto step = random_vector<float>(per, rng, -0.01, 0.01);
    for (std::size_t i = 0; i < per; ++i) masters.back()[static_cast<std::size_t>(r) * per + i] += step[i];
  }
  using lockstep::wire_format;
  for (const auto f : {wire_format::bf16, wire_format::int8})
    for (const bool deltas : {true, false}) {
      CAPTURE(deltas);
      const auto on = [&](auto& comm, int r) {
        auto unit = replica;
        lockstep::wire_staging st;
        const float* master = masters[static_cast<std::size_t>(r)].data() + static_cast<std::size_t>(r) * per;
        lockstep::detail::value_gather(comm, st, f, master, unit.data(), per, deltas).wait();
        return unit;
      };
      std::vector<std::vector<float>> ref(static_cast<std::size_t>(n));
      lockstep::run(lockstep::Threads{n},
                    [&](auto& tctx) { ref[static_cast<std::size_t>(tctx.rank())] = on(tctx.comm(), tctx.rank()); });
      const auto got = on(ctx.comm(), ctx.rank());
      CHECK(got == ref[static_cast<std::size_t>(ctx.rank())]);
      CHECK(got == ref[0]);   // every rank the same replica
      CHECK(got != replica);  // the gather changed it
    }
}
}  // TEST_SUITE
