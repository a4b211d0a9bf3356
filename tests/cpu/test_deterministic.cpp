// lockstep::Deterministic on CPU ranks (ThreadComm): the parameters after training have the same
// bits however a global batch of fixed micro-batches is split over ranks and micro-steps, with
// any bucket sizes, zero-copy or packed, sharded or not, with loss scaling and clipping — where
// the ordinary mean differs (so the comparison can fail); the sums against an fp64 reference;
// values beyond the range, non-finite and underflowing values reported; the exponents restored
// make a resumed run bit-identical. (GPU: tests/cuda/test_deterministic_gpu.cu.)
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <span>
#include <type_traits>
#include <vector>

#include <lockstep/lockstep.hpp>

#include "deterministic_grads.hpp"
#include "equivalence.hpp"
#include "mlp.hpp"
#include "test_util.hpp"

using namespace lockstep_test;

namespace {

constexpr std::size_t micro_rows = 3;  // the micro-batch size every split keeps

struct setup {
  std::size_t first_bytes = std::size_t{1} << 20, cap_bytes = std::size_t{25} << 20;
  bool zero_copy = true;
  double max_grad_norm = 0;
  int steps = 5;
};

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// Trains TestMlp<float> for o.steps optimizer steps over micro-batches of micro_rows rows,
// ranks × accumulate of them per step (micro-batch j of step s: rows from (s·M + j)·micro_rows);
// returns rank 0's parameters (every rank's must be the same bits).
template <class Hook, class Strategy = lockstep::Replicated, class Scaler = lockstep::NoScaling>
std::vector<float> train(const dataset& d, split sp, std::uint64_t seed, setup o = {}) {
  std::vector<std::vector<float>> out(static_cast<std::size_t>(sp.ranks));
  lockstep::run(lockstep::Threads{sp.ranks}, [&](auto& ctx) {
    using Comm = std::remove_cvref_t<decltype(ctx.comm())>;
    TestMlp<float> m(d.dims, seed + static_cast<std::uint64_t>(ctx.rank()));  // rank 0's values win
    lockstep::DataParallel<TestMlp<float>, Comm, Hook, Strategy, Scaler, lockstep::Accumulate<>> dp(
        ctx, m,
        {.buckets = {.first_bytes = o.first_bytes, .cap_bytes = o.cap_bytes},
         .zero_copy = o.zero_copy,
         .max_grad_norm = o.max_grad_norm},
        lockstep::Accumulate<>(sp.accumulate));
    lockstep::AdamW opt({.lr = 0.01, .weight_decay = 0.01});
    const std::size_t per_step = static_cast<std::size_t>(sp.ranks * sp.accumulate);
    for (int s = 0; s < o.steps; ++s)
      for (int k = 0; k < sp.accumulate; ++k) {
        auto st = dp.step();
        const std::size_t j = static_cast<std::size_t>(k * sp.ranks + ctx.rank());
        std::vector<std::size_t> rows(micro_rows);
        for (std::size_t i = 0; i < micro_rows; ++i)
          rows[i] = ((static_cast<std::size_t>(s) * per_step + j) * micro_rows + i) % d.samples;
        m.forward_backward(inputs<float>(d), d.y, rows, st.on_gradient_ready(), st.loss_scale());
        if constexpr (!std::is_same_v<Strategy, lockstep::Replicated>) {
          (void)st.finish([&](std::span<const lockstep::param_slice> sl) { opt.step(sl); });
        } else {
          const auto r = st.finish();
          if (r.synced && r.applied) opt.step(m.parameters());
        }
      }
    dp.wait_all_parameters();
    out[static_cast<std::size_t>(ctx.rank())] = m.flat_values();
  });
  for (int r = 1; r < sp.ranks; ++r) REQUIRE(same_bits(out[static_cast<std::size_t>(r)], out[0]));
  return out[0];
}

const split splits_of_12[] = {{1, 12}, {2, 6}, {3, 4}, {4, 3}};

}  // namespace

