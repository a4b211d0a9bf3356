// Gradient clipping: the global L2 norm against a long double reference, PyTorch's clip
// coefficient, non-finite norms, clip_grad_value, and the same norm on every rank.

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <limits>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "lockstep/comm/thread_comm.hpp"
#include "lockstep/scaling/clipping.hpp"
#include "test_util.hpp"

using namespace lockstep;

namespace {

using lockstep_test::fresh_seed;

// Gradients of f32 and f64 in several segments each; magnitudes vary over many decades so a
// float or naive sum would show its error.
struct mixed_grads {
  std::vector<std::vector<float>> f;
  std::vector<std::vector<double>> d;
  std::vector<segment> fs, ds;

  mixed_grads(std::mt19937& rng, double spread_decades) {
    std::uniform_int_distribution<int> nseg(1, 4), len(1, 9000);
    std::uniform_real_distribution<double> expo(-spread_decades, spread_decades), sign(-1, 1);
    auto value = [&] {
      const double s = sign(rng) < 0 ? -1.0 : 1.0;
      return s * std::pow(10.0, expo(rng));
    };
    for (int i = nseg(rng); i > 0; --i) {
      std::vector<float> b(static_cast<std::size_t>(len(rng)));
      for (auto& x : b) x = static_cast<float>(value());
      f.push_back(std::move(b));
    }
    for (int i = nseg(rng); i > 0; --i) {
      std::vector<double> b(static_cast<std::size_t>(len(rng)));
      for (auto& x : b) x = value();
      d.push_back(std::move(b));
    }
    for (auto& b : f) fs.push_back({b.data(), b.size()});
    for (auto& b : d) ds.push_back({b.data(), b.size()});
  }
  std::vector<grad_group> groups() const { return {{dtype::f32, fs}, {dtype::f64, ds}}; }

  long double reference_norm() const {
    long double s = 0;
    for (auto& b : f)
      for (float x : b) s += static_cast<long double>(x) * x;
    for (auto& b : d)
      for (double x : b) s += static_cast<long double>(x) * x;
    return std::sqrt(s);
  }
};

}  // namespace

TEST_SUITE("cpu") {

TEST_CASE("clipping: grad_norm and clip_grad_norm match a long double reference") {
  LOCKSTEP_SEEDED(std::mt19937 rng);
  for (int trial = 0; trial < 6; ++trial) {
    CAPTURE(trial);
    mixed_grads g(rng, trial < 3 ? 1.0 : 12.0);
    const auto gs = g.groups();
    const long double ref = g.reference_norm();
    const double norm = grad_norm(std::span<const grad_group>(gs));
    CHECK(std::fabs(norm - ref) <= ref * 1e-14L);

    // Clip to a random fraction of the norm: every element scaled by T(max / (norm + 1e-6)).
    const auto f0 = g.f;
    const auto d0 = g.d;
    const double max_norm = static_cast<double>(ref) * std::uniform_real_distribution<double>(0.05, 0.9)(rng);
    const double returned = clip_grad_norm(std::span<const grad_group>(gs), max_norm);
    CHECK(std::fabs(returned - ref) <= ref * 1e-14L);
    // The coefficient from the returned norm (its accuracy is checked above), so this checks
    // the formula and the multiply alone: T(coef) then one rounding of the product.
    const long double coef = max_norm / (static_cast<long double>(returned) + 1e-6L);
    std::size_t bad = 0;
    for (std::size_t i = 0; i < f0.size(); ++i)
      for (std::size_t j = 0; j < f0[i].size(); ++j) {
        const long double want = f0[i][j] * coef;
        if (std::fabs(g.f[i][j] - want) > std::fabs(want) * 2.5e-7L) ++bad;  // ~2 float eps
      }
    for (std::size_t i = 0; i < d0.size(); ++i)
      for (std::size_t j = 0; j < d0[i].size(); ++j) {
        const long double want = d0[i][j] * coef;
        if (std::fabs(g.d[i][j] - want) > std::fabs(want) * 1e-15L) ++bad;
      }
    CHECK(bad == 0);
    const long double after = g.reference_norm();
    const long double expect_after = max_norm * ref / (ref + 1e-6L);
    CHECK(std::fabs(after - expect_after) <= expect_after * 1e-6L);

    // Below the limit nothing is written.
    const auto f1 = g.f;
    const auto d1 = g.d;
    const double big = static_cast<double>(after) * 1.5 + 1.0;
    const double n2 = clip_grad_norm(std::span<const grad_group>(gs), big);
    CHECK(std::fabs(n2 - after) <= after * 1e-14L);
    CHECK(g.f == f1);
    CHECK(g.d == d1);
  }
}

TEST_CASE("clipping: clip_grad_norm: non-finite norm leaves the gradients and is returned") {
  LOCKSTEP_SEEDED(std::mt19937 rng);
  for (double bad : {std::numeric_limits<double>::infinity(), std::numeric_limits<double>::quiet_NaN()}) {
    CAPTURE(bad);
    mixed_grads g(rng, 2.0);
    auto& b = g.f[std::uniform_int_distribution<std::size_t>(0, g.f.size() - 1)(rng)];
    b[std::uniform_int_distribution<std::size_t>(0, b.size() - 1)(rng)] = static_cast<float>(bad);
    const auto before_f = g.f;
    const auto before_d = g.d;
    const auto gs = g.groups();
    const double n = clip_grad_norm(std::span<const grad_group>(gs), 1e-3);
    if (std::isnan(bad)) CHECK(std::isnan(n));
    else CHECK(n == std::numeric_limits<double>::infinity());
    for (std::size_t i = 0; i < g.f.size(); ++i)
      CHECK(std::memcmp(g.f[i].data(), before_f[i].data(), g.f[i].size() * 4) == 0);
    for (std::size_t i = 0; i < g.d.size(); ++i) CHECK(g.d[i] == before_d[i]);
  }
}

TEST_CASE("clipping: clip_grad_norm: a squared float sum beyond float's range is still exact") {
  // Values ~1e30: their squares overflow float but not the double accumulator.
  std::vector<float> v(1000, 3e30f);
  v[7] = -4e30f;
  segment s{v.data(), v.size()};
  const grad_group g{dtype::f32, std::span<const segment>(&s, 1)};
  long double ref = 0;
  for (float x : v) ref += static_cast<long double>(x) * x;
  ref = std::sqrt(ref);
  const double n = grad_norm(std::span<const grad_group>(&g, 1));
  CHECK(std::isfinite(n));
  CHECK(std::fabs(n - ref) <= ref * 1e-14L);
}

TEST_CASE("clipping: clip_grad_norm gives the same norm on every rank") {
  const auto seed = fresh_seed();
  CAPTURE(seed);
  const int n = 3;
  std::vector<double> norms(n);
  std::vector<std::vector<float>> results(n);
  std::vector<std::thread> threads;
  std::vector<std::exception_ptr> errors(n);
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      try {
        std::mt19937 rng(seed);  // same (averaged) gradients on every rank
        mixed_grads g(rng, 3.0);
        const auto gs = g.groups();
        norms[static_cast<std::size_t>(r)] = clip_grad_norm(std::span<const grad_group>(gs), 0.5);
        results[static_cast<std::size_t>(r)] = g.f[0];
      } catch (...) {
        errors[static_cast<std::size_t>(r)] = std::current_exception();
      }
    });
  for (auto& t : threads) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
  for (int r = 1; r < n; ++r) {
    CHECK(std::memcmp(&norms[static_cast<std::size_t>(r)], &norms[0], sizeof(double)) == 0);
    CHECK(results[static_cast<std::size_t>(r)] == results[0]);
  }
}

