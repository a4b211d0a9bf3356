#pragma once
// Shared by the Deterministic tests (tests/cpu/test_deterministic.cpp, tests/cuda/
// test_deterministic_gpu.cu): random gradients over a wide range of exponents, a host model
// whose gradients the test writes, and the CPU run that averages them with ThreadComm ranks —
// the reference the GPU's bits are compared with.
#include <cmath>
#include <cstdint>
#include <random>
#include <span>
#include <utility>
#include <string>
#include <type_traits>
#include <vector>

#include <lockstep/lockstep.hpp>

namespace lockstep_test {

struct split {
  int ranks = 1, accumulate = 1;
};

// A model whose gradients the test writes: parameters of the given sizes, packed (no binding).
struct GradModel {
  std::vector<std::vector<float>> w, g;
  explicit GradModel(const std::vector<std::size_t>& sizes) {
    for (auto n : sizes) {
      w.emplace_back(n, 1.0f);
      g.emplace_back(n, 0.0f);
    }
  }
  std::vector<lockstep::parameter> parameters() {
    std::vector<lockstep::parameter> ps;
    for (std::size_t i = 0; i < w.size(); ++i)
      ps.push_back(lockstep::param<float>("p" + std::to_string(i), w[i].data(), g[i].data(),
                                          {static_cast<std::int64_t>(w[i].size())}));
    return ps;
  }
};

const std::vector<std::size_t> grad_sizes = {1000, 37, 5000};

// values[step][micro-batch][param][element]: ranks × accumulate micro-batches per step.
using grad_values = std::vector<std::vector<std::vector<std::vector<float>>>>;

// A value 2^u with u uniform in [lo, hi], a random sign and mantissa.
inline grad_values random_grads(std::mt19937_64& rng, int steps, int micro, double lo, double hi) {
  std::uniform_real_distribution<double> ex(lo, hi), mant(1.0, 2.0);
  std::bernoulli_distribution sign;
  grad_values v(static_cast<std::size_t>(steps));
  for (auto& s : v) {
    s.resize(static_cast<std::size_t>(micro));
    for (auto& mb : s)
      for (auto n : grad_sizes) {
        auto& p = mb.emplace_back(n);
        for (auto& x : p) x = static_cast<float>((sign(rng) ? -1 : 1) * mant(rng) * std::exp2(std::floor(ex(rng))));
      }
  }
  return v;
}

struct grad_run {
  std::vector<std::vector<std::vector<float>>> grads;  // per step: the averaged gradients (rank 0)
  std::vector<lockstep::fixed_point_report> reports;   // per step (rank 0)
  std::vector<bool> applied;
  std::vector<std::int64_t> exponents;  // after the run
};

// One rank's part of feeding `values` through DataParallel with Deterministic on sp's split
// (sp.ranks must be ctx.size()); rank 0 fills out. exps (optional): loaded before the first step.
template <class Scaler = lockstep::NoScaling, class Ctx>
void grads_on_rank(Ctx& ctx, const grad_values& values, split sp, lockstep::DeterministicOptions o,
                   const std::vector<std::int64_t>* exps, grad_run& out) {
  using Comm = std::remove_cvref_t<decltype(ctx.comm())>;
  GradModel m(grad_sizes);
  lockstep::DataParallel<GradModel, Comm, lockstep::Deterministic, Scaler, lockstep::Accumulate<>> dp(
      ctx, m, lockstep::Deterministic(o), lockstep::Accumulate<>(sp.accumulate));
  if (exps) dp.hook().load_exponents(ctx.comm(), *exps);
  for (const auto& step : values) {
    lockstep::step_result r;
    for (int k = 0; k < sp.accumulate; ++k) {
      auto st = dp.step();
      const auto& mb = step[static_cast<std::size_t>(k * sp.ranks + ctx.rank())];
      for (std::size_t p = 0; p < mb.size(); ++p)
        for (std::size_t i = 0; i < mb[p].size(); ++i) m.g[p][i] += mb[p][i] * static_cast<float>(st.loss_scale());
      r = st.finish();
    }
    if (ctx.rank() == 0) {
      out.grads.push_back(m.g);
      out.reports.push_back(dp.hook().report());
      out.applied.push_back(r.applied);
    }
  }
  if (ctx.rank() == 0) out.exponents = dp.hook().exponents();
}

//! grads_on_rank over sp.ranks ThreadComm ranks.
template <class Scaler = lockstep::NoScaling>
grad_run run_grads(const grad_values& values, split sp, lockstep::DeterministicOptions o = {},
                   const std::vector<std::int64_t>* exps = nullptr) {
  grad_run out;
  lockstep::run(lockstep::Threads{sp.ranks}, [&](auto& ctx) { grads_on_rank<Scaler>(ctx, values, sp, o, exps, out); });
  return out;
}

// A cycle cut short (folds, then begin_cycle without end_step), on one rank of any
// communicator: two steps of `plain` gradients through the hook alone, the first preceded —
// with cut_short — by a dropped fold of `huge` ones. Returns the last gradients, the exponents
// after each step and the clamped count over both.
struct cut_short_outcome {
  std::vector<float> grads;
  std::vector<std::int64_t> exponents;
  std::int64_t clamped_total = 0;
};
template <class Ctx>
cut_short_outcome cut_short_on_rank(Ctx& ctx, const std::vector<float>& huge, const std::vector<float>& plain,
                                    bool cut_short) {
  auto& comm = ctx.comm();
  auto mem = comm.memory();
  const std::size_t count = plain.size();
  const auto g = mem.allocate(count * sizeof(float));
  void* base = g.get();
  const lockstep::dtype type = lockstep::dtype::f32;
  const std::vector<lockstep::detail::fixed_run> runs = {{0, count / 2, 0}, {count / 2, count - count / 2, 1}};
  lockstep::Deterministic h;
  h.attach(comm, std::span<void* const>(&base, 1), std::span<const std::size_t>(&count, 1),
           std::span<const lockstep::dtype>(&type, 1), 2);
  cut_short_outcome out;
  for (int step = 0; step < 2; ++step) {
    h.begin_cycle(comm);
    if (cut_short && step == 0) {
      mem.upload(base, huge.data(), count * sizeof(float));
      h.fold(comm, base, runs, 2, true);  // a non-syncing micro-step, then the cycle is dropped
      h.begin_cycle(comm);
    }
    mem.upload(base, plain.data(), count * sizeof(float));
    h.fold(comm, base, runs, 1, false);
    h.reduce(comm, base, count, type).wait();
    h.end_step(comm, {});
    for (auto e : h.exponents()) out.exponents.push_back(e);
  }
  out.grads.resize(count);
  mem.download(out.grads.data(), base, count * sizeof(float));
  out.clamped_total = h.report().clamped_total;
  return out;
}

// `huge` values beyond the first range (2^16: clamped, exponents near 2^20) and `plain` ones
// in (-1, 1), 64 of each.
inline std::pair<std::vector<float>, std::vector<float>> cut_short_values(std::mt19937_64& rng) {
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  std::vector<float> huge(64), plain(64);
  for (auto& x : huge) x = 1e6f * unit(rng);
  for (auto& x : plain) x = unit(rng);
  return {huge, plain};
}

}  // namespace lockstep_test
