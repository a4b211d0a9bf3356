// Uneven inputs (join.hpp): ranks with different numbers of batches end the epoch together,
// every step averages over the data actually contributed (checked against a plain loop that,
// per step, averages over only the ranks that had a batch), and all ranks end bit-identical
// — with accumulation (including unfinished cycles), dynamic loss scaling (an inf while a
// rank is shadowing), tiny buckets, fused (silent) models, packed gradients, mixed element
// types and ranks with no batch at all. Without a scope, uneven batches fail loudly.
#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include <lockstep/lockstep.hpp>
#include <lockstep/parallel/join.hpp>

#include "equivalence.hpp"
#include "mlp.hpp"
#include "test_util.hpp"

using namespace lockstep_test;

namespace {

dataset make_data(std::uint64_t seed) { return lockstep_test::make_data(seed, 2003); }

struct join_config {
  std::vector<int> batches;  // micro-batches per rank (uneven)
  std::size_t batch = 3;     // rows per micro-batch
  int accumulate = 1;
  bool hooks = true;
  bool average_over_accumulation = true;
  lockstep::BucketPolicy buckets{};
  int inf_cycle = -1;  // this rank's first micro-batch of this cycle gets an infinite loss scale
  int inf_rank = -1;

  int ranks() const { return static_cast<int>(batches.size()); }
  // Micro-batches rank r contributes to cycle c (0 once it ran out).
  int contributed(int r, int c) const {
    return std::clamp(batches[static_cast<std::size_t>(r)] - c * accumulate, 0, accumulate);
  }
  int cycles() const {
    int m = 0;
    for (int n : batches) m = std::max(m, (n + accumulate - 1) / accumulate);
    return m;
  }
};

std::vector<std::size_t> rows_of(const dataset& d, const join_config& c, int r, int j) {
  std::vector<std::size_t> rows(c.batch);
  const std::size_t first = static_cast<std::size_t>(r) * 613 + static_cast<std::size_t>(j) * c.batch;
  for (std::size_t i = 0; i < c.batch; ++i) rows[i] = (first + i) % d.samples;
  return rows;
}

// A plain loop: per cycle, the mean over the micro-batches the ranks still had (or, with
// average_over_accumulation off, the sum over them / (K · ranks that had any)); a cycle
// with an inf, and cycle `dropped`, are skipped. Plain SGD, or with momentum > 0 lockstep::Sgd.
template <class T>
std::vector<T> reference(const dataset& d, const join_config& c, std::uint64_t init_seed, double lr,
                         double momentum = 0, int dropped = -1) {
  TestMlp<T> m(d.dims, init_seed);
  lockstep::Sgd opt({.lr = lr, .momentum = momentum});
  const int K = c.accumulate;
  for (int cy = 0; cy < c.cycles(); ++cy) {
    if (cy == c.inf_cycle || cy == dropped) continue;
    int M = 0, A = 0;
    for (int r = 0; r < c.ranks(); ++r) {
      M += c.contributed(r, cy);
      A += c.contributed(r, cy) > 0 ? 1 : 0;
    }
    const double w = c.average_over_accumulation ? 1.0 / M : 1.0 / (K * A);
    m.zero_grad();
    for (int r = 0; r < c.ranks(); ++r)
      for (int j = cy * K; j < cy * K + c.contributed(r, cy); ++j) {
        auto rows = rows_of(d, c, r, j);
        m.forward_backward(inputs<T>(d), d.y, rows, [](std::size_t) {}, w);
      }
    if (momentum > 0) opt.step(m.parameters());
    else m.sgd(lr);
  }
  return m.flat_values();
}

template <class T>
struct join_outcome {
  std::vector<std::vector<T>> params;
  std::vector<std::size_t> shadow;
  std::vector<lockstep::loss_scale_state> scaler;
  std::vector<lockstep::sync_stats> stats;
};

template <class T, bool Bindable, class Acc, class Scaler>
join_outcome<T> run_join(const dataset& d, const join_config& c, std::uint64_t init_seed, double lr, Acc acc,
                         Scaler scaler, bool use_join = true) {
  const auto n = static_cast<std::size_t>(c.ranks());
  join_outcome<T> out{std::vector<std::vector<T>>(n), std::vector<std::size_t>(n, 0),
                      std::vector<lockstep::loss_scale_state>(n), std::vector<lockstep::sync_stats>(n)};
  lockstep::run(lockstep::Threads{c.ranks()}, [&](auto& ctx) {
    const int r = ctx.rank();
    const auto ri = static_cast<std::size_t>(r);
    // Different initial values per rank: construction broadcasts rank 0's.
    TestMlp<T, Bindable> m(d.dims, init_seed + static_cast<std::uint64_t>(r) * 7919);
    lockstep::DataParallel<TestMlp<T, Bindable>, lockstep::ThreadComm, Acc, Scaler> dp(
        ctx, m, {.buckets = c.buckets, .average_over_accumulation = c.average_over_accumulation}, acc, scaler);
    auto update = [&](lockstep::step_result res) {
      CHECK(res.synced);
      if (res) m.sgd(lr);
    };
    auto loop = [&] {
      for (int j = 0; j < c.batches[ri]; ++j) {
        auto step = dp.step();
        double ls = step.loss_scale();
        if (!c.average_over_accumulation) ls /= c.accumulate;  // PyTorch's way: loss / K
        if (r == c.inf_rank && j == c.inf_cycle * c.accumulate) ls = std::numeric_limits<double>::infinity();
        auto rows = rows_of(d, c, r, j);
        if (c.hooks) m.forward_backward(inputs<T>(d), d.y, rows, step.on_gradient_ready(), ls);
        else m.forward_backward(inputs<T>(d), d.y, rows, [](std::size_t) {}, ls);
        auto res = step.finish();
        if (res.synced) update(res);
      }
    };
    if (use_join) {
      auto join = dp.join(update);
      loop();
      out.shadow[ri] = join.leave();
      CHECK(join.active_ranks() == 0);
    } else {
      loop();
    }
    out.params[ri] = m.flat_values();
    out.scaler[ri] = dp.scaler().state();
    out.stats[ri] = dp.stats();
  });
  return out;
}

template <class T, bool Bindable, class Scaler = lockstep::NoScaling>
void check_join(const join_config& c, Scaler scaler = {}) {
  const auto seed = fresh_seed();
  CAPTURE(seed);
  CAPTURE(c.ranks());
  CAPTURE(c.accumulate);
  CAPTURE(c.hooks);
  CAPTURE(Bindable);
  CAPTURE(c.buckets.cap_bytes);
  CAPTURE(c.average_over_accumulation);
  CAPTURE(c.inf_cycle);
  std::string counts;
  for (int b : c.batches) counts += std::to_string(b) + " ";
  CAPTURE(counts);
  const double tol = std::is_same_v<T, double> ? 1e-12 : 1e-5;
  const double lr = 0.2;
  auto d = make_data(seed);
  auto ref = reference<T>(d, c, seed + 1, lr);
  join_outcome<T> got;
  if (c.accumulate == 1) got = run_join<T, Bindable>(d, c, seed + 1, lr, lockstep::EveryStep{}, scaler);
  else got = run_join<T, Bindable>(d, c, seed + 1, lr, lockstep::Accumulate<>(c.accumulate), scaler);
  TestMlp<T> init(d.dims, seed + 1);
  if (c.cycles() > (c.inf_cycle >= 0 ? 1 : 0)) CHECK(max_rel_diff(init.flat_values(), ref) > 1e-3);
  const int K = c.accumulate;
  for (int r = 0; r < c.ranks(); ++r) {
    CAPTURE(r);
    const auto ri = static_cast<std::size_t>(r);
    CHECK(max_rel_diff(got.params[ri], ref) <= tol);
    CHECK(got.params[ri] == got.params[0]);  // bit for bit
    // Steps finished inside leave(): every cycle this rank did not end with a step of its own.
    CHECK(got.shadow[ri] == static_cast<std::size_t>(c.cycles() - c.batches[ri] / K));
    CHECK(got.stats[ri].syncs == static_cast<std::uint64_t>(c.cycles()));
    CHECK(got.scaler[ri] == got.scaler[0]);
    if constexpr (!std::is_same_v<Scaler, lockstep::NoScaling>) {  // NoScaling does not count
      CHECK(got.scaler[ri].steps == c.cycles());
      CHECK(got.scaler[ri].skipped_steps == (c.inf_cycle >= 0 ? 1 : 0));
    }
  }
}

// Rank r has 3 + 2r micro-batches.
join_config uneven(int n) {
  join_config c;
  for (int r = 0; r < n; ++r) c.batches.push_back(3 + 2 * r);
  return c;
}

// ---- a model with two element types whose launches interleave ------------------------------
// ½·mean over rows of Σ_j (p_j − x_row[(j + shift) mod D])² per parameter: its gradient is
// p − the rows' mean of x. Backward reports c (f64), b (f32), a (f64): with small buckets the
// f64 arena's units go out before and after the f32 arena's, so a shadowing rank must replay
// that order to issue the same sequence of collectives.
struct MixedModel {
  static constexpr std::size_t D = 23;
  std::vector<double> a, ga, c, gc;
  std::vector<float> b, gb;