TEST_CASE("clipping: clip_grad_value clamps to plus or minus clip and keeps NaN") {
  LOCKSTEP_SEEDED(std::mt19937 rng);
  mixed_grads g(rng, 2.0);
  g.f[0][0] = std::numeric_limits<float>::quiet_NaN();
  g.d[0][0] = -std::numeric_limits<double>::infinity();
  const auto f0 = g.f;
  const auto d0 = g.d;
  const double clip = std::uniform_real_distribution<double>(0.1, 10.0)(rng);
  CAPTURE(clip);
  const auto gs = g.groups();
  clip_grad_value(std::span<const grad_group>(gs), clip);
  std::size_t bad = 0, clipped = 0;
  const float cf = static_cast<float>(clip);
  for (std::size_t i = 0; i < f0.size(); ++i)
    for (std::size_t j = 0; j < f0[i].size(); ++j) {
      const float x = f0[i][j], y = g.f[i][j];
      if (std::isnan(x)) {
        bad += std::isnan(y) ? 0 : 1;
        continue;
      }
      const float want = x > cf ? cf : (x < -cf ? -cf : x);
      clipped += want != x;
      bad += y == want ? 0 : 1;
    }
  for (std::size_t i = 0; i < d0.size(); ++i)
    for (std::size_t j = 0; j < d0[i].size(); ++j) {
      const double x = d0[i][j], y = g.d[i][j];
      const double want = x > clip ? clip : (x < -clip ? -clip : x);
      clipped += want != x;
      bad += y == want ? 0 : 1;
    }
  CHECK(bad == 0);
  CHECK(clipped > 0);  // the data reach beyond the limit, so the test can fail
  CHECK(g.d[0][0] == -clip);
}

TEST_CASE("clipping: refuses bad limits and non-float gradients") {
  std::vector<float> v = {1.0f, -2.0f};
  segment s{v.data(), v.size()};
  const grad_group g{dtype::f32, std::span<const segment>(&s, 1)};
  const std::span<const grad_group> gs(&g, 1);
  CHECK_THROWS_AS(clip_grad_norm(gs, -1.0), config_error);
  CHECK_THROWS_AS(clip_grad_norm(gs, std::numeric_limits<double>::quiet_NaN()), config_error);
  CHECK_THROWS_AS(clip_grad_value(gs, -0.5), config_error);
  CHECK(clip_grad_norm(gs, std::numeric_limits<double>::infinity()) == doctest::Approx(std::sqrt(5.0)));
  CHECK(v == std::vector<float>{1.0f, -2.0f});
  std::vector<std::int64_t> ints = {1, 2};
  segment is{ints.data(), ints.size()};
  const grad_group ig{dtype::i64, std::span<const segment>(&is, 1)};
  CHECK_THROWS_AS(grad_norm(std::span<const grad_group>(&ig, 1)), config_error);
  CHECK_THROWS_AS(clip_grad_value(std::span<const grad_group>(&ig, 1), 1.0), config_error);
}

}  // TEST_SUITE
