// DataParallel's contract beyond equivalence: construction checks and broadcast, the
// bucket plan, the one-time rebuild, misuse errors, statistics, mode selection.
#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <mutex>
#include <numeric>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <lockstep/lockstep.hpp>

#include "equivalence.hpp"
#include "mlp.hpp"
#include "test_util.hpp"

using namespace lockstep_test;
using lockstep::detail::make_bucket_plan;

namespace {

//! Two samples of `features` inputs, every input `fill` but X[at] = `odd`; labels 1 and 2.
struct two_samples {
  std::vector<float> X;
  std::vector<int> y{1, 2};
  std::vector<std::size_t> rows{0, 1};
  two_samples(std::size_t features, float fill, std::size_t at, float odd) : X(features * 2, fill) { X[at] = odd; }
};

//! A communicator for the bucket tuner alone: one rank, a clock the test sets (each stamp
//! takes the next preset time) and an all-reduce costing alpha + bytes / beta µs.
struct TunerComm {
  std::vector<double> times;  // the stamps, in the order they are taken
  std::size_t next = 0;
  double alpha = 0, beta = 1;  // µs, bytes per µs
  int size() const { return 1; }
  // One rank: the tuner broadcasts nothing (these only make the type complete).
  lockstep::HostMemory memory() const { return {}; }
  struct done {
    void wait() {}
  };
  done broadcast(void*, std::size_t, lockstep::dtype, int) { throw std::logic_error("one rank: nothing to broadcast"); }
};

}  // namespace

//! The test communicators' costs: stamps in µs, an all-reduce of n bytes costing
//! alpha + n / beta µs (C's fields); C's bucket_costs adds now().
template <class C>
struct model_costs {
  static constexpr bool available = true;
  using stamp_type = double;
  static double elapsed_us(C&, double a, double b) { return b - a; }
  static std::vector<double> probe_us(C& c, const std::vector<std::size_t>& counts, lockstep::dtype t) {
    std::vector<double> us;
    for (auto n : counts) us.push_back(c.alpha + static_cast<double>(n * lockstep::size_of(t)) / c.beta);
    return us;
  }
};

template <>
struct lockstep::detail::bucket_costs<TunerComm> : model_costs<TunerComm> {
  static double now(TunerComm& c) { return c.times.at(c.next++); }
};

namespace {

//! ThreadComm with a clock for the bucket tuner inside DataParallel: each stamp `gap` µs after
//! the one before, all-reduces costing alpha + bytes / beta µs; counts its stamps.
struct ClockedThreadComm : lockstep::ThreadComm {
  explicit ClockedThreadComm(const lockstep::ThreadComm& c) : ThreadComm(c) {}
  double gap = 1, alpha = 0, beta = 1, clock = 0;
  int stamps = 0;
};

//! TestMlp counting the gradients bound into lockstep's arena.
struct CountingMlp : TestMlp<float> {
  using TestMlp<float>::TestMlp;
  int binds = 0;
  void bind_gradient(std::size_t i, void* p) {
    ++binds;
    TestMlp<float>::bind_gradient(i, p);
  }
};

}  // namespace

template <>
struct lockstep::detail::bucket_costs<ClockedThreadComm> : model_costs<ClockedThreadComm> {
  static double now(ClockedThreadComm& c) {
    ++c.stamps;
    return c.clock += c.gap;
  }
};

namespace {

//! The tuner's cap for 40 parameters of 1 MiB (f32) reported every `gap` µs (reverse
//! registration order), all-reduces costing alpha + bytes/beta.
std::size_t tuned_cap(double gap, double alpha, double beta, std::string& why) {
  const std::size_t n = 40, each = (1u << 20) / 4;
  std::vector<lockstep::parameter> params;
  std::vector<std::vector<float>> store(n, std::vector<float>(each));
  for (std::size_t i = 0; i < n; ++i)
    params.push_back(lockstep::param<float>("p" + std::to_string(i), store[i].data(), store[i].data(),
                                            {static_cast<std::int64_t>(each)}));
  TunerComm comm{.times = {0.0}, .alpha = alpha, .beta = beta};
  std::vector<std::size_t> order;
  for (std::size_t i = n; i-- > 0;) {
    order.push_back(i);
    comm.times.push_back(gap * static_cast<double>(order.size()));
  }
  lockstep::detail::bucket_tuner<TunerComm> timer;
  timer.start(comm);
  for (auto i : order) timer.mark(comm, i);
  lockstep::BucketPolicy policy{.tune = true};
  lockstep::sync_stats st;
  const std::vector<std::size_t> sizes(n, each);
  const bool changed = timer.settle(
      comm, order, params, policy,
      [&](lockstep::dtype t, auto idx, auto p) { return make_bucket_plan(t, idx, sizes, p, 1); }, st);
  CHECK(changed == (policy.cap_bytes != lockstep::BucketPolicy{}.cap_bytes));
  CHECK(st.tuned_cap_bytes == policy.cap_bytes);
  CHECK_FALSE(timer.on());
  why = st.tuning;
  return policy.cap_bytes >> 20;
}

}  // namespace

