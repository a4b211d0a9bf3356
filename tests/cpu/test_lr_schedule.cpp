// Effective batch, linear LR scaling and the warmup/decay schedule.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdlib>
#include <cstdint>
#include <numbers>
#include <random>

#include "lockstep/data/lr_schedule.hpp"
#include "test_util.hpp"

TEST_SUITE("cpu") {

TEST_CASE("lr: effective batch and the linear scaling rule") {
  LOCKSTEP_SEEDED(std::mt19937_64 rng);
  for (int t = 0; t < 100; ++t) {
    const std::size_t b = 1 + rng() % 512;
    const int n = 1 + static_cast<int>(rng() % 64), k = 1 + static_cast<int>(rng() % 16);
    std::size_t sum = 0;  // b summed over every rank and accumulation step
    for (int i = 0; i < n * k; ++i) sum += b;
    CHECK(lockstep::effective_batch(b, n, k) == sum);
    CHECK(lockstep::effective_batch(b, n) == b * static_cast<std::size_t>(n));
    const double base = 0.001 + double(rng() % 1000) / 1000.0;
    // Doubling the batch doubles the LR; the base batch keeps the base LR.
    CHECK(lockstep::scaled_lr(base, b, b) == doctest::Approx(base));
    CHECK(lockstep::scaled_lr(base, b, 2 * b) == doctest::Approx(2 * base));
    CHECK(lockstep::scaled_lr(base, 256, sum) == doctest::Approx(base * double(sum) / 256.0));
  }
  CHECK(lockstep::scaled_lr(0.1, 256, 8192) == doctest::Approx(3.2));  // Goyal et al.'s setting
  CHECK_THROWS_AS(lockstep::effective_batch(0, 4, 1), lockstep::config_error);
  CHECK_THROWS_AS(lockstep::effective_batch(8, 0, 1), lockstep::config_error);
  CHECK_THROWS_AS(lockstep::effective_batch(8, 4, 0), lockstep::config_error);
  CHECK_THROWS_AS(lockstep::scaled_lr(0.1, 0, 8), lockstep::config_error);
  CHECK_THROWS_AS(lockstep::scaled_lr(0.1, 8, 0), lockstep::config_error);
}

TEST_CASE("lr: linear warmup reaches the peak on its last step") {
  LOCKSTEP_SEEDED(std::mt19937_64 rng);
  for (int t = 0; t < 50; ++t) {
    const std::uint64_t w = 1 + rng() % 1000;
    const double peak = 0.01 + double(rng() % 1000) / 100.0;
    CHECK(lockstep::warmup_lr(0, w, peak) == doctest::Approx(peak / double(w)));
    CHECK(lockstep::warmup_lr(w - 1, w, peak) == doctest::Approx(peak));
    CHECK(lockstep::warmup_lr(w, w, peak) == peak);
    CHECK(lockstep::warmup_lr(w + rng() % 100000, w, peak) == peak);
    double prev = 0;
    for (std::uint64_t s = 0; s < w; ++s) {  // equal increments of peak / w
      const double lr = lockstep::warmup_lr(s, w, peak);
      CHECK(lr - prev == doctest::Approx(peak / double(w)));
      prev = lr;
    }
  }
  CHECK(lockstep::warmup_lr(0, 0, 0.5) == 0.5);  // no warmup
}

TEST_CASE("lr: LinearWarmup decays linearly or by cosine to final_lr") {
  LOCKSTEP_SEEDED(std::mt19937_64 rng);
  for (int t = 0; t < 50; ++t) {
    const std::uint64_t w = rng() % 100, len = 2 * (1 + rng() % 500), total = w + len;
    const double peak = 0.5 + double(rng() % 100) / 10.0, fin = double(rng() % 50) / 100.0;
    CAPTURE(w);
    CAPTURE(total);
    const lockstep::LinearWarmup none{.peak_lr = peak, .warmup_steps = w};
    const lockstep::LinearWarmup lin{
        .peak_lr = peak, .warmup_steps = w, .decay = lockstep::Decay::linear, .total_steps = total, .final_lr = fin};
    const lockstep::LinearWarmup cos{
        .peak_lr = peak, .warmup_steps = w, .decay = lockstep::Decay::cosine, .total_steps = total, .final_lr = fin};
    for (std::uint64_t s = 0; s < w; ++s) {
      CHECK(lin(s) == lockstep::warmup_lr(s, w, peak));
      CHECK(cos(s) == lockstep::warmup_lr(s, w, peak));
    }
    CHECK(none(total + 12345) == peak);
    CHECK(lin(w) == doctest::Approx(peak));
    CHECK(cos(w) == doctest::Approx(peak));
    CHECK(lin(w + len / 2) == doctest::Approx((peak + fin) / 2));
    CHECK(cos(w + len / 2) == doctest::Approx((peak + fin) / 2));
    CHECK(lin(total) == fin);
    CHECK(cos(total + rng() % 1000) == fin);
    for (std::uint64_t s = w; s < total; ++s) {
      const double x = double(s - w) / double(len);
      // Independent forms: linear as a weighted mean, cosine as peak − (peak − final)·sin²(πx/2).
      CHECK(lin(s) == doctest::Approx((1 - x) * peak + x * fin));
      const double sn = std::sin(std::numbers::pi * x / 2);
      CHECK(cos(s) == doctest::Approx(peak - (peak - fin) * sn * sn));
      if (s > w) CHECK(lin(s) <= lin(s - 1));
    }
  }
  const lockstep::LinearWarmup bad{
      .peak_lr = 0.1, .warmup_steps = 100, .decay = lockstep::Decay::linear, .total_steps = 50};
  CHECK_THROWS_AS(bad(0), lockstep::config_error);
  const lockstep::LinearWarmup nan{.peak_lr = std::nan("")};
  CHECK_THROWS_AS(nan(0), lockstep::config_error);
}

TEST_CASE("lr_schedule: the scaling rule from LOCKSTEP_LR_SCALING (lockstep-run's question)") {
  std::mt19937_64 rng(std::random_device{}());
  const double base = std::uniform_real_distribution<double>(1e-4, 1e-1)(rng);
  const std::size_t b0 = 32 + rng() % 64, eb = b0 * (2 + rng() % 7);
  const double r = static_cast<double>(eb) / static_cast<double>(b0);
  ::unsetenv("LOCKSTEP_LR_SCALING");
  CHECK(lockstep::lr_scaling_from_env() == lockstep::LrScaling::none);
  CHECK(lockstep::lr_scaling_from_env(lockstep::LrScaling::sqrt) == lockstep::LrScaling::sqrt);
  ::setenv("LOCKSTEP_LR_SCALING", "linear", 1);
  CHECK(lockstep::scaled_lr(base, b0, eb, lockstep::lr_scaling_from_env()) == doctest::Approx(base * r).epsilon(1e-15));
  ::setenv("LOCKSTEP_LR_SCALING", "sqrt", 1);
  CHECK(lockstep::scaled_lr(base, b0, eb, lockstep::lr_scaling_from_env()) ==
        doctest::Approx(base * std::sqrt(r)).epsilon(1e-15));
  ::setenv("LOCKSTEP_LR_SCALING", "none", 1);
  CHECK(lockstep::scaled_lr(base, b0, eb, lockstep::lr_scaling_from_env()) == base);
  ::setenv("LOCKSTEP_LR_SCALING", "quadratic", 1);
  CHECK_THROWS_WITH_AS(lockstep::lr_scaling_from_env(), doctest::Contains("give none, linear or sqrt"),
                       lockstep::config_error);
  ::unsetenv("LOCKSTEP_LR_SCALING");
  CHECK_THROWS_AS(lockstep::scaled_lr(base, 0, eb, lockstep::LrScaling::sqrt), lockstep::config_error);
}

}  // TEST_SUITE
