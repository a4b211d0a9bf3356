// The fault suite on CPU ranks (ThreadComm): the quiet failures end every rank at once with the
// same message naming the rank, the collective's sequence number and what it was for (which
// bucket) — docs/reliability.md lists them with what PyTorch DDP does in the same case.
#include <doctest/doctest.h>

#include <span>

#include <type_traits>

#include <random>

#include <chrono>
#include <cmath>
#include <mutex>
#include <thread>
#include <string>
#include <vector>

#include <lockstep/lockstep.hpp>

#include "fault_train.hpp"
#include "mlp.hpp"
#include "test_util.hpp"

namespace {

using clock_type = std::chrono::steady_clock;
using Model = lockstep_test::TestMlp<float>;

// {8, 8, 8, 8, 8}: four 8×8 weights and four biases; zero-copy pads each to 64 floats, and
// 256-byte buckets make every bucket exactly 64 elements — equal counts, told apart by label.
const std::vector<int> dims{8, 8, 8, 8, 8};
constexpr lockstep::BucketPolicy equal_buckets{.first_bytes = 256, .cap_bytes = 256, .rebuild_after_first_step = false};

//! A bucket hook that, on one rank, lets one bucket's all-reduce fall through (as if an
//! exception there had been caught and the rank went on to the next bucket).
struct SkipOne {
  int rank = -1, at = -1, seen = 0;
  lockstep::ready_work reduce(lockstep::ThreadComm& comm, void* data, std::size_t n, lockstep::dtype t) {
    if (comm.rank() == rank && seen++ == at) return {};
    return comm.all_reduce(data, data, n, t, lockstep::reduce_op::avg);
  }
};

//! What a failed job left: every rank's error message, and how long the job took.
struct failure {
  std::vector<std::string> msgs;
  double secs = 0;
};

//! Runs body on n ranks (the job must fail).
template <class Body>
failure messages_of(int n, Body&& body) {
  failure f{std::vector<std::string>(static_cast<std::size_t>(n))};
  const auto t0 = clock_type::now();
  CHECK_THROWS(lockstep::run(lockstep::Threads{n}, [&](auto& ctx) {
    try {
      body(ctx);
    } catch (const std::exception& e) {
      f.msgs[static_cast<std::size_t>(ctx.rank())] = e.what();
      throw;
    }
  }));
  f.secs = std::chrono::duration<double>(clock_type::now() - t0).count();
  return f;
}

using lockstep_test::train_sgd;

struct data {
  std::vector<float> x;
  std::vector<int> y{0, 1, 2, 3, 4, 5, 6, 7};
  explicit data(std::uint64_t seed) {
    std::mt19937_64 rng(seed);
    x = lockstep_test::random_vector<float>(8 * 8, rng);
  }
};

//! The failure of n ranks that each train two steps, call change(ctx, m) (the fault), then train
//! two more.
template <class Change>
failure messages_around(int n, std::uint64_t seed, Change&& change) {
  const data d(seed);
  return messages_of(n, [&](auto& ctx) {
    Model m(dims, seed);
    lockstep::DataParallel dp(ctx, m, {.buckets = equal_buckets});
    train_sgd(m, dp, 2, d.x, d.y);
    change(ctx, m);
    train_sgd(m, dp, 2, d.x, d.y);
  });
}

}  // namespace