TEST_SUITE("cpu") {

TEST_CASE("bucket tuner: the cost model picks small buckets when backward is slow and one bucket when it is not") {
  std::string why;
  // Backward 2 ms per gradient, all-reduce ~0.1 ms per MiB: the last bucket alone is exposed,
  // so a cap whose last bucket holds one gradient wins — 1 MiB, or 2 MiB, whose cut of the 39
  // gradients after the first bucket leaves the last one alone too (a tie: the larger cap).
  CHECK(tuned_cap(2000, 10, 1e4, why) == 2);
  CHECK(why.find("cap 2 MiB") == 0);
  CHECK(why.find("1 MiB 115, 2 MiB 115, 4 MiB 325,") != std::string::npos);  // 1, 1 and 3 gradients last
  // Every gradient ready at once (no overlap to win) and 200 µs per launch: the fewest
  // buckets win — the first 1 MiB bucket and one of the other 39 MiB, first cut at 64 MiB.
  CHECK(tuned_cap(0, 200, 1e5, why) == 64);
  CHECK(why.find("128 MiB") == std::string::npos);  // it cuts as 64 MiB does: not tried
  // Between the two: gradients every 50 µs, 100 µs per launch, 0.1 ms per MiB — neither
  // extreme; the choice ends the sync no later than either extreme would.
  const std::size_t mid = tuned_cap(50, 100, 1e4, why);
  CAPTURE(why);
  CHECK(mid > 1);
  CHECK(mid < 64);
  // Launches cost nothing and every gradient is ready at once: every cap ends the sync at the
  // same time, and the tie goes to the fewest launches (the largest cap tried, one bucket).
  CHECK(tuned_cap(0, 0, 1e4, why) == 64);
}

TEST_CASE(
    "bucket tuner: DataParallel times step tune_step and binds the gradients once after it - rank 0's clock decides") {
  LOCKSTEP_SEEDED(std::mt19937_64 rng);
  const std::vector<int> dims{256, 1024, 1024, 4};  // 1 MiB + 4 MiB + 16 KiB of weights
  const std::size_t rows_per_rank = 4;
  std::normal_distribution<float> nd;
  std::vector<float> X(static_cast<std::size_t>(dims[0]) * rows_per_rank * 2);
  for (auto& x : X) x = nd(rng);
  std::vector<int> y(rows_per_rank * 2);
  for (auto& v : y) v = static_cast<int>(rng() % 4);
  const std::uint64_t model_seed = rng();
  // Six optimizer steps of `micro` micro-steps on two ranks; rank `slow`'s clock puts 5 ms
  // between gradients (small buckets pay), the other's none (one bucket pays). With `reload`,
  // each rank loads its own plan state after step 1 (before the tuning: the tuner still times
  // its step). Returns each rank's parameters and tuned cap.
  struct result {
    std::vector<std::vector<float>> values{2};
    std::vector<std::size_t> caps = std::vector<std::size_t>(2);
  };
  auto train = [&](lockstep::BucketPolicy policy, int slow, int micro = 1, bool reload = false) {
    result out;
    lockstep::run(lockstep::Threads{2}, [&](auto& ctx) {
      const int r = ctx.rank();
      ClockedThreadComm comm(ctx.comm());
      comm.gap = r == slow ? 5000 : 0;
      comm.alpha = r == slow ? 10 : 200;
      comm.beta = r == slow ? 1e4 : 1e5;
      CountingMlp m(dims, model_seed);
      lockstep::DataParallel<CountingMlp, ClockedThreadComm, lockstep::Accumulate<>> dp(
          comm, m, lockstep::DataParallelOptions{.buckets = policy}, lockstep::Accumulate<>(micro));
      std::vector<std::size_t> rows(rows_per_rank);
      std::iota(rows.begin(), rows.end(), static_cast<std::size_t>(r) * rows_per_rank);
      const int timed = policy.tune ? policy.tune_step : 0, params = 6;
      for (int s = 1; s <= 6; ++s) {
        for (int k = 0; k < micro; ++k) {
          auto step = dp.step();
          m.forward_backward(X, y, rows, step.on_gradient_ready());
          CHECK(step.finish().synced == (k + 1 == micro));
        }
        m.sgd(0.05);
        if (reload && s == 1) dp.load_plan_state(dp.plan_state());
        CAPTURE(s);
        CAPTURE(r);
        const auto& st = dp.stats();
        CHECK(comm.stamps == (s < timed ? 0 : timed > 0 ? 1 + params : 0));  // one start, one per gradient
        CHECK((st.tuned_cap_bytes != 0) == (timed > 0 && s >= timed));
        // Bound once, in the final layout: after the first step's order, and after the tuning.
        const int bound_from = std::max(2, timed + 1);
        CHECK(m.binds == (s < bound_from ? 0 : params));
        CHECK(st.zero_copy == (s >= bound_from));
      }
      out.values[static_cast<std::size_t>(r)] = m.flat_values();
      out.caps[static_cast<std::size_t>(r)] = dp.stats().tuned_cap_bytes;
      if (policy.tune) CHECK(dp.stats().tuning.find("rank 0's choice") != std::string::npos);
    });
    return out;
  };
  const auto plain = train({}, 0);
  CHECK(plain.values[0] == plain.values[1]);
  const auto fast0 = train({.tune = true}, 1);  // rank 0 sees no backward to overlap
  const auto slow0 = train({.tune = true}, 0);
  const auto first = train({.tune = true, .tune_step = 1}, 0);
  const auto reloaded = train({.tune = true}, 0, 1, true);
  // The cap it will choose given from the start: no re-cut, but the binding still waits for it.
  const auto same = train({.cap_bytes = fast0.caps[0], .tune = true}, 1);
  for (const auto* run : {&fast0, &slow0, &first, &reloaded, &same}) {
    CHECK(run->caps[0] == run->caps[1]);       // rank 0's, broadcast
    CHECK(run->values[0] == plain.values[0]);  // ThreadComm sums each element in rank order: any cut, the same bits
    CHECK(run->values[1] == plain.values[0]);
  }
  CHECK(fast0.caps[0] > slow0.caps[0]);
  CHECK(slow0.caps[0] == first.caps[0]);
  CHECK(slow0.caps[0] == reloaded.caps[0]);
  CHECK(same.caps[0] == fast0.caps[0]);
  // Accumulation: the tuner counts synchronising steps (the third sync is the sixth micro-step).
  const auto plain2 = train({}, 0, 2);
  const auto accum = train({.tune = true}, 0, 2);
  CHECK(accum.caps[0] == slow0.caps[0]);
  CHECK(accum.values[0] == plain2.values[0]);
  CHECK(accum.values[1] == plain2.values[0]);
  // A step to time is counted from 1.
  lockstep::run(lockstep::Threads{2}, [&](auto& ctx) {
    ClockedThreadComm comm(ctx.comm());
    CountingMlp m({8, 8, 4}, model_seed);
    using DP = lockstep::DataParallel<CountingMlp, ClockedThreadComm>;
    CHECK_THROWS_WITH_AS(DP(comm, m, lockstep::DataParallelOptions{.buckets = {.tune = true, .tune_step = 0}}),
                         doctest::Contains("tune_step is 0"), lockstep::config_error);
  });
}

TEST_CASE("bucket tuner: a tuned cap travels in the plan state and comes back on load") {
  using lockstep::detail::decode_plan_state;
  using lockstep::detail::encode_plan_state;
  const std::vector<std::size_t> order{2, 0, 1};
  const auto untuned = encode_plan_state({true, false, order, 0});
  CHECK(untuned.front() == 1);  // format 1, as before tuning existed
  CHECK(decode_plan_state(untuned, 3).tuned_cap == 0);
  const auto tuned = encode_plan_state({true, false, order, std::size_t{32} << 20});
  CHECK(tuned.front() == 2);
  const auto back = decode_plan_state(tuned, 3);
  CHECK(back.order == order);
  CHECK(back.tuned_cap == (std::size_t{32} << 20));
  auto bad = tuned;
  bad.back() = -1;
  CHECK_THROWS_AS(decode_plan_state(bad, 3), lockstep::checkpoint_error);
  // A DataParallel adopts the saved cap with the saved order (the resumed run cuts its arena
  // as the tuned run did): a 64-byte cap on a 108-float model makes several buckets.
  lockstep::run(lockstep::Threads{2}, [&](auto& ctx) {
    TestMlp<float> m({8, 8, 4}, 3);
    lockstep::DataParallel dp(ctx, m, lockstep::DataParallelOptions{.buckets = {.tune = true}});
    const two_samples b(8, 0.5f, 3, -1.0f);
    auto one = [&] {
      auto s = dp.step();
      m.forward_backward(b.X, b.y, b.rows, s.on_gradient_ready());
      return s.finish();
    };
    CHECK(one().synced);
    CHECK(dp.stats().bucket_count == 1);
    CHECK(dp.stats().tuned_cap_bytes == 0);  // ThreadComm gives the tuner no costs
    auto st = dp.plan_state();
    REQUIRE(st.front() == 1);
    st.front() = 2;
    st.push_back(64);
    dp.load_plan_state(st);
    CHECK(one().synced);
    CHECK(dp.stats().bucket_count > 1);
    CHECK(dp.stats().tuned_cap_bytes == 64);
    CHECK(dp.stats().tuning.find("from the checkpoint") != std::string::npos);
    CHECK(dp.plan_state() == st);  // and it is saved again
  });
}

TEST_CASE("bucket plan: every element of every parameter lies in exactly one slice") {
  LOCKSTEP_SEEDED(std::mt19937_64 rng);
  for (int trial = 0; trial < 200; ++trial) {
    std::uniform_int_distribution<std::size_t> sz(0, 300), nparams(1, 12), cap(1, 700);
    std::vector<std::size_t> sizes(nparams(rng));
    for (auto& s : sizes) s = sz(rng);
    std::vector<std::size_t> order(sizes.size());
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng);
    const std::size_t align = (trial % 2) ? 1 : 8;
    lockstep::BucketPolicy pol{.first_bytes = cap(rng) * 4, .cap_bytes = cap(rng) * 4};
    auto p = make_bucket_plan(lockstep::dtype::f32, order, sizes, pol, align);
    CAPTURE(trial);
    std::vector<std::vector<int>> hit(sizes.size());
    for (std::size_t i = 0; i < sizes.size(); ++i) hit[i].assign(sizes[i], 0);
    std::size_t prev_end = 0;
    for (std::size_t b = 0; b < p.buckets.size(); ++b) {
      const auto& bk = p.buckets[b];
      CHECK(bk.begin == prev_end);
      prev_end = bk.end;
      const std::size_t limit = (b == 0 ? pol.first_bytes : pol.cap_bytes) / 4;
      CHECK(bk.elements() <= std::max<std::size_t>(lockstep::detail::round_up(limit, align), align));
      for (const auto& s : bk.slices) {
        CHECK(s.arena_offset >= bk.begin);
        CHECK(s.arena_offset + s.count <= bk.end);
        for (std::size_t e = 0; e < s.count; ++e) hit[s.param][s.param_offset + e]++;
      }
    }
    CHECK(prev_end == p.total);
    bool all_once = true;
    for (auto& h : hit)
      for (int c : h) all_once &= (c == 1);
    CHECK(all_once);
    for (std::size_t k = 0; k < p.order.size(); ++k) CHECK(p.offset[k] % align == 0);
    // Launch units partition the buckets in order; a unit of several buckets holds slices of
    // a single parameter only (so it always completes at once, on every rank).
    std::size_t next = 0;
    for (const auto& u : p.units) {
      CHECK(u.first == next);
      CHECK(u.last > u.first);
      next = u.last;
      if (u.last - u.first > 1)
        for (std::size_t b = u.first; b < u.last; ++b)
          for (const auto& sl : p.buckets[b].slices) CHECK(sl.param == p.buckets[u.first].slices.front().param);
    }
    CHECK(next == p.buckets.size());
  }
}