  explicit MixedModel(std::uint64_t seed) {
    std::mt19937_64 rng(seed);
    a = random_vector<double>(40, rng);
    b = random_vector<float>(30, rng);
    c = random_vector<double>(50, rng);
    ga.assign(a.size(), 0.0);
    gb.assign(b.size(), 0.0f);
    gc.assign(c.size(), 0.0);
  }
  std::vector<lockstep::parameter> parameters() {
    return {lockstep::param<double>("a", a.data(), ga.data(), {40}),
            lockstep::param<float>("b", b.data(), gb.data(), {30}),
            lockstep::param<double>("c", c.data(), gc.data(), {50})};
  }
  template <class P, class G, class Hook>
  static void add_grad(const std::vector<double>& X, std::span<const std::size_t> rows, const P& p, G& g,
                       std::size_t shift, double scale, Hook& hook, std::size_t index) {
    for (std::size_t j = 0; j < p.size(); ++j) {
      double s = 0;
      for (auto row : rows) s += static_cast<double>(p[j]) - X[row * D + (j + shift) % D];
      g[j] += static_cast<typename G::value_type>(scale * s / static_cast<double>(rows.size()));
    }
    hook(index);
  }
  template <class Hook>
  void backward(const std::vector<double>& X, std::span<const std::size_t> rows, Hook hook, double scale = 1.0) {
    add_grad(X, rows, c, gc, 13, scale, hook, 2);
    add_grad(X, rows, b, gb, 7, scale, hook, 1);
    add_grad(X, rows, a, ga, 0, scale, hook, 0);
  }
  void sgd(double lr) {
    for (std::size_t j = 0; j < a.size(); ++j) a[j] -= lr * ga[j];
    for (std::size_t j = 0; j < b.size(); ++j) b[j] -= static_cast<float>(lr) * gb[j];
    for (std::size_t j = 0; j < c.size(); ++j) c[j] -= lr * gc[j];
  }
};

// MixedModel's loss as one block of full sharding (lockstep::model (h), (i)): values and
// gradients where lockstep attaches them. Backward reports c (f64), a (f64), b (f32): the f64
// unit is complete first, while registration order (a, b, c) would complete the f32 unit first —
// so a rank replaying a step must report in the order the step saw.
struct BlockMixedModel {
  static constexpr std::size_t D = MixedModel::D;
  MixedModel own;
  double *a, *ga = nullptr, *c, *gc = nullptr;
  float *b, *gb = nullptr;

