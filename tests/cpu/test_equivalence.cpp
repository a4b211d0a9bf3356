// The key property: N ranks with batch B each end with the same parameters as one rank
// with batch N·B over the same samples — with accumulation, tiny buckets, zero-copy or
// packed gradients, and with or without overlap hooks.
#include <doctest/doctest.h>

#include <lockstep/lockstep.hpp>

#include "equivalence.hpp"
#include "mlp.hpp"
#include "test_util.hpp"

using namespace lockstep_test;

namespace {

struct config {
  int ranks = 2;
  std::size_t batch = 4;  // per rank, per micro-step
  int accumulate = 1;
  int steps = 4;  // optimizer steps
  bool hooks = true;
  lockstep::BucketPolicy buckets{};
};

// One rank, batch N·K·B per optimizer step, plain loop (no lockstep).
template <class T>
std::vector<T> reference(const dataset& d, const config& c, std::uint64_t init_seed, double lr) {
  return one_rank_reference<T>(d, c.batch, c.ranks, c.accumulate, c.steps, init_seed, lr);
}

template <class T, bool Bindable, class Acc>
std::vector<std::vector<T>> data_parallel(const dataset& d, const config& c, std::uint64_t init_seed, double lr,
                                          Acc acc, lockstep::sync_stats* stats0 = nullptr) {
  std::vector<std::vector<T>> out(static_cast<std::size_t>(c.ranks));
  lockstep::run(lockstep::Threads{c.ranks}, [&](auto& ctx) {
    // Different initial values per rank: construction must broadcast rank 0's.
    TestMlp<T, Bindable> m(d.dims, init_seed + static_cast<std::uint64_t>(ctx.rank()) * 7919);
    lockstep::DataParallel<TestMlp<T, Bindable>, lockstep::ThreadComm, Acc> dp(ctx, m, {.buckets = c.buckets}, acc);
    const std::size_t global = c.batch * static_cast<std::size_t>(c.ranks * c.accumulate);
    for (int s = 0; s < c.steps; ++s) {
      for (int k = 0; k < c.accumulate; ++k) {
        auto step = dp.step();
        CHECK(step.synchronizes() == (k + 1 == c.accumulate));
        std::vector<std::size_t> rows(c.batch);
        const std::size_t first =
            static_cast<std::size_t>(s) * global + (static_cast<std::size_t>(k) * c.ranks + ctx.rank()) * c.batch;
        for (std::size_t i = 0; i < c.batch; ++i) rows[i] = (first + i) % d.samples;
        if (c.hooks) m.forward_backward(inputs<T>(d), d.y, rows, step.on_gradient_ready());
        else m.forward_backward(inputs<T>(d), d.y, rows, [](std::size_t) {});
        auto r = step.finish();
        CHECK(r.synced == (k + 1 == c.accumulate));
        if (r) m.sgd(lr);
      }
    }
    out[static_cast<std::size_t>(ctx.rank())] = m.flat_values();
    if (stats0 && ctx.rank() == 0) *stats0 = dp.stats();
  });
  return out;
}

template <class T, bool Bindable>
void check_equivalence(const config& c) {
  const auto seed = fresh_seed();
  CAPTURE(seed);
  CAPTURE(c.ranks);
  CAPTURE(c.batch);
  CAPTURE(c.accumulate);
  CAPTURE(c.hooks);
  CAPTURE(Bindable);
  CAPTURE(c.buckets.cap_bytes);
  const double tol = std::is_same_v<T, double> ? 1e-12 : 1e-5;
  auto d = make_data(seed, 997);
  const double lr = 0.2;
  auto ref = reference<T>(d, c, seed + 1, lr);
  lockstep::sync_stats st;
  std::vector<std::vector<T>> got;
  if (c.accumulate == 1) got = data_parallel<T, Bindable>(d, c, seed + 1, lr, lockstep::EveryStep{}, &st);
  else got = data_parallel<T, Bindable>(d, c, seed + 1, lr, lockstep::Accumulate<>(c.accumulate), &st);
  // The parameters moved (the comparison is not trivially between initial values).
  TestMlp<T> init(d.dims, seed + 1);
  CHECK(max_rel_diff(init.flat_values(), ref) > 1e-3);
  for (int r = 0; r < c.ranks; ++r) {
    CAPTURE(r);
    CHECK(max_rel_diff(got[static_cast<std::size_t>(r)], ref) <= tol);
    // All ranks agree bit for bit (same reduced gradients, same updates).
    CHECK(got[static_cast<std::size_t>(r)] == got[0]);
  }
  CHECK(st.zero_copy == Bindable);
  if (c.ranks > 1) CHECK(st.buckets_reduced > 0);
  CHECK(st.syncs == static_cast<std::uint64_t>(c.steps));
}

}  // namespace

TEST_SUITE("cpu") {

TEST_CASE_TEMPLATE("equivalence: N ranks × batch B == 1 rank × batch N·B", T, double, float) {
  for (int n : {1, 2, 3, 4}) {
    config c;
    c.ranks = n;
    check_equivalence<T, true>(c);
    check_equivalence<T, false>(c);
  }
}

TEST_CASE_TEMPLATE("equivalence with Accumulate<K> (no_sync micro-steps)", T, double, float) {
  for (int n : {1, 2, 3, 4})
    for (int k : {2, 3}) {
      config c;
      c.ranks = n;
      c.accumulate = k;
      c.batch = 3;
      check_equivalence<T, true>(c);
      check_equivalence<T, false>(c);
    }
}

TEST_CASE_TEMPLATE("equivalence with buckets smaller than one tensor", T, double, float) {
  for (int n : {2, 3, 4}) {
    config c;
    c.ranks = n;
    c.buckets = {.first_bytes = 40, .cap_bytes = 136};  // weights span many buckets
    check_equivalence<T, true>(c);
    check_equivalence<T, false>(c);
    c.hooks = false;  // a model that never reports: everything is reduced in finish()
    check_equivalence<T, true>(c);
    c.accumulate = 2;
    check_equivalence<T, false>(c);
  }
}

TEST_CASE("Accumulate<4> at compile time matches the run-time K") {
  const auto seed = fresh_seed();
  CAPTURE(seed);
  auto d = make_data(seed, 301);
  config c;
  c.ranks = 3;
  c.accumulate = 4;
  c.batch = 2;
  auto a = data_parallel<double, true>(d, c, seed, 0.1, lockstep::Accumulate<4>{});
  auto b = data_parallel<double, true>(d, c, seed, 0.1, lockstep::Accumulate<>(4));
  CHECK(a == b);
  CHECK(max_rel_diff(a[0], reference<double>(d, c, seed, 0.1)) <= 1e-12);
}

}  // TEST_SUITE