TEST_CASE("construction broadcasts rank 0's parameters") {
  const auto seed = fresh_seed();
  CAPTURE(seed);
  std::vector<std::vector<double>> after(3);
  TestMlp<double> rank0(std::vector<int>{5, 4, 3}, seed);
  lockstep::run(lockstep::Threads{3}, [&](auto& ctx) {
    TestMlp<double> m({5, 4, 3}, seed + static_cast<std::uint64_t>(ctx.rank()));
    lockstep::DataParallel<TestMlp<double>, lockstep::ThreadComm> dp(ctx, m);
    after[static_cast<std::size_t>(ctx.rank())] = m.flat_values();
  });
  for (auto& a : after) CHECK(a == rank0.flat_values());
}

TEST_CASE("frozen parameters (model (g)) are rank 0's after construction - never reduced - checked for shape") {
  const auto seed = fresh_seed();
  CAPTURE(seed);
  const TestMlpWithFrozen<float> rank0({5, 4, 3}, seed, seed + 100);
  std::vector<std::vector<float>> after(3);
  lockstep::run(lockstep::Threads{3}, [&](auto& ctx) {
    const auto r = static_cast<std::uint64_t>(ctx.rank());
    TestMlpWithFrozen<float> m({5, 4, 3}, seed + r, seed + 100 + r);  // another table on every rank
    lockstep::DataParallel dp(ctx, m);
    CHECK(dp.parameters().size() == 4);  // the table is not among the reduced parameters
    after[static_cast<std::size_t>(ctx.rank())] = m.table();
  });
  for (auto& a : after) CHECK(a == rank0.table());
  std::string msg;
  CHECK_THROWS_AS(lockstep::run(lockstep::Threads{2},
                                [&](auto& ctx) {
                                  TestMlpWithFrozen<float> m({5, 4, 3}, 1, 2, ctx.rank() == 1 ? 38 : 37);
                                  try {
                                    lockstep::DataParallel dp(ctx, m);
                                  } catch (const lockstep::mismatch_error& e) {
                                    if (ctx.rank() == 0) msg = e.what();
                                    throw;
                                  }
                                }),
                  lockstep::mismatch_error);
  CHECK(msg.find("frozen parameter 0 is 'table [37] f32' on rank 0 but 'table [38] f32' on rank 1") !=
        std::string::npos);
}