TEST_SUITE("cpu") {
TEST_CASE("deterministic_same_bits_over_ranks_micro_steps_buckets_packing_and_sharding") {
  LOCKSTEP_SEEDED(std::mt19937_64 rng);
  const auto d = make_data(rng(), 200);
  const auto init = rng();
  const auto ref = train<lockstep::Deterministic>(d, {1, 12}, init);
  for (const auto sp : splits_of_12) {
    CAPTURE(sp.ranks);
    CAPTURE(sp.accumulate);
    CHECK(same_bits(train<lockstep::Deterministic>(d, sp, init), ref));
    CHECK(same_bits(train<lockstep::Deterministic>(d, sp, init, {.first_bytes = 200, .cap_bytes = 700}), ref));
    CHECK(same_bits(train<lockstep::Deterministic>(d, sp, init, {.cap_bytes = 300, .zero_copy = false}), ref));
    using Sharded = lockstep::ShardedOptimizer;  // the optimizer on shards: the same bits too
    CHECK(same_bits(train<lockstep::Deterministic, Sharded>(d, sp, init), ref));
    CHECK(same_bits(train<lockstep::Deterministic, Sharded>(d, sp, init, {.first_bytes = 256, .cap_bytes = 512}), ref));
  }
}

TEST_CASE("deterministic_ordinary_mean_differs_over_splits") {
  // The control: without Deterministic the same runs differ in their last bits (so the test
  // above can fail), and stay close (so both train the same model).
  LOCKSTEP_SEEDED(std::mt19937_64 rng);
  const auto d = make_data(rng(), 200);
  const auto init = rng();
  const auto one = train<lockstep::AllReduceMean>(d, {1, 12}, init);
  const auto three = train<lockstep::AllReduceMean>(d, {3, 4}, init);
  CHECK_FALSE(same_bits(one, three));
  CHECK(max_rel_diff(three, one) < 1e-4);
  CHECK(max_rel_diff(train<lockstep::Deterministic>(d, {3, 4}, init), one) < 1e-4);
}

TEST_CASE("deterministic_with_loss_scaling_and_clipping") {
  LOCKSTEP_SEEDED(std::mt19937_64 rng);
  const auto d = make_data(rng(), 200);
  const auto init = rng();
  const setup clip{.max_grad_norm = 0.05, .steps = 4};
  const auto ref = train<lockstep::Deterministic, lockstep::Replicated, lockstep::DynamicScale>(d, {1, 12}, init, clip);
  for (const auto sp : splits_of_12) {
    CAPTURE(sp.ranks);
    CHECK(same_bits(train<lockstep::Deterministic, lockstep::Replicated, lockstep::DynamicScale>(d, sp, init, clip),
                    ref));
  }
}
}

namespace {

double exact_mean(const grad_values& v, std::size_t s, std::size_t p, std::size_t i) {
  double sum = 0;  // exact: a few floats within 2^24 of each other
  for (const auto& mb : v[s]) sum += mb[p][i];
  return sum / static_cast<double>(v[s].size());
}

}  // namespace

