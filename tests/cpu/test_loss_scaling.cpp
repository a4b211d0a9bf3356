// Loss scalers: DynamicScale's schedule, StaticScale, NoScaling, unscaling against an
// independent reference, and agreement across ranks (ThreadComm) when one rank sees inf/NaN.

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <limits>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "lockstep/comm/thread_comm.hpp"
#include "lockstep/parallel/policies.hpp"
#include "lockstep/scaling/loss_scaler.hpp"
#include "lockstep/scaling/scalers.hpp"

#include "test_util.hpp"

using namespace lockstep;

namespace {

using lockstep_test::run_ranks;

std::uint32_t fresh_seed() { return std::random_device{}(); }

// Gradients of one type in a few segments of random length (some longer than the vector
// width, some odd), values drawn nonzero.
template <class T>
struct grads {
  std::vector<std::vector<T>> bufs;
  std::vector<segment> segs;

  grads(std::mt19937& rng, double magnitude) {
    std::uniform_int_distribution<int> nseg(1, 5), len(1, 3000);
    std::normal_distribution<double> val(0.0, 1.0);
    const int k = nseg(rng);
    for (int i = 0; i < k; ++i) {
      std::vector<T> b(static_cast<std::size_t>(len(rng)));
      for (auto& x : b) {
        double v = val(rng);
        if (v == 0.0) v = 0.5;
        x = static_cast<T>(v * magnitude);
      }
      bufs.push_back(std::move(b));
    }
    for (auto& b : bufs) segs.push_back({b.data(), b.size()});
  }
  grad_group group() const { return {dtype_of<T>, segs}; }
  std::vector<std::vector<T>> snapshot() const { return bufs; }
  T& at(std::mt19937& rng) {
    auto& b = bufs[std::uniform_int_distribution<std::size_t>(0, bufs.size() - 1)(rng)];
    return b[std::uniform_int_distribution<std::size_t>(0, b.size() - 1)(rng)];
  }
};

// Bitwise equality that treats NaN == NaN.
template <class T>
bool same_bits(const std::vector<std::vector<T>>& a, const std::vector<std::vector<T>>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (a[i].size() != b[i].size()) return false;
    for (std::size_t j = 0; j < a[i].size(); ++j)
      if (std::memcmp(&a[i][j], &b[i][j], sizeof(T)) != 0) return false;
  }
  return true;
}

// Checks after = before / scale elementwise against long double arithmetic: exactly when
// scale is a power of two, else within rel_ulps units of T's epsilon.
template <class T>
void check_unscaled(const std::vector<std::vector<T>>& before, const std::vector<std::vector<T>>& after, double scale,
                    double rel_ulps) {
  REQUIRE(before.size() == after.size());
  int exp = 0;
  const bool pow2 = std::frexp(scale, &exp) == 0.5;
  std::size_t bad = 0;
  for (std::size_t i = 0; i < before.size(); ++i)
    for (std::size_t j = 0; j < before[i].size(); ++j) {
      const long double ref = static_cast<long double>(before[i][j]) / scale;
      const long double got = after[i][j];
      if (pow2) {
        if (static_cast<T>(ref) != after[i][j]) ++bad;
      } else {
        const long double tol = std::fabs(ref) * rel_ulps * static_cast<long double>(std::numeric_limits<T>::epsilon());
        if (std::fabs(got - ref) > tol) ++bad;
      }
    }
  CHECK(bad == 0);
}

double random_pow2(std::mt19937& rng, int lo, int hi) {
  return std::ldexp(1.0, std::uniform_int_distribution<int>(lo, hi)(rng));
}

}  // namespace

static_assert(loss_scaler<NoScaling> && loss_scaler<StaticScale> && loss_scaler<DynamicScale>);
static_assert(loss_scaler_for<NoScaling, ThreadComm> && loss_scaler_for<StaticScale, ThreadComm> &&
              loss_scaler_for<DynamicScale, ThreadComm>);
static_assert(!loss_scaler<EveryStep> && !loss_scaler<int>);
static_assert(inspecting_scaler<NoScaling> && !inspecting_scaler<DynamicScale>);
static_assert(!device_scaler<DynamicScale> && !attachable_scaler<DynamicScale, ThreadComm>);