TEST_CASE("ranks with different models fail on every rank - naming the parameter and both shapes") {
  std::vector<std::string> msgs(3);
  CHECK_THROWS_AS(lockstep::run(lockstep::Threads{3},
                                [&](auto& ctx) {
                                  const int hidden = ctx.rank() == 2 ? 6 : 4;
                                  TestMlp<float> m({5, hidden, 3}, 1);
                                  try {
                                    lockstep::DataParallel<TestMlp<float>, lockstep::ThreadComm> dp(ctx, m);
                                  } catch (const lockstep::mismatch_error& e) {
                                    msgs[static_cast<std::size_t>(ctx.rank())] = e.what();
                                    throw;
                                  }
                                }),
                  lockstep::mismatch_error);
  for (auto& m : msgs) {
    CAPTURE(m);
    CHECK(m.find("parameter 0") != std::string::npos);
    CHECK(m.find("layer0.weight [4,5] f32") != std::string::npos);
    CHECK(m.find("layer0.weight [6,5] f32") != std::string::npos);
    CHECK(m.find("rank 2") != std::string::npos);
  }
}

TEST_CASE("a rank with more parameters - or another element type - is named too") {
  std::string msg;
  CHECK_THROWS_AS(lockstep::run(lockstep::Threads{2},
                                [&](auto& ctx) {
                                  std::vector<int> dims =
                                      ctx.rank() == 1 ? std::vector<int>{5, 4, 3, 2} : std::vector<int>{5, 4, 3};
                                  TestMlp<float> m(dims, 1);
                                  try {
                                    lockstep::DataParallel<TestMlp<float>, lockstep::ThreadComm> dp(ctx, m);
                                  } catch (const lockstep::mismatch_error& e) {
                                    if (ctx.rank() == 0) msg = e.what();
                                    throw;
                                  }
                                }),
                  lockstep::mismatch_error);
  CHECK(msg.find("parameter 4") != std::string::npos);
  CHECK(msg.find("nothing (it has 4 parameters)") != std::string::npos);
}