  explicit BlockMixedModel(std::uint64_t seed) : own(seed), a(own.a.data()), c(own.c.data()), b(own.b.data()) {}
  std::vector<lockstep::parameter> parameters() {
    return {lockstep::param<double>("a", a, ga, {40}), lockstep::param<float>("b", b, gb, {30}),
            lockstep::param<double>("c", c, gc, {50})};
  }
  std::vector<std::size_t> blocks() const { return {0, 0, 0}; }
  void attach(std::size_t i, void* v, void* g) {
    if (i == 0) a = static_cast<double*>(v), ga = static_cast<double*>(g);
    if (i == 1) b = static_cast<float*>(v), gb = static_cast<float*>(g);
    if (i == 2) c = static_cast<double*>(v), gc = static_cast<double*>(g);
  }
  template <class Hook>
  void backward(const std::vector<double>& X, std::span<const std::size_t> rows, Hook hook) {
    std::span<double> va(a, 40), vc(c, 50), wa(ga, 40), wc(gc, 50);
    std::span<float> vb(b, 30), wb(gb, 30);
    MixedModel::add_grad(X, rows, vc, wc, 13, 1.0, hook, 2);
    MixedModel::add_grad(X, rows, va, wa, 0, 1.0, hook, 0);
    MixedModel::add_grad(X, rows, vb, wb, 7, 1.0, hook, 1);
  }
};

// The data and plain-loop reference of the two-element-type join tests: ranks with `counts`
// batches of B rows; in double, per step, p −= lr·(p − mean of x over the contributing ranks' rows).
struct mixed_case {
  static constexpr std::size_t samples = 211, B = 4;
  static constexpr int n = 3;
  static constexpr double lr = 0.3;
  std::vector<double> X;
  std::vector<int> counts{2, 5, 3};

  explicit mixed_case(std::mt19937_64& rng) : X(random_vector<double>(samples * MixedModel::D, rng, -3, 3)) {}
  std::vector<std::size_t> rows_for(int r, int j) const {
    std::vector<std::size_t> rows(B);
    for (std::size_t i = 0; i < B; ++i)
      rows[i] = (static_cast<std::size_t>(r) * 71 + static_cast<std::size_t>(j) * B + i) % samples;
    return rows;
  }
  // a, b (widened), c after 5 steps from MixedModel(init_seed).
  std::array<std::vector<double>, 3> reference(std::uint64_t init_seed) const {
    MixedModel m(init_seed);
    std::array<std::vector<double>, 3> p{m.a, std::vector<double>(m.b.begin(), m.b.end()), m.c};
    const std::size_t shift[3] = {0, 7, 13};
    for (int s = 0; s < 5; ++s) {
      std::vector<std::size_t> rows;
      for (int r = 0; r < n; ++r)
        if (s < counts[static_cast<std::size_t>(r)]) {
          auto more = rows_for(r, s);
          rows.insert(rows.end(), more.begin(), more.end());
        }
      for (int k = 0; k < 3; ++k)
        for (std::size_t j = 0; j < p[k].size(); ++j) {
          double mean = 0;
          for (auto row : rows) mean += X[row * MixedModel::D + (j + shift[k]) % MixedModel::D];
          mean /= static_cast<double>(rows.size());
          p[k][j] -= lr * (p[k][j] - mean);
        }
    }
    return p;
  }
};

// ---- running ranks on a group with a short timeout -----------------------------------------
template <class F>
void run_short(int n, std::chrono::milliseconds timeout, F&& body) {
  auto comms = lockstep::ThreadComm::create_group(n, timeout);
  lockstep::ThreadComm aborter = comms[0];
  lockstep::detail::run_ranks(
      n, [&](int r) { body(comms[static_cast<std::size_t>(r)]); }, [&](const std::string& why) { aborter.abort(why); });
}

}  // namespace