TEST_SUITE("cpu") {
TEST_CASE("deterministic_sums_against_fp64") {
  // Each averaged value is the fp64 mean rounded to fp32, give or take the fixed point's own
  // step (0.5 · 2^(E − F) ≤ 2^-43 in the first step's range 2^16, ≤ 2^-51 once the range
  // follows the values): within fp32's rounding for every value not cancelled to below it.
  LOCKSTEP_SEEDED(std::mt19937_64 rng);
  const auto v = random_grads(rng, 2, 6, -20, 0);
  for (const auto sp : {split{1, 6}, split{2, 3}, split{3, 2}}) {
    CAPTURE(sp.ranks);
    const auto r = run_grads(v, sp);
    REQUIRE(r.grads.size() == 2);
    for (std::size_t s = 0; s < 2; ++s) {
      const double slack = s == 0 ? std::exp2(-43) : std::exp2(-51);
      std::size_t bad = 0;
      double worst = 0;
      for (std::size_t p = 0; p < grad_sizes.size(); ++p)
        for (std::size_t i = 0; i < grad_sizes[p]; ++i) {
          const double e = exact_mean(v, s, p, i), got = r.grads[s][p][i];
          const double err = std::abs(got - e), bound = std::exp2(-24) * std::abs(e) + slack;
          if (err > bound) ++bad;
          worst = std::max(worst, err / bound);
        }
      CAPTURE(s);
      CAPTURE(worst);
      CHECK(bad == 0);
    }
    CHECK(r.reports.back().clamped == 0);
    CHECK(r.reports.back().nonfinite == 0);
    // exponents follow the values: the largest is below 2^0, plus the margin of 8
    for (auto e : r.exponents) CHECK(e == 8);
  }
}

TEST_CASE("deterministic_clamps_beyond_the_range_and_reports_it") {
  LOCKSTEP_SEEDED(std::mt19937_64 rng);
  auto v = random_grads(rng, 2, 4, -10, -1);  // |x| < 1 ...
  v[0][3][1][5] = 6.0f;                       // ... but one value of the first step
  v[1][2][1][7] = -5.0f;                      // and one of the second (within the grown range)
  const lockstep::DeterministicOptions o{.margin_bits = 1, .initial_exponent = 0};
  const auto a = run_grads(v, {2, 2}, o), b = run_grads(v, {4, 1}, o);
  REQUIRE(a.grads.size() == 2);
  CHECK(a.reports[0].clamped == 1);  // |6| ≥ 2^0: stored as 1
  CHECK(a.reports[1].clamped == 0);  // the range grew to 2^(3 + 1)
  CHECK(a.reports[1].clamped_total == 1);
  const double expect = (exact_mean(v, 0, 1, 5) * 4 - 6.0 + 1.0) / 4;
  CHECK(std::abs(a.grads[0][1][5] - expect) < 1e-6);
  CHECK(std::abs(a.grads[1][1][7] - exact_mean(v, 1, 1, 7)) < 1e-6);
  CHECK(a.exponents[1] == 4);
  CHECK(a.grads == b.grads);  // clamped the same way, whatever the split
}

TEST_CASE("deterministic_nonfinite_skips_the_step_everywhere") {
  LOCKSTEP_SEEDED(std::mt19937_64 rng);
  auto v = random_grads(rng, 3, 4, -10, 0);
  v[1][2][0][3] = std::numeric_limits<float>::quiet_NaN();
  const auto scaled = run_grads<lockstep::DynamicScale>(v, {2, 2});
  CHECK(scaled.applied == std::vector<bool>{true, false, true});
  CHECK(scaled.reports[1].nonfinite == 1);
  CHECK(scaled.reports[2].nonfinite == 0);
  const auto plain = run_grads(v, {4, 1});  // NoScaling: the step's gradients are NaN, as without lockstep
  bool nan = false;
  for (const auto& p : plain.grads[1])
    for (auto x : p) nan = nan || std::isnan(x);
  CHECK(nan);
}

TEST_CASE("deterministic_reports_underflow") {
  LOCKSTEP_SEEDED(std::mt19937_64 rng);
  auto v = random_grads(rng, 2, 2, -4, 0);
  v[1][0][2][11] = std::exp2(-70.0f);  // below 2^(E − F) = 2^(9 − 61)
  const auto r = run_grads(v, {2, 1});
  CHECK(r.reports[0].underflowed == 0);
  CHECK(r.reports[1].underflowed == 1);
  CHECK(r.grads[1][2][11] == static_cast<float>(exact_mean(v, 1, 2, 11) - std::exp2(-70.0) / 2));
}

TEST_CASE("deterministic_exponents_restored_resume_bit_identical") {
  // A coarse first range (2^40: steps of 2^-19 for values near 2^-4) makes the exponents
  // matter: a resumed run that starts over from it differs; one that loads them does not.
  LOCKSTEP_SEEDED(std::mt19937_64 rng);
  const auto v = random_grads(rng, 4, 4, -12, -4);
  const lockstep::DeterministicOptions o{.initial_exponent = 40};
  const auto whole = run_grads(v, {2, 2}, o);
  const grad_values first(v.begin(), v.begin() + 2), rest(v.begin() + 2, v.end());
  const auto before = run_grads(first, {4, 1}, o);
  const auto resumed = run_grads(rest, {1, 4}, o, &before.exponents);
  const auto restarted = run_grads(rest, {1, 4}, o);
  CHECK(resumed.grads[0] == whole.grads[2]);
  CHECK(resumed.grads[1] == whole.grads[3]);
  CHECK(restarted.grads[0] != whole.grads[2]);
  std::vector<std::int64_t> wrong(2, 0);
  CHECK_THROWS_WITH_AS(run_grads(rest, {1, 1}, o, &wrong),
                       doctest::Contains("exponents are for 2 parameters, this model has 3"),
                       lockstep::checkpoint_error);
  wrong = {0, 400, 0};
  CHECK_THROWS_WITH_AS(run_grads(rest, {1, 1}, o, &wrong), doctest::Contains("(400) is out of range"),
                       lockstep::checkpoint_error);
}
}