TEST_CASE("the bucket plan is rebuilt once from rank 0's arrival order - identically everywhere") {
  // The model reports gradients first layer first (not reverse order), differently per rank
  // after the first layer; every rank must adopt rank 0's order.
  const auto seed = fresh_seed();
  CAPTURE(seed);
  std::vector<lockstep::sync_stats> st(3);
  std::vector<std::vector<double>> vals(3);
  lockstep::run(lockstep::Threads{3}, [&](auto& ctx) {
    TestMlp<double> m({6, 5, 4, 3}, seed);
    lockstep::DataParallel<TestMlp<double>, lockstep::ThreadComm> dp(ctx, m,
                                                                     {.buckets = {.first_bytes = 48, .cap_bytes = 96}});
    std::mt19937_64 rng(seed);
    auto X = random_vector<double>(6 * 8, rng);
    std::vector<int> y{0, 1, 2, 0, 1, 2, 0, 1};
    std::vector<std::size_t> rows{0, 1, 2, 3, 4, 5, 6, 7};
    for (int s = 0; s < 3; ++s) {
      auto step = dp.step();
      m.forward_backward(X, y, rows, [](std::size_t) {});
      // Report in a custom order (rank 0: 0..5; others: reversed).
      for (std::size_t k = 0; k < 6; ++k) step.gradient_ready(ctx.rank() == 0 ? k : 5 - k);
      if (step.finish()) m.sgd(0.1);
    }
    st[static_cast<std::size_t>(ctx.rank())] = dp.stats();
    vals[static_cast<std::size_t>(ctx.rank())] = m.flat_values();
  });
  for (auto& s : st) CHECK(s.rebuilt);
  CHECK(vals[1] == vals[0]);
  CHECK(vals[2] == vals[0]);
}

TEST_CASE("misuse is reported clearly") {
  lockstep::run(lockstep::Threads{1}, [&](auto& ctx) {
    TestMlp<float> m({3, 2}, 1);
    lockstep::DataParallel<TestMlp<float>, lockstep::ThreadComm> dp(ctx, m);
    {
      auto s = dp.step();
      s.gradient_ready(0);
      CHECK_THROWS_WITH_AS(s.gradient_ready(0), doctest::Contains("reported ready twice"), lockstep::config_error);
      CHECK_THROWS_WITH_AS(s.gradient_ready(7), doctest::Contains("parameter index 7"), lockstep::config_error);
      CHECK_THROWS_WITH_AS((void)dp.step(), doctest::Contains("previous step is still open"), lockstep::config_error);
      s.finish();
      CHECK_THROWS_AS(s.finish(), lockstep::config_error);
    }
    CHECK_THROWS_AS(lockstep::Accumulate<>(0), lockstep::config_error);
  });
}

TEST_CASE("statistics count buckets - bytes and syncs - Accumulate<> K changes at the next cycle") {
  lockstep::run(lockstep::Threads{2}, [&](auto& ctx) {
    TestMlp<float> m({8, 8, 4}, 3);  // 64+8+32+4 = 108 floats
    lockstep::DataParallel<TestMlp<float>, lockstep::ThreadComm, lockstep::Accumulate<>> dp(
        ctx, m, {.buckets = {.first_bytes = 1 << 20, .cap_bytes = 1 << 20}}, lockstep::Accumulate<>(2));
    const two_samples b(8, 0.5f, 3, -1.0f);
    auto micro = [&] {
      auto s = dp.step();
      m.forward_backward(b.X, b.y, b.rows, s.on_gradient_ready());
      return s.finish();
    };
    CHECK_FALSE(micro().synced);
    CHECK(micro().synced);
    dp.accumulation().set_steps(3);
    CHECK_FALSE(micro().synced);
    CHECK_FALSE(micro().synced);
    CHECK(micro().synced);
    const auto& st = dp.stats();
    CHECK(st.micro_steps == 5);
    CHECK(st.syncs == 2);
    CHECK(st.zero_copy);
    CHECK(st.bucket_count == 1);
    CHECK(st.buckets_reduced == 2);
    CHECK(st.bytes_reduced >= 2 * 108 * sizeof(float));
    CHECK(st.comm_seconds >= 0.0);
  });
}