TEST_SUITE("cpu") {

TEST_CASE_TEMPLATE("join: uneven batches end together and average over the ranks that had data", T, double, float) {
  for (int n : {2, 3, 4}) {
    auto c = uneven(n);
    check_join<T, true>(c);
    check_join<T, false>(c);
    c.hooks = false;  // a model that never reports: fused mode after the first step
    check_join<T, true>(c);
  }
}

TEST_CASE("join: a single rank is a plain loop") {
  join_config c;
  c.batches = {5};
  check_join<double, true>(c);
  c.accumulate = 2;  // the last cycle has one micro-batch: averaged over 1
  check_join<double, true>(c);
}

TEST_CASE("join with Accumulate<2>: unfinished cycles contribute what they have") {
  for (int n : {2, 3, 4}) {
    auto c = uneven(n);  // odd counts: every rank ends mid-cycle
    c.accumulate = 2;
    check_join<double, true>(c);
    check_join<double, false>(c);
    c.batches[0] = 4;  // one rank ends on a cycle boundary
    check_join<double, true>(c);
    c.accumulate = 3;
    check_join<double, true>(c);
    c.accumulate = 2;
    c.average_over_accumulation = false;  // divide by contributing ranks; the loss carries 1/K
    check_join<double, true>(c);
  }
}

TEST_CASE("join with DynamicScale: a shadowing rank takes part in the found-inf agreement") {
  const lockstep::DynamicScale scaler({.init_scale = 1024.0, .growth_interval = 2});
  for (int n : {2, 3, 4}) {
    auto c = uneven(n);
    check_join<double, true>(c, scaler);  // the scale grows while ranks shadow
    // An inf on the last rank at cycle 3, when rank 0 (3 batches) is already shadowing:
    // every rank skips that step and backs off.
    c.inf_rank = n - 1;
    c.inf_cycle = 3;
    check_join<double, true>(c, scaler);
    check_join<float, false>(c, scaler);
    c.accumulate = 2;
    c.inf_cycle = 2;  // rank 0 (3 batches) flushed its last cycle at 1; shadows at 2
    check_join<double, true>(c, scaler);
  }
}

namespace {
// TestMlp with a buffer (lockstep::model (c)) that each step moves on its own rank, as
// BatchNorm's running statistics: the value after `steps` own steps from `start`.
struct MlpWithStats : TestMlp<double> {
  using TestMlp<double>::TestMlp;
  std::vector<double> stats = std::vector<double>(5, 0.0);
  std::vector<lockstep::parameter> buffers() {
    return {lockstep::param<double>("stats", stats.data(), static_cast<double*>(nullptr), {5})};
  }
  void move_stats(int rank) {
    for (std::size_t i = 0; i < stats.size(); ++i)
      stats[i] = 0.5 * stats[i] + rank + 1.0 + 0.1 * static_cast<double>(i);
  }
};
}  // namespace

TEST_CASE("join with broadcast_buffers: buffers come from a rank still stepping - and all end alike") {
  // The last rank has the most batches; rank 0 runs out first. Every cycle must start from the
  // last rank's buffers (rank 0's are stale once it shadows), and the scope must end with the
  // last rank's on every rank (DDP's find_common_rank and final sync after join).
  const auto d = make_data(fresh_seed());
  for (int n : {2, 3}) {
    CAPTURE(n);
    std::vector<std::vector<double>> end(static_cast<std::size_t>(n));
    lockstep::run(lockstep::Threads{n}, [&](auto& ctx) {
      const int r = ctx.rank();
      MlpWithStats m(d.dims, 11);
      std::fill(m.stats.begin(), m.stats.end(), 100.0 * (r + 1));  // another start on every rank
      lockstep::DataParallel dp(ctx, m);                           // broadcast_buffers: on by default
      const auto update = [&](lockstep::step_result res) {
        if (res) m.sgd(0.01);
      };
      {
        auto join = dp.join(update);
        for (int b = 0; b < 1 + 2 * r; ++b) {  // rank r: 1 + 2r batches
          auto step = dp.step();
          const std::vector<std::size_t> rows{static_cast<std::size_t>(3 * r + b)};
          m.forward_backward(d.X64, d.y, rows, step.on_gradient_ready());
          update(step.finish());
          m.move_stats(r);
        }
      }
      end[static_cast<std::size_t>(r)] = m.stats;
    });
    // The last rank's own evolution: rank 0's start (construction broadcasts it), then 2n − 1
    // steps of its own.
    MlpWithStats last(d.dims, 11);
    std::fill(last.stats.begin(), last.stats.end(), 100.0);
    for (int s = 0; s < 2 * n - 1; ++s) last.move_stats(n - 1);
    for (int r = 0; r < n; ++r) {
      CAPTURE(r);
      CHECK(end[static_cast<std::size_t>(r)] == last.stats);
    }
  }
}

TEST_CASE("join with buckets smaller than one tensor (many launch units)") {
  for (int n : {2, 3, 4}) {
    auto c = uneven(n);
    c.buckets = {.first_bytes = 40, .cap_bytes = 136};
    check_join<double, true>(c);
    check_join<double, false>(c);
    c.hooks = false;
    check_join<double, true>(c);
    c.accumulate = 2;
    check_join<double, false>(c);
    c.hooks = true;
    check_join<float, true>(c);
  }
}

TEST_CASE("join with ranks that have no batch at all") {
  for (auto counts : {std::vector<int>{0, 3, 5}, std::vector<int>{4, 0, 2}, std::vector<int>{3, 5, 0, 0},
                      std::vector<int>{0, 1}, std::vector<int>{0, 0, 0}}) {
    join_config c;
    c.batches = counts;
    check_join<double, true>(c);
    check_join<double, false>(c);
    c.hooks = false;
    check_join<double, true>(c);
    c.hooks = true;
    c.accumulate = 2;
    c.buckets = {.first_bytes = 40, .cap_bytes = 136};
    check_join<double, true>(c);
  }
}

TEST_CASE("join with equal batch counts changes nothing (bit for bit)") {
  const auto seed = fresh_seed();
  CAPTURE(seed);
  auto d = make_data(seed);
  for (int k : {1, 2}) {
    join_config c;
    c.batches = {4, 4, 4};
    c.accumulate = k;
    auto with = run_join<double, true>(d, c, seed, 0.1, lockstep::Accumulate<>(k), lockstep::NoScaling{});
    auto without = run_join<double, true>(d, c, seed, 0.1, lockstep::Accumulate<>(k), lockstep::NoScaling{}, false);
    CHECK(with.params == without.params);
    CHECK(max_rel_diff(with.params[0], reference<double>(d, c, seed, 0.1)) <= 1e-12);
    for (auto s : with.shadow) CHECK(s == 0);
  }
}

TEST_CASE("join with two element types: a shadowing rank replays the launch order") {
  LOCKSTEP_SEEDED(std::mt19937_64 rng);
  const mixed_case mc(rng);
  const int n = mixed_case::n;
  const double lr = mixed_case::lr;
  const auto& counts = mc.counts;
  const auto [ra, rb, rc] = mc.reference(seed + 1);
  std::vector<MixedModel> models;
  for (int r = 0; r < n; ++r) models.emplace_back(seed + 1 + static_cast<std::uint64_t>(r) * 31);
  std::vector<std::size_t> shadow(n);
  lockstep::run(lockstep::Threads{n}, [&](auto& ctx) {
    const int r = ctx.rank();
    auto& m = models[static_cast<std::size_t>(r)];
    lockstep::DataParallel<MixedModel, lockstep::ThreadComm> dp(ctx, m,
                                                                {.buckets = {.first_bytes = 64, .cap_bytes = 96}});
    auto update = [&](lockstep::step_result res) {
      if (res) m.sgd(lr);
    };
    auto join = dp.join(update);
    for (int j = 0; j < counts[static_cast<std::size_t>(r)]; ++j) {
      auto step = dp.step();
      auto rows = mc.rows_for(r, j);
      m.backward(mc.X, rows, step.on_gradient_ready());
      update(step.finish());
    }
    shadow[static_cast<std::size_t>(r)] = join.leave();
  });
  std::vector<double> b0(models[0].b.begin(), models[0].b.end());
  CHECK(max_rel_diff(models[0].a, ra) <= 1e-12);
  CHECK(max_rel_diff(models[0].c, rc) <= 1e-12);
  CHECK(max_rel_diff(b0, rb) <= 1e-5);
  for (int r = 0; r < n; ++r) {
    CAPTURE(r);
    const auto& m = models[static_cast<std::size_t>(r)];
    CHECK(m.a == models[0].a);
    CHECK(m.b == models[0].b);
    CHECK(m.c == models[0].c);
    CHECK(shadow[static_cast<std::size_t>(r)] == static_cast<std::size_t>(5 - counts[static_cast<std::size_t>(r)]));
  }
}

TEST_CASE("join with fullshard zero3 and two element types in a block: the replay reports in the step's order") {
  LOCKSTEP_SEEDED(std::mt19937_64 rng);
  const mixed_case mc(rng);
  const int n = mixed_case::n;
  const double lr = mixed_case::lr;
  const auto ref = mc.reference(seed + 1);
  std::vector<std::vector<double>> a(n), c(n);
  lockstep::run(lockstep::Threads{n}, [&](auto& ctx) {
    const int r = ctx.rank();
    BlockMixedModel m(seed + 1 + static_cast<std::uint64_t>(r) * 31);
    using DP = lockstep::DataParallel<BlockMixedModel, lockstep::ThreadComm, lockstep::FullySharded>;
    DP dp(ctx, m);
    lockstep::Sgd opt({.lr = lr});
    const auto on_shard = [&](std::span<const lockstep::param_slice> s) { opt.step(s); };
    auto join = dp.join([](lockstep::step_result) {}, on_shard);
    for (int j = 0; j < mc.counts[static_cast<std::size_t>(r)]; ++j) {
      auto step = dp.step();
      {
        auto use = dp.use_block(0, lockstep::pass::forward);
      }
      {
        auto use = dp.use_block(0, lockstep::pass::backward);
        m.backward(mc.X, mc.rows_for(r, j), step.on_gradient_ready());
      }
      (void)step.finish(on_shard);
    }
    join.leave();
    dp.wait_all_parameters();
    a[static_cast<std::size_t>(r)].assign(m.a, m.a + 40);
    c[static_cast<std::size_t>(r)].assign(m.c, m.c + 50);
  });
  for (std::size_t r = 0; r < static_cast<std::size_t>(n); ++r) {
    CAPTURE(r);
    CHECK(max_rel_diff(a[r], ref[0]) <= 1e-12);
    CHECK(max_rel_diff(c[r], ref[2]) <= 1e-12);
  }
}

TEST_CASE_TEMPLATE("join with ShardedOptimizer: a rank out of data still steps its shard - equals the plain loop", T,
                   float, double) {
  const auto seed = fresh_seed();
  CAPTURE(seed);
  const double lr = 0.2, tol = std::is_same_v<T, double> ? 1e-12 : 1e-5;
  const auto d = make_data(seed);
  for (int n : {2, 3, 4}) {
    CAPTURE(n);
    join_config c = uneven(n);
    c.buckets = {.first_bytes = 4 * sizeof(T) * 7, .cap_bytes = 4 * sizeof(T) * 19};  // tensors over several shards
    if (n == 4) c.batches[1] = 0;                                                     // a rank with no batch at all
    const auto ref = reference<T>(d, c, seed + 1, lr);
    std::vector<std::vector<T>> got(static_cast<std::size_t>(n));
    std::vector<std::size_t> shadow(got.size());
    lockstep::run(lockstep::Threads{n}, [&](auto& ctx) {
      const auto ri = static_cast<std::size_t>(ctx.rank());
      TestMlp<T> m(d.dims, seed + 1 + ri * 7919);
      lockstep::DataParallel<TestMlp<T>, lockstep::ThreadComm, lockstep::ShardedOptimizer> dp(ctx, m,
                                                                                              {.buckets = c.buckets});
      lockstep::Sgd opt({.lr = lr});
      const auto on_shard = [&](std::span<const lockstep::param_slice> s) { opt.step(s); };
      auto join = dp.join([](lockstep::step_result r) { CHECK(r.synced); }, on_shard);
      for (int j = 0; j < c.batches[ri]; ++j) {
        auto step = dp.step();
        auto rows = rows_of(d, c, ctx.rank(), j);
        m.forward_backward(inputs<T>(d), d.y, rows, step.on_gradient_ready());
        (void)step.finish(on_shard);
      }
      shadow[ri] = join.leave();
      got[ri] = m.flat_values();
    });
    for (int r = 0; r < n; ++r) {
      CAPTURE(r);
      const auto ri = static_cast<std::size_t>(r);
      CHECK(max_rel_diff(got[ri], ref) <= tol);
      CHECK(got[ri] == got[0]);
      CHECK(shadow[ri] == static_cast<std::size_t>(c.cycles() - c.batches[ri]));
    }
  }
}

// One rank's loop under a block-sharded Strategy (ShardedGradients, FullySharded), c.accumulate
// micro-steps per step, the loss scaled by a Scaler (DynamicScale: a power of two, so the
// unscaled gradients are the same numbers): each layer's block used around its forward and its
// backward; leave() shadows the others' steps.
struct abandoned {};  // what a backward throws on every rank at batch abandon_at (caught: the step is dropped)

template <class T, class Strategy, class Scaler = lockstep::NoScaling>
void join_blocks_rank(auto& ctx, const dataset& d, const join_config& c, std::uint64_t seed, double lr,
                      const Strategy& strategy, std::vector<T>& got, std::size_t& shadow, int abandon_at = -1,
                      Scaler scaler = {}) {
  const auto ri = static_cast<std::size_t>(ctx.rank());
  TestMlp<T> m(d.dims, seed + 1 + ri * 7919);
  using DP = lockstep::DataParallel<TestMlp<T>, lockstep::ThreadComm, lockstep::Accumulate<>, Scaler, Strategy>;
  DP dp(ctx, m, {.buckets = c.buckets, .average_over_accumulation = c.average_over_accumulation},
        lockstep::Accumulate<>(c.accumulate), scaler, strategy);
  lockstep::Sgd opt({.lr = lr, .momentum = 0.5});
  const double ls = c.average_over_accumulation ? 1.0 : 1.0 / c.accumulate;  // off: PyTorch's loss / K
  const auto on_shard = [&](std::span<const lockstep::param_slice> s) { opt.step(s); };
  auto join = dp.join([](lockstep::step_result r) { CHECK((r.synced && r.applied)); }, on_shard);
  for (int j = 0; j < c.batches[ri]; ++j) {
    auto step = dp.step();
    auto rows = rows_of(d, c, ctx.rank(), j);
    try {
      m.forward_backward(
          inputs<T>(d), d.y, rows, step.on_gradient_ready(), ls * step.loss_scale(), [&](std::size_t l, bool forward) {
            auto use = dp.use_block(m.blocks()[2 * l], forward ? lockstep::pass::forward : lockstep::pass::backward);
            if (j == abandon_at && !forward && l == 1) throw abandoned{};
            return use;
          });
    } catch (const abandoned&) {
      continue;  // this rank's last batch, for some: leave() then settles the step first
    }
    (void)step.finish(on_shard);
  }
  shadow = join.leave();
  dp.wait_all_parameters();
  got = m.flat_values();
}

TEST_CASE_TEMPLATE("join with fullshard zero2 zero3: a rank out of data replays the blocks' collectives", T, float,
                   double) {
  const auto seed = fresh_seed();
  CAPTURE(seed);
  const double lr = 0.2, tol = std::is_same_v<T, double> ? 1e-12 : 1e-5;
  const auto d = make_data(seed);
  lockstep::FullySharded kept;
  kept.keep_after_forward = true;
  kept.buffers.prefetch = 2;
  for (int n : {2, 3, 4})
    for (int variant = 0; variant < 5; ++variant) {  // K = 1, 2, 3; K = 2 averaged over ranks; K = 2 scaled
      join_config c = uneven(n);                     // odd counts: with K > 1 every rank ends mid-cycle
      c.accumulate = variant == 0 ? 1 : variant == 2 ? 3 : 2;
      c.average_over_accumulation = variant != 3;
      const bool scaled = variant == 4;  // DynamicScale: unscaling and the found-inf check need every shard first
      if (n >= 3) c.batches[1] = 0;      // a rank with no batch at all: it replays the plain order of uses
      if (n == 4 && c.accumulate > 1) c.batches[3] = 4 * c.accumulate;  // one ends on a cycle boundary
      CAPTURE(n);
      CAPTURE(c.accumulate);
      CAPTURE(c.average_over_accumulation);
      const auto want = reference<T>(d, c, seed + 1, lr, 0.5);  // momentum SGD on every parameter
      for (int strategy = 0; strategy < 3; ++strategy) {
        CAPTURE(strategy);
        std::vector<std::vector<T>> got(static_cast<std::size_t>(n));
        std::vector<std::size_t> shadow(got.size());
        lockstep::run(lockstep::Threads{n}, [&](auto& ctx) {
          const auto ri = static_cast<std::size_t>(ctx.rank());
          const lockstep::DynamicScale dyn({.init_scale = 1024.0, .growth_interval = 2});
          if (strategy == 0 && !scaled)
            join_blocks_rank<T>(ctx, d, c, seed, lr, lockstep::ShardedGradients{}, got[ri], shadow[ri]);
          if (strategy == 0 && scaled)
            join_blocks_rank<T>(ctx, d, c, seed, lr, lockstep::ShardedGradients{}, got[ri], shadow[ri], -1, dyn);
          if (strategy == 1 && !scaled)
            join_blocks_rank<T>(ctx, d, c, seed, lr, lockstep::FullySharded{}, got[ri], shadow[ri]);
          if (strategy == 1 && scaled)
            join_blocks_rank<T>(ctx, d, c, seed, lr, lockstep::FullySharded{}, got[ri], shadow[ri], -1, dyn);
          if (strategy == 2) join_blocks_rank<T>(ctx, d, c, seed, lr, kept, got[ri], shadow[ri]);
        });
        for (int r = 0; r < n; ++r) {
          CAPTURE(r);
          const auto ri = static_cast<std::size_t>(r);
          CHECK(max_rel_diff(got[ri], want) <= tol);
          CHECK(got[ri] == got[0]);
          // the cycles it did not complete itself: an unfinished one and those it shadowed
          CHECK(shadow[ri] == static_cast<std::size_t>(c.cycles() - c.batches[ri] / c.accumulate));
        }
      }
    }
}

TEST_CASE("join with fullshard zero3: a step abandoned on every rank - one of them then out of data") {
  const auto seed = fresh_seed();
  CAPTURE(seed);
  const double lr = 0.2;
  const auto d = make_data(seed);
  join_config c;
  c.batches = {3, 5, 4};
  const int dropped = 2;  // rank 0's last batch: every rank's backward throws there
  const auto want = reference<double>(d, c, seed + 1, lr, 0.5, dropped);
  std::vector<std::vector<double>> got(3);
  std::vector<std::size_t> shadow(3);
  lockstep::run(lockstep::Threads{3}, [&](auto& ctx) {
    const auto ri = static_cast<std::size_t>(ctx.rank());
    join_blocks_rank<double>(ctx, d, c, seed, lr, lockstep::FullySharded{}, got[ri], shadow[ri], dropped);
  });
  for (std::size_t r = 0; r < 3; ++r) {
    CAPTURE(r);
    CHECK(max_rel_diff(got[r], want) <= 1e-12);
    CHECK(got[r] == got[0]);
  }
}

TEST_CASE("without a join scope uneven batches fail loudly instead of silently") {
  const auto seed = fresh_seed();
  CAPTURE(seed);
  auto d = make_data(seed, 101);
  using Dp = lockstep::DataParallel<TestMlp<double>, lockstep::ThreadComm>;
  const auto timeout = std::chrono::milliseconds(400);
  auto train = [&](Dp& dp, TestMlp<double>& m, int r, int batches) {
    for (int j = 0; j < batches; ++j) {
      auto step = dp.step();
      auto rows = std::vector<std::size_t>{static_cast<std::size_t>(r * 10 + j) % 101};
      m.forward_backward(d.X64, d.y, rows, step.on_gradient_ready());
      if (step.finish()) m.sgd(0.1);
    }
  };
  // Two ranks under the short timeout, each running body(comm, dp, m) on its own model.
  auto run_two = [&](auto body) {
    run_short(2, timeout, [&](lockstep::ThreadComm& comm) {
      TestMlp<double> m(d.dims, seed);
      Dp dp(comm, m);
      body(comm, dp, m);
    });
  };
  // Rank 0's two batches inside a join scope.
  auto train_in_join = [&](Dp& dp, TestMlp<double>& m) {
    auto join = dp.join([&](lockstep::step_result) {});
    train(dp, m, 0, 2);
  };

  SUBCASE("the rank with fewer batches stops: the others time out, naming it") {
    std::string what;
    try {
      run_two([&](lockstep::ThreadComm& comm, Dp& dp, TestMlp<double>& m) {
        train(dp, m, comm.rank(), comm.rank() == 0 ? 2 : 3);
      });
    } catch (const lockstep::timeout_error& e) {
      what = e.what();
    }
    CAPTURE(what);
    CHECK(what.find("never arrived") != std::string::npos);
    CHECK(what.find("rank(s) 0") != std::string::npos);
  }

  SUBCASE("the rank with fewer batches goes on to another collective: mismatch") {
    CHECK_THROWS_AS(run_two([&](lockstep::ThreadComm& comm, Dp& dp, TestMlp<double>& m) {
                      train(dp, m, comm.rank(), comm.rank() == 0 ? 2 : 3);
                      comm.barrier();  // e.g. an end-of-epoch barrier or metric
                    }),
                    lockstep::mismatch_error);
  }

  SUBCASE("only some ranks open a join scope: mismatch") {
    CHECK_THROWS_AS(run_two([&](lockstep::ThreadComm& comm, Dp& dp, TestMlp<double>& m) {
                      if (comm.rank() == 0) train_in_join(dp, m);
                      else train(dp, m, 1, 3);
                    }),
                    lockstep::mismatch_error);
  }

  SUBCASE("a rank that never enters the scope: the scope times out") {
    CHECK_THROWS_AS(run_two([&](lockstep::ThreadComm& comm, Dp& dp, TestMlp<double>& m) {
                      if (comm.rank() == 0) train_in_join(dp, m);  // rank 1 has left the job
                    }),
                    lockstep::timeout_error);
  }
}

TEST_CASE("join misuse is a config_error") {
  auto comms = lockstep::ThreadComm::create_group(1);
  const auto seed = fresh_seed();
  CAPTURE(seed);
  auto d = make_data(seed, 50);
  TestMlp<double> m(d.dims, seed);
  lockstep::DataParallel<TestMlp<double>, lockstep::ThreadComm> dp(comms[0], m);
  CHECK_THROWS_AS((void)dp.join({}), lockstep::config_error);
  {
    auto join = dp.join([](lockstep::step_result) {});
    CHECK_THROWS_AS((void)dp.join([](lockstep::step_result) {}), lockstep::config_error);
    auto step = dp.step();
    CHECK_THROWS_AS(join.leave(), lockstep::config_error);
    (void)step.finish();
    CHECK(join.leave() == 0);
  }
  auto step = dp.step();
  CHECK_THROWS_AS((void)dp.join([](lockstep::step_result) {}), lockstep::config_error);
  (void)step.finish();
  lockstep::Join join(dp, [](lockstep::step_result) {});  // the class, deduced
  CHECK(join.leave() == 0);

  // Full sharding: the accumulation stays what it was when the scope opened.
  TestMlp<double> z(d.dims, seed);
  lockstep::DataParallel<TestMlp<double>, lockstep::ThreadComm, lockstep::Accumulate<>, lockstep::FullySharded> zdp(
      comms[0], z, {}, lockstep::Accumulate<>(2));
  lockstep::Sgd opt({.lr = 0.1});
  const auto on_shard = [&](std::span<const lockstep::param_slice> s) { opt.step(s); };
  auto zjoin = zdp.join([](lockstep::step_result) {}, on_shard);
  const auto micro_step = [&](int j) {
    auto step = zdp.step();
    const std::vector<std::size_t> rows{static_cast<std::size_t>(j)};
    z.forward_backward(d.X64, d.y, rows, step.on_gradient_ready(), 1.0, [&](std::size_t l, bool forward) {
      return zdp.use_block(z.blocks()[2 * l], forward ? lockstep::pass::forward : lockstep::pass::backward);
    });
    return step.finish(on_shard);
  };
  CHECK_FALSE(micro_step(0).synced);
  CHECK(micro_step(1).synced);  // a whole cycle of 2
  zdp.accumulation().set_steps(3);
  CHECK_THROWS_WITH_AS((void)zdp.step(), doctest::Contains("accumulation changed from 2 to 3"), lockstep::config_error);
  zdp.accumulation().set_steps(2);  // back: the scope goes on
  CHECK_FALSE(micro_step(2).synced);
  CHECK(micro_step(3).synced);
  CHECK(zjoin.leave() == 0);
}

}  // TEST_SUITE