TEST_SUITE("cpu") {

TEST_CASE("loss scaling: DynamicScale defaults are GradScaler's") {
  DynamicScale s;
  CHECK(s.scale() == 65536.0);
  CHECK(s.options().growth_factor == 2.0);
  CHECK(s.options().backoff_factor == 0.5);
  CHECK(s.options().growth_interval == 2000);
  CHECK(s.options().min_scale == 1.0);
  CHECK(s.options().max_scale == 16777216.0);
  CHECK(s.state() == loss_scale_state{65536.0, 0, 0, 0});
}

TEST_CASE("loss scaling: DynamicScale grows after exactly growth_interval clean steps") {
  LOCKSTEP_SEEDED(std::mt19937 rng);
  DynamicScaleOptions o;
  o.growth_interval = std::uniform_int_distribution<int>(1, 60)(rng);
  o.init_scale = random_pow2(rng, 4, 12);
  o.max_scale = o.init_scale * 1024;
  CAPTURE(o.growth_interval);
  DynamicScale s(o);
  double expect = o.init_scale;
  for (int round = 0; round < 3; ++round) {
    for (int i = 1; i < o.growth_interval; ++i) {
      s.update(false);
      REQUIRE(s.scale() == expect);
      REQUIRE(s.state().good_steps == i);
    }
    s.update(false);
    expect *= 2;
    CHECK(s.scale() == expect);
    CHECK(s.state().good_steps == 0);
  }
  CHECK(s.state().steps == 3 * o.growth_interval);
  CHECK(s.state().skipped_steps == 0);

  // A skip restarts the count: growth needs growth_interval clean steps after it.
  if (o.growth_interval > 1) {
    const int k = std::uniform_int_distribution<int>(1, o.growth_interval - 1)(rng);
    for (int i = 0; i < k; ++i) s.update(false);
    s.update(true);
    expect /= 2;
    CHECK(s.scale() == expect);
    CHECK(s.state().good_steps == 0);
    for (int i = 1; i < o.growth_interval; ++i) s.update(false);
    CHECK(s.scale() == expect);
    s.update(false);
    CHECK(s.scale() == expect * 2);
  }
}

TEST_CASE("loss scaling: DynamicScale backs off on inf and on NaN found in the gradients") {
  LOCKSTEP_SEEDED(std::mt19937 rng);
  for (double bad : {std::numeric_limits<double>::infinity(), -std::numeric_limits<double>::infinity(),
                     std::numeric_limits<double>::quiet_NaN()}) {
    CAPTURE(bad);
    auto comms = ThreadComm::create_group(1);
    DynamicScale s;
    grads<float> g(rng, 100.0);
    g.at(rng) = static_cast<float>(bad);
    grad_group gg = g.group();
    const bool found = s.unscale_and_check(comms[0], std::span<const grad_group>(&gg, 1));
    CHECK(found);
    s.update(found);
    CHECK(s.scale() == 32768.0);
    CHECK(s.state() == loss_scale_state{32768.0, 0, 1, 1});

    grads<double> h(rng, 100.0);
    grad_group hg = h.group();
    const bool clean = s.unscale_and_check(comms[0], std::span<const grad_group>(&hg, 1));
    CHECK_FALSE(clean);
    s.update(clean);
    CHECK(s.state() == loss_scale_state{32768.0, 1, 1, 2});
  }
}

TEST_CASE("loss scaling: DynamicScale unscaling that overflows counts as inf") {
  // A scale below 1 multiplies; a finite float near its maximum then overflows.
  auto comms = ThreadComm::create_group(1);
  DynamicScaleOptions o;
  o.init_scale = 0.25;
  o.min_scale = 0.125;
  DynamicScale s(o);
  std::vector<float> v = {1.0f, std::numeric_limits<float>::max() / 2, -3.0f};
  segment seg{v.data(), v.size()};
  grad_group g{dtype::f32, std::span<const segment>(&seg, 1)};
  CHECK(s.unscale_and_check(comms[0], std::span<const grad_group>(&g, 1)));
}

TEST_CASE("loss scaling: DynamicScale stays between min_scale and max_scale") {
  LOCKSTEP_SEEDED(std::mt19937 rng);
  DynamicScaleOptions o;
  o.min_scale = random_pow2(rng, 0, 4);
  o.init_scale = o.min_scale * 4;
  o.max_scale = o.init_scale * 4;
  o.growth_interval = std::uniform_int_distribution<int>(1, 5)(rng);
  DynamicScale s(o);
  s.update(true);
  CHECK(s.scale() == o.min_scale * 2);
  s.update(true);
  CHECK(s.scale() == o.min_scale);
  for (int i = 0; i < 5; ++i) {
    s.update(true);
    CHECK(s.scale() == o.min_scale);  // the floor holds
  }
  CHECK(s.state().skipped_steps == 7);
  for (int i = 0; i < 10 * o.growth_interval; ++i) s.update(false);
  CHECK(s.scale() == o.max_scale);  // the ceiling holds
  CHECK(s.state().good_steps == 0);

  // A growth that would overshoot the ceiling stops at it.
  DynamicScaleOptions p;
  p.init_scale = 3.0;
  p.max_scale = 5.0;
  p.growth_interval = 1;
  DynamicScale t(p);
  t.update(false);
  CHECK(t.scale() == 5.0);
}

TEST_CASE("loss scaling: DynamicScaleOptions are validated") {
  auto with = [](auto change) {
    DynamicScaleOptions o;
    change(o);
    return o;
  };
  CHECK_THROWS_AS(DynamicScale(with([](auto& o) { o.growth_factor = 1.0; })), config_error);
  CHECK_THROWS_AS(DynamicScale(with([](auto& o) { o.backoff_factor = 1.0; })), config_error);
  CHECK_THROWS_AS(DynamicScale(with([](auto& o) { o.backoff_factor = 0.0; })), config_error);
  CHECK_THROWS_AS(DynamicScale(with([](auto& o) { o.growth_interval = 0; })), config_error);
  CHECK_THROWS_AS(DynamicScale(with([](auto& o) { o.init_scale = 0.5; })), config_error);
  CHECK_THROWS_AS(DynamicScale(with([](auto& o) { o.init_scale = 1e9; })), config_error);
  CHECK_THROWS_AS(DynamicScale(with([](auto& o) { o.init_scale = std::numeric_limits<double>::quiet_NaN(); })),
                  config_error);
  CHECK_THROWS_AS(DynamicScale(with([](auto& o) { o.min_scale = -1.0; })), config_error);
  CHECK_THROWS_AS(StaticScale(0.0), config_error);
  CHECK_THROWS_AS(StaticScale{std::numeric_limits<double>::infinity()}, config_error);
}

TEST_CASE("loss scaling: unscale matches an independent reference (f32 and f64 in several groups)") {
  LOCKSTEP_SEEDED(std::mt19937 rng);
  auto comms = ThreadComm::create_group(1);

  SUBCASE("DynamicScale, power-of-two scale: exact") {
    DynamicScaleOptions o;
    o.init_scale = random_pow2(rng, 0, 24);
    o.max_scale = o.init_scale;
    CAPTURE(o.init_scale);
    DynamicScale s(o);
    grads<float> f(rng, o.init_scale);
    grads<double> d(rng, o.init_scale);
    const auto f0 = f.snapshot();
    const auto d0 = d.snapshot();
    const grad_group gs[] = {f.group(), d.group()};
    CHECK_FALSE(s.unscale_and_check(comms[0], std::span<const grad_group>(gs)));
    check_unscaled(f0, f.bufs, o.init_scale, 0);
    check_unscaled(d0, d.bufs, o.init_scale, 0);
  }
  SUBCASE("StaticScale, any scale: within rounding") {
    const double scale = std::uniform_real_distribution<double>(1.5, 5000.0)(rng);
    CAPTURE(scale);
    StaticScale s(scale);
    grads<float> f(rng, scale);
    grads<double> d(rng, scale);
    const auto f0 = f.snapshot();
    const auto d0 = d.snapshot();
    const grad_group gs[] = {d.group(), f.group()};
    CHECK_FALSE(s.unscale_and_check(comms[0], std::span<const grad_group>(gs)));
    // The factor 1/scale rounded to T, then the product rounded: at most ~2 eps.
    check_unscaled(f0, f.bufs, scale, 2.0);
    check_unscaled(d0, d.bufs, scale, 2.0);
    CHECK(s.scale() == scale);
  }
}

TEST_CASE("loss scaling: inf/NaN on one rank only: every rank skips and the states stay identical") {
  const auto seed = fresh_seed();
  CAPTURE(seed);
  const int n = 4, steps = 24;
  // The plan, shared by all ranks: at which steps which rank gets inf or NaN, and where.
  std::mt19937 plan_rng(seed);
  struct event {
    int rank = -1;  // -1: a clean step
    bool nan = false;
  };
  std::vector<event> plan(steps);
  for (auto& e : plan)
    if (std::uniform_int_distribution<int>(0, 2)(plan_rng) == 0)
      e = {std::uniform_int_distribution<int>(0, n - 1)(plan_rng),
           std::uniform_int_distribution<int>(0, 1)(plan_rng) == 1};
  plan[3] = {2, false};  // at least one inf and one NaN
  plan[7] = {0, true};

  auto run = [&](auto prototype) {
    using S = decltype(prototype);
    std::vector<std::vector<loss_scale_state>> states(n);
    std::vector<std::vector<char>> found(n);
    run_ranks(n, [&](int rank, ThreadComm& comm) {
      S s = prototype;  // one per rank, copied as a strategy would
      std::mt19937 rng(seed + 1 + static_cast<std::uint32_t>(rank));
      for (int step = 0; step < steps; ++step) {
        grads<float> f(rng, s.scale());
        grads<double> d(rng, s.scale());
        if (plan[static_cast<std::size_t>(step)].rank == rank) {
          const double bad = plan[static_cast<std::size_t>(step)].nan ? std::numeric_limits<double>::quiet_NaN()
                                                                      : -std::numeric_limits<double>::infinity();
          if (step % 2) f.at(rng) = static_cast<float>(bad);
          else d.at(rng) = bad;
        }
        const grad_group gs[] = {f.group(), d.group()};
        const bool inf = s.unscale_and_check(comm, std::span<const grad_group>(gs));
        s.update(inf);
        found[static_cast<std::size_t>(rank)].push_back(inf ? 1 : 0);
        states[static_cast<std::size_t>(rank)].push_back(s.state());
      }
    });
    int expect_skipped = 0;
    for (int step = 0; step < steps; ++step) {
      CAPTURE(step);
      const bool expect = plan[static_cast<std::size_t>(step)].rank >= 0;
      expect_skipped += expect ? 1 : 0;
      for (int r = 0; r < n; ++r) {
        CAPTURE(r);
        CHECK(static_cast<bool>(found[static_cast<std::size_t>(r)][static_cast<std::size_t>(step)]) == expect);
        CHECK(states[static_cast<std::size_t>(r)][static_cast<std::size_t>(step)] ==
              states[0][static_cast<std::size_t>(step)]);
      }
    }
    CHECK(states[0].back().skipped_steps == expect_skipped);
    CHECK(states[0].back().steps == steps);
    return states[0];
  };

  SUBCASE("DynamicScale") {
    DynamicScaleOptions o;
    o.growth_interval = 3;
    const auto st = run(DynamicScale(o));
    // Replaying the agreed flags on one scaler gives the same scale history.
    DynamicScale replay(o);
    for (int step = 0; step < steps; ++step) {
      replay.update(plan[static_cast<std::size_t>(step)].rank >= 0);
      CHECK(replay.state() == st[static_cast<std::size_t>(step)]);
    }
  }
  SUBCASE("StaticScale") {
    const auto st = run(StaticScale(1024.0));
    for (const auto& s : st) CHECK(s.scale == 1024.0);
  }
  SUBCASE("NoScaling with check_finite") {
    const auto st = run(NoScaling({.check_finite = true}));
    for (const auto& s : st) CHECK(s.scale == 1.0);
  }
}

TEST_CASE("loss scaling: StaticScale keeps its scale through skips and clean runs") {
  LOCKSTEP_SEEDED(std::mt19937 rng);
  const double scale = random_pow2(rng, 1, 20);
  StaticScale s(scale);
  std::int64_t good = 0, skipped = 0;
  for (int i = 0; i < 5000; ++i) {
    const bool inf = std::uniform_int_distribution<int>(0, 9)(rng) == 0;
    s.update(inf);
    if (inf) {
      ++skipped;
      good = 0;
    } else {
      ++good;
    }
    REQUIRE(s.scale() == scale);
  }
  CHECK(s.state() == loss_scale_state{scale, good, skipped, 5000});
  CHECK(StaticScale().scale() == 128.0);
}

TEST_CASE("loss scaling: NoScaling checks nothing by default and only reads when asked") {
  LOCKSTEP_SEEDED(std::mt19937 rng);
  auto comms = ThreadComm::create_group(1);
  grads<float> f(rng, 10.0);
  f.at(rng) = std::numeric_limits<float>::infinity();
  const auto before = f.snapshot();
  const grad_group g = f.group();

  NoScaling off;
  CHECK(off.scale() == 1.0);
  const auto seq = comms[0].sequence();
  CHECK_FALSE(off.unscale_and_check(comms[0], std::span<const grad_group>(&g, 1)));
  CHECK(comms[0].sequence() == seq);  // no collective issued
  CHECK(same_bits(before, f.bufs));

  NoScaling on({.check_finite = true});
  CHECK(on.unscale_and_check(comms[0], std::span<const grad_group>(&g, 1)));
  CHECK(same_bits(before, f.bufs));  // a check only: nothing written
  on.update(true);
  CHECK(on.state() == loss_scale_state{1.0, 0, 1, 1});
}

TEST_CASE("loss scaling: state() / load_state() resume a run exactly") {
  LOCKSTEP_SEEDED(std::mt19937 rng);
  DynamicScaleOptions o;
  o.growth_interval = std::uniform_int_distribution<int>(2, 7)(rng);
  std::vector<bool> flags(200);
  for (auto&& f : flags) f = std::uniform_int_distribution<int>(0, 5)(rng) == 0;
  const std::size_t cut = std::uniform_int_distribution<std::size_t>(1, flags.size() - 1)(rng);

  DynamicScale whole(o);
  for (bool f : flags) whole.update(f);

  DynamicScale first(o);
  for (std::size_t i = 0; i < cut; ++i) first.update(flags[i]);
  DynamicScale resumed(o);
  resumed.load_state(first.state());
  CHECK(resumed.state() == first.state());
  for (std::size_t i = cut; i < flags.size(); ++i) resumed.update(flags[i]);
  CHECK(resumed.state() == whole.state());

  // States these options could not have written are refused.
  DynamicScale d(o);
  CHECK_THROWS_AS(d.load_state({o.max_scale * 2, 0, 0, 0}), checkpoint_error);
  CHECK_THROWS_AS(d.load_state({1024.0, o.growth_interval, 0, 5}), checkpoint_error);
  CHECK_THROWS_AS(d.load_state({-1.0, 0, 0, 0}), checkpoint_error);
  CHECK_THROWS_AS(d.load_state({1024.0, 0, 3, 2}), checkpoint_error);
  CHECK(d.state() == loss_scale_state{o.init_scale, 0, 0, 0});  // unchanged by the failures

  // A fixed scale is configuration: StaticScale restores the counters, keeps its scale.
  StaticScale s(256.0);
  s.load_state({4096.0, 3, 2, 9});
  CHECK(s.state() == loss_scale_state{256.0, 3, 2, 9});
  NoScaling ns;
  ns.load_state({4096.0, 3, 2, 9});
  CHECK(ns.state() == loss_scale_state{1.0, 3, 2, 9});
}

TEST_CASE("loss scaling: unscale_and_check refuses non-float and host-less element types") {
  auto comms = ThreadComm::create_group(1);
  DynamicScale s;
  std::vector<std::int32_t> ints = {1, 2, 3};
  segment seg{ints.data(), ints.size()};
  grad_group g{dtype::i32, std::span<const segment>(&seg, 1)};
  CHECK_THROWS_AS(s.unscale_and_check(comms[0], std::span<const grad_group>(&g, 1)), config_error);
  std::vector<std::uint16_t> halves = {0x3c00, 0x4000};
  segment hs{halves.data(), halves.size()};
  grad_group h{dtype::f16, std::span<const segment>(&hs, 1)};
  CHECK_THROWS_AS(s.unscale_and_check(comms[0], std::span<const grad_group>(&h, 1)), config_error);
}

TEST_CASE("loss scaling: empty gradients are clean") {
  auto comms = ThreadComm::create_group(1);
  DynamicScale s;
  CHECK_FALSE(s.unscale_and_check(comms[0], std::span<const grad_group>()));
  segment empty{nullptr, 0};
  grad_group g{dtype::f32, std::span<const segment>(&empty, 1)};
  CHECK_FALSE(s.unscale_and_check(comms[0], std::span<const grad_group>(&g, 1)));
}

}  // TEST_SUITE