TEST_CASE("Auto picks CPU threads from LOCKSTEP_CPU_RANKS - and rejects nonsense") {
  ::setenv("LOCKSTEP_CPU_RANKS", "3", 1);
  auto p = lockstep::decide(lockstep::detect());
  CHECK(p.kind == lockstep::mode_kind::cpu_threads);
  CHECK(p.ranks == 3);
  std::atomic<int> seen{0};
  lockstep::run(lockstep::Auto{}, [&](auto& ctx) {
    CHECK(ctx.size() == 3);
    seen.fetch_add(1);
  });
  CHECK(seen.load() == 3);
  ::setenv("LOCKSTEP_CPU_RANKS", "zero", 1);
  CHECK_THROWS_WITH_AS(lockstep::detect(), doctest::Contains("LOCKSTEP_CPU_RANKS"), lockstep::config_error);
  ::setenv("LOCKSTEP_CPU_RANKS", "0", 1);
  CHECK_THROWS_AS(lockstep::detect(), lockstep::config_error);
  ::unsetenv("LOCKSTEP_CPU_RANKS");
  CHECK(lockstep::decide(lockstep::detect()).ranks >= 1);
}

TEST_CASE("decide: under a launcher - MPI launchers mean MPI processes when MPI is built") {
  lockstep::environment e;
  e.hardware_threads = 2;
  for (const char* name : {"openmpi", "mpich", "slurm", "torchrun", "lockstep-run"}) {
    CAPTURE(name);
    lockstep::launch_info l;
    l.world = 4;
    l.rank = 1;
    l.launcher = name;
    e.launcher = l;
    const bool mpi_launcher = std::string(name) != "torchrun" && std::string(name) != "lockstep-run";
    if (mpi_launcher) {
      const auto p = lockstep::decide(e, false, true);
      CHECK(p.kind == lockstep::mode_kind::mpi_processes);
      CHECK(p.ranks == 4);
    } else {
      CHECK_THROWS_WITH_AS(lockstep::decide(e, false, true), doctest::Contains("no GPU is visible"),
                           lockstep::config_error);
    }
    CHECK_THROWS_AS(lockstep::decide(e, false, false), lockstep::config_error);  // nothing to run with
  }
}

TEST_CASE("policies and options by instance in any order - deduced from the context") {
  lockstep::run(lockstep::Threads{2}, [&](lockstep::context<lockstep::ThreadComm>& ctx) {
    TestMlp<double> m({5, 4, 3}, 7);
    // Deduced: the communicator from the context, the policies from the arguments' types.
    lockstep::DataParallel a(ctx, m);
    static_assert(std::is_same_v<decltype(a), lockstep::DataParallel<TestMlp<double>, lockstep::ThreadComm>>);
    lockstep::DataParallel b(ctx, m, lockstep::DynamicScale({.init_scale = 512.0}), lockstep::Accumulate<>(3));
    static_assert(std::is_same_v<decltype(b), lockstep::DataParallel<TestMlp<double>, lockstep::ThreadComm,
                                                                     lockstep::DynamicScale, lockstep::Accumulate<>>>);
    CHECK(b.accumulation().steps() == 3);
    CHECK(b.scaler().scale() == 512.0);
    // Braced options first, then policy instances in either order.
    lockstep::DataParallel c(ctx, m, {.zero_copy = false}, lockstep::Accumulate<>(2), lockstep::StaticScale(64.0));
    CHECK(c.accumulation().steps() == 2);
    CHECK(c.scaler().scale() == 64.0);
    // Named types, the arguments in any order, options among them; what is not given is default.
    lockstep::DataParallel<TestMlp<double>, lockstep::ThreadComm, lockstep::Accumulate<>, lockstep::StaticScale> d(
        ctx, m, lockstep::StaticScale(4.0), lockstep::DataParallelOptions{.zero_copy = false},
        lockstep::Accumulate<>(5));
    CHECK(d.accumulation().steps() == 5);
    CHECK(d.scaler().scale() == 4.0);
    lockstep::DataParallel<TestMlp<double>, lockstep::ThreadComm, lockstep::Accumulate<>, lockstep::StaticScale> e(
        ctx, m, lockstep::Accumulate<>(4));
    CHECK(e.scaler().scale() == lockstep::StaticScale().scale());
    // The options given by instance are the ones used.
    for (int i = 0; i < 2; ++i) (void)d.step().finish();
    CHECK_FALSE(d.stats().zero_copy);
  });
}

