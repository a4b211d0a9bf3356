// lockstep::Bf16Wire on CPU ranks (ThreadComm): the numbers of the bf16 wire — each rank's fp32
// gradients rounded to bf16, the mean taken in fp32, the all-reduce's result rounded to bf16
// (the reduce-scatter's kept in fp32) — against a reference computed here; and training with
// it stays close to the fp32 wire, sharded and not. (The bytes it saves are NCCL's:
// tests/cuda/test_bf16_wire.cu.)
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <span>
#include <type_traits>
#include <vector>

#include <lockstep/lockstep.hpp>

#include "equivalence.hpp"
#include "equivalence_run.hpp"
#include "mlp.hpp"
#include "test_util.hpp"

using namespace lockstep_test;

namespace {

float bf16_round(float f) { return lockstep::detail::float_of_bf16(lockstep::detail::bf16_of_float(f)); }

double exact_mean(const std::vector<std::vector<float>>& x, std::size_t i) {
  double s = 0;
  for (const auto& v : x) s += v[i];
  return s / static_cast<double>(x.size());
}
double wire_mean(const std::vector<std::vector<float>>& x, std::size_t i) {
  double s = 0;
  for (const auto& v : x) s += bf16_round(v[i]);
  return s / static_cast<double>(x.size());
}

// Trains TestMlp<float> on `ranks` threads for a few steps, with the fp32 wire or Bf16Wire,
// sharded or not; returns rank 0's parameters (and checks that every rank has them).
template <bool Wire, bool Sharded>
std::vector<float> train(const dataset& d, int ranks, std::uint64_t seed) {
  std::vector<std::vector<float>> out(static_cast<std::size_t>(ranks));
  lockstep::run(lockstep::Threads{ranks}, [&](auto& ctx) {
    using Comm = std::remove_cvref_t<decltype(ctx.comm())>;
    TestMlp<float> m(d.dims, seed + static_cast<std::uint64_t>(ctx.rank()));
    using Hook = std::conditional_t<Wire, lockstep::Bf16Wire, lockstep::AllReduceMean>;
    using DP =
        std::conditional_t<Sharded, lockstep::DataParallel<TestMlp<float>, Comm, Hook, lockstep::ShardedOptimizer>,
                           lockstep::DataParallel<TestMlp<float>, Comm, Hook>>;
    DP dp(ctx, m, {.buckets = {.first_bytes = 200, .cap_bytes = 700}});
    lockstep::Sgd opt({.lr = 0.1, .momentum = 0.9});
    for (int s = 0; s < 6; ++s) {
      auto st = dp.step();
      m.forward_backward(inputs<float>(d), d.y, rank_rows(d, 4, ranks, ctx.rank(), s), st.on_gradient_ready());
      if constexpr (Sharded) {
        (void)st.finish([&](std::span<const lockstep::param_slice> sl) { opt.step(sl); });
      } else if (st.finish()) {
        opt.step(m.parameters());
      }
    }
    out[static_cast<std::size_t>(ctx.rank())] = m.flat_values();
  });
  for (int r = 1; r < ranks; ++r) CHECK(out[static_cast<std::size_t>(r)] == out[0]);
  return out[0];
}

}  // namespace

