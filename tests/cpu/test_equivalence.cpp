// The key property: N ranks with batch B each end with the same parameters as one rank
// with batch N·B over the same samples — with accumulation, tiny buckets, zero-copy or
// packed gradients, and with or without overlap hooks.
#include <doctest/doctest.h>

#include <lockstep/lockstep.hpp>

#include "equivalence.hpp"
#include "equivalence_run.hpp"
#include "mlp.hpp"
#include "test_util.hpp"

using namespace lockstep_test;

namespace {

struct config : equivalence_config {
  int ranks = 2;
};

template <class T, bool Bindable, class Acc>
std::vector<std::vector<T>> data_parallel(const dataset& d, const config& c, std::uint64_t init_seed, double lr,
                                          Acc acc, lockstep::sync_stats* stats0 = nullptr) {
  std::vector<std::vector<T>> out(static_cast<std::size_t>(c.ranks));
  lockstep::run(lockstep::Threads{c.ranks}, [&](auto& ctx) {
    lockstep::sync_stats st;
    out[static_cast<std::size_t>(ctx.rank())] = data_parallel_rank<T, Bindable>(ctx, d, c, init_seed, lr, acc, st);
    if (stats0 && ctx.rank() == 0) *stats0 = st;
  });
  return out;
}

template <class T, bool Bindable>
void check_equivalence(const config& c) {
  const auto seed = fresh_seed();
  CAPTURE(seed);
  CAPTURE(c);  // batch, accumulate, hooks, bucket size
  CAPTURE(c.ranks);
  CAPTURE(Bindable);
  const auto d = make_data(seed, 997);
  lockstep::sync_stats st;
  const auto [ref, got] = reference_and_run<T>(d, c, c.ranks, seed + 1, [&](auto acc) {
    return data_parallel<T, Bindable>(d, c, seed + 1, equivalence_lr, acc, &st);
  });
  for (int r = 0; r < c.ranks; ++r) {
    CAPTURE(r);
    CHECK(max_rel_diff(got[static_cast<std::size_t>(r)], ref) <= equivalence_tolerance<T>);
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
  CHECK(max_rel_diff(a[0], equivalence_reference<double>(d, c, c.ranks, seed, 0.1)) <= 1e-12);
}

}  // TEST_SUITE