TEST_CASE("a rank that runs one step more than its peer is told at once that the peer has left") {
  // No LOCKSTEP_TIMEOUT is set: without the departure check this waits 60 s.
  const auto t0 = std::chrono::steady_clock::now();
  std::string what;
  try {
    lockstep::run(lockstep::Threads{2}, [&](lockstep::context<lockstep::ThreadComm>& ctx) {
      TestMlp<double> m({5, 4, 3}, 11);
      lockstep::DataParallel dp(ctx, m);
      const int steps = ctx.rank() == 0 ? 2 : 3;  // uneven inputs, no Join
      for (int s = 0; s < steps; ++s) (void)dp.step().finish();
    });
  } catch (const lockstep::mismatch_error& e) {
    what = e.what();
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  CAPTURE(what);
  CHECK(secs < 10.0);
  CHECK(what.find("rank 0 has left the training body") != std::string::npos);
  CHECK(what.find("rank 1 is waiting for it in") != std::string::npos);
  CHECK(what.find("dp.join()") != std::string::npos);
}

TEST_CASE("run(Threads{n}) refuses a negative count") {
  int calls = 0;
  CHECK_THROWS_WITH_AS(lockstep::run(lockstep::Threads{-1}, [&](auto&) { ++calls; }),
                       doctest::Contains("negative number of ranks"), lockstep::config_error);
  CHECK_THROWS_WITH_AS(lockstep::run(lockstep::Threads{.ranks = 2, .max_restarts = -1}, [&](auto&) { ++calls; }),
                       doctest::Contains("negative number of restarts"), lockstep::config_error);
  CHECK(calls == 0);
}

TEST_CASE("run(Threads{.max_restarts}) starts a failed rank's body again - up to the count in all - and the context "
          "counts the restarts") {
  // Rank 1 fails on its first `fails` starts; with max_restarts = 2 the third start completes.
  for (const int fails : {1, 2, 3}) {
    CAPTURE(fails);
    std::mutex m;
    std::vector<std::pair<int, int>> starts;  // (rank, restart_count)
    bool enabled = true;
    auto body = [&](lockstep::context<lockstep::ThreadComm>& ctx) {
      {
        std::lock_guard lk(m);
        starts.emplace_back(ctx.rank(), ctx.restart_count());
        enabled = enabled && ctx.restarts_failed();
      }
      if (ctx.rank() == 1 && ctx.restart_count() < fails)
        throw std::runtime_error("start " + std::to_string(ctx.restart_count()) + " failed");
    };
    const lockstep::Threads mode{.ranks = 2, .max_restarts = 2};
    if (fails <= 2) {
      lockstep::run(mode, body);  // (a failure followed by a restart is not the job's)
    } else {
      CHECK_THROWS_WITH_AS(lockstep::run(mode, body), doctest::Contains("start 2 failed"), std::runtime_error);
    }
    std::vector<int> counts;
    for (const auto& [rank, count] : starts)
      if (rank == 1) counts.push_back(count);
    std::vector<int> want;
    for (int k = 0; k <= std::min(fails, 2); ++k) want.push_back(k);
    CHECK(counts == want);
    CHECK(enabled);
  }
}

TEST_CASE("a model whose bind_gradient does not take effect is rejected") {
  struct Liar {
    std::vector<float> w{1, 2, 3}, g{0, 0, 0};
    std::vector<lockstep::parameter> parameters() { return {lockstep::param<float>("w", std::span(w), std::span(g))}; }
    void bind_gradient(std::size_t, void*) {}  // ignores the storage
  };
  lockstep::run(lockstep::Threads{1}, [&](auto& ctx) {
    Liar m;
    // The layout is final at construction when nothing is rebuilt: bound (and caught) there.
    CHECK_THROWS_WITH_AS((lockstep::DataParallel(ctx, m, {.buckets = {.rebuild_after_first_step = false}})),
                         doctest::Contains("bind_gradient"), lockstep::config_error);
    // Otherwise at the start of the second cycle, when the rebuilt layout takes effect.
    lockstep::DataParallel dp(ctx, m);
    (void)dp.step().finish();
    CHECK_THROWS_WITH_AS((void)dp.step(), doctest::Contains("bind_gradient"), lockstep::config_error);
    // With zero_copy off it is fine.
    lockstep::DataParallel ok(ctx, m, {.zero_copy = false});
    (void)ok.step().finish();
    (void)ok.step().finish();
    CHECK_FALSE(ok.stats().zero_copy);
  });
}

TEST_CASE("bind_gradient is called once per parameter in the final layout - a model caching it stays right") {
  // A model that caches the storage bind_gradient gives it (as a GPU model keeps raw pointers
  // for its kernels) and counts the calls. Backward reports gradients in an order unlike the
  // initial layout's (first layer first), so the first step's arrivals reorder the plan.
  struct Caching : TestMlp<double> {
    using TestMlp<double>::TestMlp;
    std::vector<int> binds = std::vector<int>(6, 0);
    std::vector<void*> cached = std::vector<void*>(6, nullptr);
    void bind_gradient(std::size_t i, void* p) {
      ++binds[i];
      cached[i] = p;
      TestMlp<double>::bind_gradient(i, p);
    }
  };
  const auto seed = fresh_seed();
  CAPTURE(seed);
  const auto d = make_data(seed, 64);
  constexpr int steps = 4;
  constexpr std::size_t batch = 8;
  std::vector<std::vector<double>> got(2);
  lockstep::run(lockstep::Threads{2}, [&](lockstep::context<lockstep::ThreadComm>& ctx) {
    Caching m(d.dims, seed + 1);
    lockstep::DataParallel dp(ctx, m, {.buckets = {.first_bytes = 256, .cap_bytes = 512}});
    CHECK(m.binds == std::vector<int>(6, 0));  // not yet: the layout is not final
    for (int s = 0; s < steps; ++s) {
      auto step = dp.step();
      std::vector<std::size_t> rows;
      for (std::size_t r = 0; r < batch; ++r)
        rows.push_back((static_cast<std::size_t>(s) * 2 * batch + static_cast<std::size_t>(ctx.rank()) * batch + r) %
                       d.samples);
      m.forward_backward(d.X64, d.y, rows, [](std::size_t) {});
      const auto ready = step.on_gradient_ready();
      for (std::size_t i = 0; i < 6; ++i) ready(i);  // first layer first: unlike the initial layout
      if (step.finish()) m.sgd(0.05);
      if (s >= 1) {
        CHECK(m.binds == std::vector<int>(6, 1));  // bound once, when the rebuilt layout took effect
        for (std::size_t i = 0; i < 6; ++i) CHECK(m.cached[i] == dp.parameters()[i].grad);
      }
    }
    CHECK(dp.stats().rebuilt);
    CHECK(dp.stats().zero_copy);
    got[static_cast<std::size_t>(ctx.rank())] = m.flat_values();
  });
  const auto want = one_rank_reference<double>(d, batch, 2, 1, steps, seed + 1, 0.05);
  CHECK(got[0] == got[1]);
  CHECK(max_rel_diff(got[0], want) <= 1e-12);
}

}  // TEST_SUITE