TEST_SUITE("cpu") {

TEST_CASE("fault_skip_collective: a rank that skips one bucket of equal size is named with both buckets") {
  const auto seed = lockstep_test::fresh_seed();
  CAPTURE(seed);
  const data d(seed);
  const auto [msgs, secs] = messages_of(3, [&](auto& ctx) {
    Model m(dims, seed);
    lockstep::DataParallel dp(ctx, m, {.buckets = equal_buckets}, SkipOne{.rank = 1, .at = 11});  // step 1's 4th
    train_sgd(m, dp, 4, d.x, d.y);
  });
  for (const auto& msg : msgs) {
    CAPTURE(msg);
    CHECK(msg == msgs[0]);  // every rank prints the same cause
    CHECK(msg.find("ranks called different collectives: rank 0 called all_reduce #") != std::string::npos);
    CHECK(msg.find("#24 of 64 f32 (avg) for bucket 3: 64 f32 at 192 but rank 1 called all_reduce #24 of 64 f32 "
                   "(avg) for bucket 4: 64 f32 at 256") != std::string::npos);
  }
  CHECK(secs < 5);
}

TEST_CASE("fault_extra_collective: one rank's extra metrics all-reduce is named on every rank") {
  const auto seed = lockstep_test::fresh_seed();
  const auto [msgs, secs] = messages_around(3, seed, [&](auto& ctx, Model&) {
    if (ctx.rank() == 2) {  // an evaluation only this rank runs
      double acc[2] = {0.5, 1.0};
      lockstep::all_reduce_scalars(ctx.comm(), std::span<double>(acc), lockstep::reduce_op::sum);
    }
  });
  for (const auto& msg : msgs) {
    CAPTURE(msg);
    CHECK(msg == msgs[0]);
    CHECK(msg.find("for bucket 0: 64 f32 at 0 but rank 2 called all_reduce #") != std::string::npos);
    CHECK(msg.find("of 2 f64 (sum)") != std::string::npos);
  }
  CHECK(secs < 5);
}

TEST_CASE("fault_shapes_changed: a rank that rebuilds its model after start is caught at its next step") {
  const auto seed = lockstep_test::fresh_seed();
  const auto [msgs, secs] = messages_around(3, seed, [&](auto& ctx, Model& m) {
    if (ctx.rank() == 1) m = Model({8, 8, 9, 8, 8}, seed);  // "loaded another checkpoint's architecture"
  });
  CAPTURE(msgs[1]);
  CHECK(msgs[1].find("rank 1: the model changed after DataParallel was built: parameter 2 is 'layer1.weight' "
                     "[9,8] f32 in new storage, but DataParallel was built with 'layer1.weight' [8,8] f32") !=
        std::string::npos);
  for (int r : {0, 2})
    CHECK(msgs[static_cast<std::size_t>(r)].find("because another rank failed: rank 1 failed") != std::string::npos);
  CHECK(secs < 5);
}

TEST_CASE("fault_straggler: a rank 10x slower is no failure - and is named as the slowest") {
  const auto seed = lockstep_test::fresh_seed();
  const data d(seed);
  std::vector<lockstep::straggler_report> reports(4);
  lockstep::run(lockstep::Threads{4}, [&](auto& ctx) {
    Model m(dims, seed);
    lockstep::DataParallel dp(ctx, m, {.buckets = equal_buckets});
    const std::vector<std::size_t> rows{0, 1, 2, 3};
    for (int s = 0; s < 3; ++s) {
      auto st = dp.step();
      // The model's time: 20 ms here, 200 ms on rank 3 (a slow device, a busy host).
      std::this_thread::sleep_for(std::chrono::milliseconds(ctx.rank() == 3 ? 200 : 20));
      m.forward_backward(d.x, d.y, rows, st.on_gradient_ready());
      if (st.finish()) m.sgd(0.1);
    }
    reports[static_cast<std::size_t>(ctx.rank())] = lockstep::stragglers(dp);
  });
  for (const auto& r : reports) {
    CHECK(r.slowest_rank == 3);
    CHECK(r.ratio() > 5);
    CHECK(r.slowest_seconds == reports[0].slowest_seconds);  // every rank the same report
  }
}

TEST_CASE("fault_gradients_unbound: a gradient taken out of the arena (zero_grad set_to_none) is named") {
  const auto seed = lockstep_test::fresh_seed();
  std::vector<float> own(64, 0.0f);
  const auto [msgs, secs] = messages_around(2, seed, [&](auto& ctx, Model& m) {
    if (ctx.rank() == 0) m.bind_gradient(2, own.data());  // as if .grad had been reset and reallocated
  });
  CAPTURE(msgs[0]);
  CHECK(msgs[0].find("rank 0: the model changed after DataParallel was built: the gradient of parameter 2 "
                     "('layer1.weight') no longer is the storage DataParallel gave it") != std::string::npos);
  CHECK(msgs[0].find("zero_grad(false)") != std::string::npos);
  CHECK(secs < 5);
}

// Rank `bad` (from step `from` on, except the clean step `clean`) reports a NaN gradient; the
// skip limit (5) ends every rank, naming the rank whose own gradients were non-finite.
template <bool Sharded>
void check_nonfinite_forever(int bad, int from, int clean, int want_steps, const std::string& want_scale,
                             const std::string& want_origin) {
  const auto seed = lockstep_test::fresh_seed();
  CAPTURE(seed);
  CAPTURE(bad);
  CAPTURE(from);
  CAPTURE(clean);
  CAPTURE(Sharded);
  const data d(seed);
  int steps_run = 0;
  const auto [msgs, secs] = messages_of(3, [&](auto& ctx) {
    using Comm = std::remove_cvref_t<decltype(ctx.comm())>;
    using Scale = lockstep::DynamicScale;
    using DP =
        std::conditional_t<Sharded,
                           lockstep::DataParallel<Model, Comm, lockstep::EveryStep, Scale, lockstep::ShardedOptimizer>,
                           lockstep::DataParallel<Model, Comm, lockstep::EveryStep, Scale>>;
    Model m(dims, seed);
    DP dp(ctx, m, {.buckets = equal_buckets}, lockstep::EveryStep{},
          Scale({.init_scale = 1024, .max_consecutive_skips = 5}));
    lockstep::Sgd opt({.lr = 0.1});
    const std::vector<std::size_t> rows{0, 1, 2, 3};
    for (int s = 0; s < 30; ++s) {
      auto st = dp.step();
      const bool poison = ctx.rank() == bad && s >= from && s != clean;
      m.forward_backward(
          d.x, d.y, rows,
          [&](std::size_t i) {
            if (poison && i == 2) static_cast<float*>(m.parameters()[2].grad)[3] = std::nanf("");
            st.gradient_ready(i);
          },
          st.loss_scale());
      if constexpr (Sharded) (void)st.finish([&](std::span<const lockstep::param_slice> sl) { opt.step(sl); });
      else if (st.finish()) m.sgd(0.1);
      if (ctx.rank() == 0) steps_run = s + 1;
    }
  });
  CHECK(steps_run == want_steps);  // the next finish() threw
  for (const auto& msg : msgs) {
    CAPTURE(msg);
    CHECK(msg == msgs[0]);
    CHECK(msg.find("lockstep::DynamicScale: 5 steps in a row had inf/NaN gradients (the loss scale is now " +
                   want_scale) != std::string::npos);
    CHECK(msg.find(want_origin) != std::string::npos);
  }
  CHECK(secs < 5);
}

// A scaler whose update throws something other than the skip limit's lockstep::error (here a
// timeout_error) while a finding is pending: the exception keeps its type and its text.
struct ScaleThatTimesOut : lockstep::DynamicScale {
  using lockstep::DynamicScale::DynamicScale;
  int skips = 0;
  void update(bool found_inf) {
    lockstep::DynamicScale::update(found_inf);
    if (found_inf && ++skips == 3) throw lockstep::timeout_error("test: the scaler's peer timed out");
  }
};

TEST_CASE("fault_nonfinite_forever: another error from the scaler keeps its type and text") {
  const auto seed = lockstep_test::fresh_seed();
  const data d(seed);
  std::string what;
  try {
    lockstep::run(lockstep::Threads{2}, [&](auto& ctx) {
      Model m(dims, seed);
      lockstep::DataParallel dp(ctx, m, {.buckets = equal_buckets},
                                ScaleThatTimesOut({.init_scale = 1024, .max_consecutive_skips = 50}));
      const std::vector<std::size_t> rows{0, 1, 2, 3};
      for (int s = 0; s < 10; ++s) {
        auto st = dp.step();
        m.forward_backward(
            d.x, d.y, rows,
            [&](std::size_t i) {
              if (ctx.rank() == 1 && i == 1) static_cast<float*>(m.parameters()[1].grad)[0] = std::nanf("");
              st.gradient_ready(i);
            },
            st.loss_scale());
        if (st.finish()) m.sgd(0.1);
      }
    });
  } catch (const lockstep::timeout_error& e) {
    what = e.what();
  }
  CHECK(what == "test: the scaler's peer timed out");  // not turned into a plain error, nothing appended
}

TEST_CASE("fault_nonfinite_forever: a loss that stays NaN on one rank ends every rank after the skip limit") {
  std::mt19937_64 rng(lockstep_test::fresh_seed());
  const int bad = static_cast<int>(rng() % 3);
  const std::string origin = "the non-finite values came from rank " + std::to_string(bad) +
                             ": its own gradients held inf/NaN before averaging (first seen in optimizer step 2,";
  check_nonfinite_forever<false>(bad, 0, -1, 4, "32.0", origin);
  check_nonfinite_forever<true>(bad, 0, -1, 4, "32.0", origin);
  // Skips from step 3 on, a clean step 5, then for good: the run that ends it starts at step 6
  // (its first checked step is the 8th optimizer step); step 4's finding is forgotten.
  const std::string later = "came from rank " + std::to_string(bad) +
                            ": its own gradients held inf/NaN before "
                            "averaging (first seen in optimizer step 8,";
  check_nonfinite_forever<false>(bad, 3, 5, 10, "8.0", later);  // 1024 / 2^2, then / 2^5
}

}  // TEST_SUITE