TEST_SUITE("cpu") {
TEST_CASE("bf16 wire on CPU ranks: the mean of bf16-rounded values in fp32 - all-reduce rounded - reduce-scatter not") {
  LOCKSTEP_SEEDED(std::mt19937_64 rng);
  for (int n : {1, 2, 3, 4}) {
    CAPTURE(n);
    const std::size_t count = 997, per = 61;
    std::vector<std::vector<float>> x, y;
    for (int r = 0; r < n; ++r) {
      x.push_back(random_vector<float>(count, rng, -4.0 * (r + 1), 3.0));
      y.push_back(random_vector<float>(per * static_cast<std::size_t>(n), rng, -1.0, 1.0));
    }
    std::vector<std::vector<float>> got(x.size()), got_rs(x.size());
    lockstep::run(lockstep::Threads{n}, [&](auto& ctx) {
      const auto r = static_cast<std::size_t>(ctx.rank());
      auto a = x[r], b = y[r];
      lockstep::Bf16Wire w;
      w.reduce(ctx.comm(), a.data(), count, lockstep::dtype::f32).wait();
      w.reduce_scatter(ctx.comm(), b.data(), b.data() + r * per, per, lockstep::dtype::f32).wait();
      got[r] = a;
      got_rs[r].assign(b.begin() + static_cast<std::ptrdiff_t>(r * per),
                       b.begin() + static_cast<std::ptrdiff_t>((r + 1) * per));
    });
    std::size_t off = 0, rounded = 0, not_exact = 0;
    for (std::size_t i = 0; i < count; ++i) {
      const float g = got[0][i];
      if (n == 1) {
        off += g != x[0][i];  // one rank: the values themselves
        continue;
      }
      const double want = bf16_round(static_cast<float>(wire_mean(x, i)));
      off += std::abs(g - want) > std::ldexp(std::abs(want), -8);  // one bf16 step: the fp32 sum's order
      rounded += bf16_round(g) == g;
      not_exact += std::abs(g - exact_mean(x, i)) > 1e-6 * std::abs(exact_mean(x, i));
    }
    CHECK(off == 0);
    if (n > 1) {
      CHECK(rounded == count);       // every result is a bf16 value
      CHECK(not_exact > count / 2);  // and not the fp32 all-reduce's
    }
    for (int r = 1; r < n; ++r) CHECK(got[static_cast<std::size_t>(r)] == got[0]);
    std::size_t off_rs = 0;
    for (int r = 0; r < n; ++r)
      for (std::size_t i = 0; i < per; ++i) {
        const std::size_t at = static_cast<std::size_t>(r) * per + i;
        const double want = n == 1 ? y[0][at] : wire_mean(y, at);
        off_rs += std::abs(got_rs[static_cast<std::size_t>(r)][i] - want) > 1e-6 * std::max(1.0, std::abs(want));
      }
    CHECK(off_rs == 0);
  }
}

// A bf16-rounded gradient may move a ReLU pre-activation across zero that the fp32 wire's does
// not, and that unit's rows then take another path: a legitimate O(1 %) difference (seen in about
// 4 % of draws, at most 5 % in 3600 draws; CI's seed 5425391515358543805 gave 1.009 %). So each
// rank count trains on `draws` fresh data sets: every draw stays near the fp32 wire (< 10 %), and
// the median draw — one without such a flip unless most draws had one — stays within bf16's 2^-8.
TEST_CASE("bf16 wire on CPU ranks: training stays within bf16 rounding of the fp32 wire - sharded and not") {
  const auto first_seed = fresh_seed();
  CAPTURE(first_seed);
  constexpr int draws = 9;
  const double bf16_step = std::ldexp(1.0, -8);
  for (int ranks : {2, 3}) {
    CAPTURE(ranks);
    std::vector<double> wire_diff, sharded_diff;
    auto seed = first_seed;
    for (int k = 0; k < draws; ++k, seed = next_seed(seed)) {
      CAPTURE(seed);
      const auto d = make_data(seed, 97);
      const auto plain = train<false, false>(d, ranks, seed + 1);
      const auto wire = train<true, false>(d, ranks, seed + 1);
      const auto sharded_wire = train<true, true>(d, ranks, seed + 1);
      const TestMlp<float> init(d.dims, seed + 1);
      CHECK(max_rel_diff(init.flat_values(), plain) > 1e-2);  // it trained
      wire_diff.push_back(max_rel_diff(wire, plain));
      sharded_diff.push_back(max_rel_diff(sharded_wire, plain));
      CHECK(wire_diff.back() > 0);  // the wire rounded something
      CHECK(sharded_diff.back() > 0);
      CHECK(wire_diff.back() < 0.1);
      CHECK(sharded_diff.back() < 0.1);
    }
    std::ranges::sort(wire_diff);
    std::ranges::sort(sharded_diff);
    CHECK(wire_diff[draws / 2] < bf16_step);
    CHECK(sharded_diff[draws / 2] < bf16_step);
  }
}
}