TEST_SUITE("cpu") {
TEST_CASE("deterministic_exponents_travel_in_the_training_state") {
  LOCKSTEP_SEEDED(std::mt19937_64 rng);
  const auto v = random_grads(rng, 4, 4, -12, -4);
  const lockstep::DeterministicOptions o{.initial_exponent = 40};
  const auto whole = run_grads(v, {2, 2}, o);
  std::vector<lockstep::Checkpoint> saved(2);
  std::vector<std::vector<std::vector<float>>> after;
  for (int half = 0; half < 2; ++half)
    lockstep::run(lockstep::Threads{2}, [&](auto& ctx) {
      using Comm = std::remove_cvref_t<decltype(ctx.comm())>;
      GradModel m(grad_sizes);
      lockstep::DataParallel<GradModel, Comm, lockstep::Deterministic, lockstep::Accumulate<>> dp(
          ctx, m, lockstep::Deterministic(o), lockstep::Accumulate<>(2));
      auto& ck = saved[static_cast<std::size_t>(ctx.rank())];
      if (half == 1) lockstep::restore_training_state(ck, dp);
      for (int s = 2 * half; s < 2 * half + 2; ++s) {
        for (int k = 0; k < 2; ++k) {
          auto st = dp.step();
          const auto& mb = v[static_cast<std::size_t>(s)][static_cast<std::size_t>(k * 2 + ctx.rank())];
          for (std::size_t p = 0; p < mb.size(); ++p)
            for (std::size_t i = 0; i < mb[p].size(); ++i) m.g[p][i] += mb[p][i];
          (void)st.finish();
        }
        if (half == 1 && ctx.rank() == 0) after.push_back(m.g);
      }
      if (half == 0) lockstep::add_training_state(ck, dp);
    });
  REQUIRE(after.size() == 2);
  CHECK(after[0] == whole.grads[2]);
  CHECK(after[1] == whole.grads[3]);
}
}

TEST_SUITE("cpu") {
TEST_CASE("deterministic_a_cycle_cut_short_leaves_no_trace") {
  // Folds of a cycle that never reached end_step (an exception in between) change neither the
  // next step's sums and exponents nor the counts: the hook then equals one that never saw them.
  LOCKSTEP_SEEDED(std::mt19937_64 rng);
  const auto values = cut_short_values(rng);
  const auto &huge = values.first, &plain = values.second;
  auto run = [&](bool cut_short) {
    cut_short_outcome out;
    lockstep::run(lockstep::Threads{1}, [&](auto& ctx) { out = cut_short_on_rank(ctx, huge, plain, cut_short); });
    return out;
  };
  const auto cut = run(true), clean = run(false);
  CHECK(cut.exponents == clean.exponents);
  CHECK(cut.exponents[0] < 16);  // step 1's range from the plain values, not from the dropped fold's 2^20
  CHECK(cut.clamped_total == 0);
  CHECK(clean.clamped_total == 0);
  CHECK(std::memcmp(cut.grads.data(), clean.grads.data(), cut.grads.size() * sizeof(float)) == 0);
}
}
