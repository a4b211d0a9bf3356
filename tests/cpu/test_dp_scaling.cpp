// DataParallel with loss scaling: the equivalence holds with DynamicScale on, and an
// inf/NaN injected into one rank's gradient skips the step on every rank and halves the
// scale everywhere.
#include <doctest/doctest.h>

#include <limits>

#include <lockstep/lockstep.hpp>
#include <lockstep/scaling/scalers.hpp>

#include "mlp.hpp"
#include "test_util.hpp"

using namespace lockstep_test;

TEST_SUITE("cpu") {

TEST_CASE(
    "DataParallel + DynamicScale: same parameters as unscaled single-rank SGD - inf on one rank skips everywhere") {
  const auto seed = fresh_seed();
  CAPTURE(seed);
  const std::vector<int> dims{9, 12, 4};
  std::mt19937_64 rng(seed);
  const std::size_t samples = 256;
  auto X = random_vector<double>(samples * 9, rng, -1, 1);
  std::vector<int> y(samples);
  for (auto& v : y) v = static_cast<int>(rng() % 4);
  const int n = 3, B = 4, steps = 6, poisoned_step = 2, poisoned_rank = 1;
  const double lr = 0.3;

  // Reference: one rank, batch n·B, plain SGD; the poisoned step is skipped.
  TestMlp<double> ref(dims, seed);
  for (int s = 0; s < steps; ++s) {
    if (s == poisoned_step) continue;
    ref.zero_grad();
    std::vector<std::size_t> rows(n * B);
    for (std::size_t i = 0; i < rows.size(); ++i) rows[i] = (s * n * B + i) % samples;
    ref.forward_backward(X, y, rows, [](std::size_t) {});
    ref.sgd(lr);
  }

  std::vector<std::vector<double>> got(n);
  std::vector<std::vector<lockstep::loss_scale_state>> states(n);
  std::vector<std::vector<bool>> applied(n);
  lockstep::run(lockstep::Threads{n}, [&](auto& ctx) {
    TestMlp<double> m(dims, seed);
    lockstep::DataParallel dp(ctx, m, lockstep::DynamicScale({.init_scale = 1024.0, .growth_interval = 2}));
    for (int s = 0; s < steps; ++s) {
      auto step = dp.step();
      std::vector<std::size_t> rows(B);
      for (int i = 0; i < B; ++i) rows[static_cast<std::size_t>(i)] = (s * n * B + ctx.rank() * B + i) % samples;
      const double scale = step.loss_scale();
      m.forward_backward(X, y, rows, step.on_gradient_ready(), scale);
      if (s == poisoned_step && ctx.rank() == poisoned_rank) {
        auto p = dp.parameters()[1];
        p.template grad_as<double>()[0] = std::numeric_limits<double>::infinity();
      }
      auto r = step.finish();
      applied[static_cast<std::size_t>(ctx.rank())].push_back(static_cast<bool>(r));
      states[static_cast<std::size_t>(ctx.rank())].push_back(dp.scaler().state());
      if (r) m.sgd(lr);
    }
    got[static_cast<std::size_t>(ctx.rank())] = m.flat_values();
  });
  for (int r = 0; r < n; ++r) {
    CAPTURE(r);
    CHECK(max_rel_diff(got[static_cast<std::size_t>(r)], ref.flat_values()) <= 1e-12);
    CHECK(states[static_cast<std::size_t>(r)] == states[0]);
    CHECK(applied[static_cast<std::size_t>(r)] == applied[0]);
  }
  for (int s = 0; s < steps; ++s) CHECK(applied[0][static_cast<std::size_t>(s)] == (s != poisoned_step));
  // 1024 → 2048 after 2 clean steps, halved at the inf, then grows again after 2 clean ones.
  CHECK(states[0][1].scale == 2048.0);
  CHECK(states[0][2].scale == 1024.0);
  CHECK(states[0][2].skipped_steps == 1);
  CHECK(states[0][4].scale == 2048.0);
}

}  // TEST_SUITE