TEST_SUITE("cpu") {

TEST_CASE("ranks that report gradients differently still issue the same collectives") {
  // Rank 0 reports every gradient, rank 1 none, rank 2 half: launch units go out in plan
  // order everywhere, so the ThreadComm mismatch check stays silent and results agree.
  const auto seed = fresh_seed();
  CAPTURE(seed);
  std::vector<std::vector<double>> vals(3);
  std::vector<lockstep::sync_stats> st(3);
  lockstep::run(lockstep::Threads{3}, [&](auto& ctx) {
    TestMlp<double> m({7, 9, 4}, seed);
    lockstep::DataParallel<TestMlp<double>, lockstep::ThreadComm> dp(
        ctx, m, {.buckets = {.first_bytes = 64, .cap_bytes = 160}});
    std::mt19937_64 rng(seed + static_cast<std::uint64_t>(ctx.rank()));
    auto X = random_vector<double>(7 * 6, rng);
    std::vector<int> y{0, 1, 2, 3, 0, 1};
    std::vector<std::size_t> rows{0, 1, 2, 3, 4, 5};
    for (int s = 0; s < 4; ++s) {
      auto step = dp.step();
      m.forward_backward(X, y, rows, [&](std::size_t i) {
        if (ctx.rank() == 0 || (ctx.rank() == 2 && i % 2 == 0)) step.gradient_ready(i);
      });
      if (step.finish()) m.sgd(0.1);
    }
    vals[static_cast<std::size_t>(ctx.rank())] = m.flat_values();
    st[static_cast<std::size_t>(ctx.rank())] = dp.stats();
  });
  CHECK(vals[1] == vals[0]);
  CHECK(vals[2] == vals[0]);
  CHECK(st[0].buckets_reduced == st[1].buckets_reduced);
  CHECK(st[0].buckets_reduced > 4);  // unit by unit, not fused
}

TEST_CASE("a model that never reports is reduced with one all-reduce per step after the first") {
  lockstep::run(lockstep::Threads{2}, [&](auto& ctx) {
    TestMlp<float> m({6, 8, 3}, 5);
    lockstep::DataParallel<TestMlp<float>, lockstep::ThreadComm> dp(ctx, m,
                                                                    {.buckets = {.first_bytes = 32, .cap_bytes = 64}});
    const two_samples b(6, 0.25f, 1, -0.5f);
    auto once = [&] {
      auto s = dp.step();
      m.forward_backward(b.X, b.y, b.rows, [](std::size_t) {});
      s.finish();
    };
    once();
    const auto first = dp.stats().buckets_reduced;
    CHECK(first >= 3);  // step 1: unit by unit (the model might still report later)
    once();
    once();
    CHECK(dp.stats().buckets_reduced == first + 2);  // then one fused all-reduce per step
  });
}

}  // TEST_SUITE

TEST_SUITE("cpu") {
TEST_CASE("ranks with different bucket policies fail on every rank instead of pairing wrong ranges") {
  std::vector<std::string> msgs(2);
  CHECK_THROWS_AS(
      lockstep::run(lockstep::Threads{2},
                    [&](auto& ctx) {
                      TestMlp<float> m({20, 30, 10}, 1);  // 940 floats
                      lockstep::BucketPolicy bp{.first_bytes = 1024, .cap_bytes = ctx.rank() == 0 ? 1024u : 2048u};
                      try {
                        lockstep::DataParallel<TestMlp<float>, lockstep::ThreadComm> dp(ctx, m, {.buckets = bp});
                      } catch (const lockstep::mismatch_error& e) {
                        msgs[static_cast<std::size_t>(ctx.rank())] = e.what();
                        throw;
                      }
                    }),
      lockstep::mismatch_error);
  for (auto& m : msgs) CHECK(m.find("different gradient bucket plans") != std::string::npos);
}
}  // TEST_SUITE
