// lockstep::Deterministic on NcclComm (cuda/deterministic_sum.cuh): the GPU's averaged gradients
// have the CPU reference's bits (ThreadComm ranks, another split of the same micro-batches) —
// values over 20 binades, one clamped beyond the range, one non-finite step made NaN — with the
// same exponents and counts; and GPU training with it gives the same parameters however the
// micro-batches are split over GPUs and micro-steps, whatever the bucket sizes. On 1 GPU the
// splits are over micro-steps; on 2 and 4 over GPUs too.
#include <doctest/doctest.h>

#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <random>
#include <span>
#include <type_traits>
#include <vector>

#include <lockstep/cuda.cuh>

#include "deterministic_grads.hpp"
#include "equivalence.hpp"
#include "gpu_mlp.cuh"
#include "gpu_test_util.cuh"
#include "test_util.hpp"

using namespace lockstep_test;

namespace {

using lockstep_test::first_gpus;

// GradModel on a GPU: the test writes each micro-step's gradients (into zeroed buffers: lockstep
// zeroes them between micro-steps). Bind: lockstep may own them (zero copy).
template <bool Bind>
struct DevGradModel {
  std::vector<float*> v, g, own;
  std::vector<std::size_t> n;
  explicit DevGradModel(const std::vector<std::size_t>& sizes) : n(sizes) {
    for (auto c : sizes) {
      float *pv = nullptr, *pg = nullptr;
      LOCKSTEP_TRY_CUDA(cudaMalloc(&pv, c * sizeof(float)));
      LOCKSTEP_TRY_CUDA(cudaMalloc(&pg, c * sizeof(float)));
      LOCKSTEP_TRY_CUDA(cudaMemset(pv, 0, c * sizeof(float)));
      LOCKSTEP_TRY_CUDA(cudaMemset(pg, 0, c * sizeof(float)));
      v.push_back(pv);
      g.push_back(pg);
      own.push_back(pv);
      own.push_back(pg);
    }
    LOCKSTEP_TRY_CUDA(cudaDeviceSynchronize());
  }
  ~DevGradModel() {
    for (auto p : own) cudaFree(p);
  }
  std::vector<lockstep::parameter> parameters() {
    std::vector<lockstep::parameter> ps;
    for (std::size_t i = 0; i < v.size(); ++i)
      ps.push_back(lockstep::param<float>("p" + std::to_string(i), v[i], g[i], {static_cast<std::int64_t>(n[i])}));
    return ps;
  }
  void bind_gradient(std::size_t i, void* p)
    requires Bind
  {
    g[i] = static_cast<float*>(p);
  }
};

// run_grads (deterministic_grads.hpp) on `gpus` GPUs. Sharded (ShardedOptimizer): each rank
// holds the mean of its shard only; the test reads it through the values (below).
template <bool Bind, bool Sharded = false>
grad_run run_gpu(const grad_values& values, split sp, lockstep::BucketPolicy buckets,
                 lockstep::DeterministicOptions o) {
  grad_run out;
  out.grads.resize(values.size());
  for (auto& g : out.grads)
    for (auto n : grad_sizes) g.emplace_back(n);
  lockstep::run(lockstep::Gpus{first_gpus(sp.ranks)}, [&](lockstep::context<lockstep::NcclComm>& ctx) {
    const cudaStream_t s = ctx.comm().compute_stream();
    DevGradModel<Bind> m(grad_sizes);
    using Strategy = std::conditional_t<Sharded, lockstep::ShardedOptimizer, lockstep::Replicated>;
    lockstep::DataParallel<DevGradModel<Bind>, lockstep::NcclComm, lockstep::Deterministic, lockstep::Accumulate<>,
                           Strategy>
        dp(ctx, m, {.buckets = buckets}, lockstep::Deterministic(o), lockstep::Accumulate<>(sp.accumulate), Strategy{});
    for (std::size_t at = 0; at < values.size(); ++at) {
      auto& grads = out.grads[at];
      for (int k = 0; k < sp.accumulate; ++k) {
        auto st = dp.step();
        const auto& mb = values[at][static_cast<std::size_t>(k * sp.ranks + ctx.rank())];
        for (std::size_t p = 0; p < mb.size(); ++p)
          LOCKSTEP_TRY_CUDA(
              cudaMemcpyAsync(m.g[p], mb[p].data(), mb[p].size() * sizeof(float), cudaMemcpyHostToDevice, s));
        LOCKSTEP_TRY_CUDA(cudaStreamSynchronize(s));
        // Sharded: the "optimizer" sets each shard's values to its gradients, and the gather
        // after it hands every rank the whole mean in the values.
        (void)st.finish([&](std::span<const lockstep::param_slice> slices) {
          if (Sharded)
            for (const auto& sl : slices)
              LOCKSTEP_TRY_CUDA(
                  cudaMemcpyAsync(sl.value, sl.grad, sl.count * sizeof(float), cudaMemcpyDeviceToDevice, s));
        });
      }
      LOCKSTEP_TRY_CUDA(cudaStreamSynchronize(s));
      if (ctx.rank() == 0) {
        const auto& from = Sharded ? m.v : m.g;
        for (std::size_t p = 0; p < m.g.size(); ++p)
          LOCKSTEP_TRY_CUDA(cudaMemcpy(grads[p].data(), from[p], m.n[p] * sizeof(float), cudaMemcpyDeviceToHost));
        out.reports.push_back(dp.hook().report());
      }
    }
    if (ctx.rank() == 0) out.exponents = dp.hook().exponents();
  });
  return out;
}

bool same_bits(const grad_run& a, const grad_run& b) {
  if (a.grads.size() != b.grads.size() || a.exponents != b.exponents) return false;
  for (std::size_t s = 0; s < a.grads.size(); ++s)
    for (std::size_t p = 0; p < a.grads[s].size(); ++p)
      if (a.grads[s][p].size() != b.grads[s][p].size() ||
          std::memcmp(a.grads[s][p].data(), b.grads[s][p].data(), a.grads[s][p].size() * sizeof(float)) != 0)
        return false;
  return true;
}

// Sharded: a non-finite step's NaN goes into the first element of each rank's shard (each
// rank's check sees its own), not only into the first of the whole gradients as replicated:
// such a step's values match b's bits or are NaN where b's step was non-finite.
bool same_bits_sharded(const grad_run& a, const grad_run& b) {
  if (a.grads.size() != b.grads.size() || a.exponents != b.exponents) return false;
  for (std::size_t s = 0; s < a.grads.size(); ++s)
    for (std::size_t p = 0; p < a.grads[s].size(); ++p) {
      if (a.grads[s][p].size() != b.grads[s][p].size()) return false;
      for (std::size_t i = 0; i < a.grads[s][p].size(); ++i) {
        const float x = a.grads[s][p][i], y = b.grads[s][p][i];
        if (std::memcmp(&x, &y, sizeof x) != 0 && !(std::isnan(x) && b.reports[s].nonfinite > 0)) return false;
      }
    }
  return true;
}

bool same_counts(const grad_run& a, const grad_run& b) {
  if (a.reports.size() != b.reports.size()) return false;
  for (std::size_t s = 0; s < a.reports.size(); ++s)
    if (a.reports[s].clamped != b.reports[s].clamped || a.reports[s].nonfinite != b.reports[s].nonfinite ||
        a.reports[s].underflowed != b.reports[s].underflowed)
      return false;
  return true;
}

void check_against_cpu(int gpus) {
  LOCKSTEP_SEEDED(std::mt19937_64 rng);
  CAPTURE(gpus);
  auto v = random_grads(rng, 3, 4, -20, 0);
  v[0][1][2][100] = 3.0f;                                  // beyond the first range 2^0: clamped
  v[1][0][1][5] = std::exp2(-80.0f);                       // rounded to 0: underflowed
  v[2][3][0][7] = std::numeric_limits<float>::infinity();  // the last step non-finite
  const lockstep::DeterministicOptions o{.initial_exponent = 0};
  const auto cpu = run_grads(v, {2, 2}, o);
  REQUIRE(cpu.reports[0].clamped == 1);
  REQUIRE(cpu.reports[1].underflowed >= 1);
  REQUIRE(cpu.reports[2].nonfinite == 1);
  const split sp{gpus, 4 / gpus};
  const auto zero_copy = run_gpu<true>(v, sp, {}, o);
  CHECK(same_bits(zero_copy, cpu));
  CHECK(same_counts(zero_copy, cpu));
  const auto packed = run_gpu<false>(v, sp, {.first_bytes = 1024, .cap_bytes = 4096}, o);
  CHECK(same_bits(packed, cpu));
  CHECK(same_counts(packed, cpu));
  // One tensor a bucket: 37 elements leave a remainder over 2 and 4 ranks (reduce-scatter,
  // all-gather, and the rest all-reduced).
  const auto per_tensor = run_gpu<false>(v, sp, {.first_bytes = 148, .cap_bytes = 148}, o);
  CHECK(same_bits(per_tensor, cpu));
  CHECK(same_counts(per_tensor, cpu));
}

// One micro-batch a GPU a step (one contribution a rank: the gradients go on the wire as they
// are and each block's contributions are turned into their mean in one pass), replicated and
// sharded, with buckets whose blocks leave a rest (37 elements: blocks of a multiple of 4):
// the CPU reference's bits (one CPU rank folding the same micro-batches one after another).
void check_one_each_against_cpu(int gpus) {
  LOCKSTEP_SEEDED(std::mt19937_64 rng);
  CAPTURE(gpus);
  auto v = random_grads(rng, 3, gpus, -20, 0);
  const auto last = static_cast<std::size_t>(gpus - 1);
  v[0][last][2][100] = 3.0f;                                  // beyond the first range 2^0: clamped
  v[1][0][1][5] = std::exp2(-80.0f);                          // rounded to 0: underflowed
  v[2][last][0][7] = std::numeric_limits<float>::infinity();  // the last step non-finite
  const lockstep::DeterministicOptions o{.initial_exponent = 0};
  const auto cpu = run_grads(v, {1, gpus}, o);
  REQUIRE(cpu.reports[0].clamped == 1);
  REQUIRE(cpu.reports[1].underflowed == 1);
  REQUIRE(cpu.reports[2].nonfinite == 1);
  const split sp{gpus, 1};
  for (const lockstep::BucketPolicy b :
       {lockstep::BucketPolicy{}, lockstep::BucketPolicy{1024, 4096}, lockstep::BucketPolicy{148, 148}}) {
    CAPTURE(b.cap_bytes);
    const auto zero_copy = run_gpu<true>(v, sp, b, o), packed = run_gpu<false>(v, sp, b, o);
    CHECK(same_bits(zero_copy, cpu));
    CHECK(same_counts(zero_copy, cpu));
    CHECK(same_bits(packed, cpu));
    const auto sharded = run_gpu<true, true>(v, sp, b, o);
    CHECK(same_bits_sharded(sharded, cpu));
    CHECK(same_counts(sharded, cpu));
  }
}

// GpuMlp trained with Deterministic on sp's split of 8 micro-batches of 3 rows per step; graph:
// each optimizer step (its micro-steps) run through a StepGraph — two eager, then one capture
// replayed (the micro-batches' rows at fixed addresses).
std::vector<float> train_gpu(const dataset& d, split sp, lockstep::BucketPolicy buckets, std::uint64_t seed,
                             bool graph = false) {
  std::vector<std::vector<float>> got(static_cast<std::size_t>(sp.ranks));
  constexpr int rows_per = 3, steps = 6;
  lockstep::run(lockstep::Gpus{first_gpus(sp.ranks)}, [&](lockstep::context<lockstep::NcclComm>& ctx) {
    const cudaStream_t s = ctx.comm().compute_stream();
    TestMlp<float> init(d.dims, seed);
    GpuMlp m(d.dims, split_params(init), s);
    lockstep::DataParallel<GpuMlp, lockstep::NcclComm, lockstep::Deterministic, lockstep::Accumulate<>> dp(
        ctx, m, {.buckets = buckets}, lockstep::Accumulate<>(sp.accumulate));
    float* dX = nullptr;
    int *dy = nullptr, *drows = nullptr;
    LOCKSTEP_TRY_CUDA(cudaMalloc(&dX, d.X32.size() * sizeof(float)));
    LOCKSTEP_TRY_CUDA(cudaMalloc(&dy, d.y.size() * sizeof(int)));
    LOCKSTEP_TRY_CUDA(cudaMalloc(&drows, static_cast<std::size_t>(rows_per * sp.accumulate) * sizeof(int)));
    LOCKSTEP_TRY_CUDA(cudaMemcpy(dX, d.X32.data(), d.X32.size() * sizeof(float), cudaMemcpyHostToDevice));
    LOCKSTEP_TRY_CUDA(cudaMemcpy(dy, d.y.data(), d.y.size() * sizeof(int), cudaMemcpyHostToDevice));
    LOCKSTEP_TRY_CUDA(cudaDeviceSynchronize());
    const int per_step = sp.ranks * sp.accumulate;
    std::optional<lockstep::StepGraph> g;
    if (graph) g.emplace(ctx.comm());
    for (int st = 0; st < steps; ++st) {
      std::vector<int> rows(static_cast<std::size_t>(rows_per * sp.accumulate));  // micro-step k's at k · rows_per
      for (int k = 0; k < sp.accumulate; ++k)
        for (int i = 0; i < rows_per; ++i)
          rows[static_cast<std::size_t>(k * rows_per + i)] =
              static_cast<int>(((st * per_step + k * sp.ranks + ctx.rank()) * rows_per + i) % d.samples);
      LOCKSTEP_TRY_CUDA(cudaMemcpyAsync(drows, rows.data(), rows.size() * sizeof(int), cudaMemcpyHostToDevice, s));
      LOCKSTEP_TRY_CUDA(cudaStreamSynchronize(s));
      const auto micro_steps = [&] {
        for (int k = 0; k < sp.accumulate; ++k) {
          auto step = dp.step();
          m.forward_backward(dX, dy, drows + k * rows_per, rows_per, step.on_gradient_ready());
          if (step.finish()) m.sgd(0.1f);
        }
      };
      if (g) (void)g->run(micro_steps);
      else micro_steps();
    }
    if (g) CHECK(g->replays() == static_cast<std::uint64_t>(steps - 2));
    got[static_cast<std::size_t>(ctx.rank())] = m.flat_values();
    cudaFree(dX);
    cudaFree(dy);
    cudaFree(drows);
  });
  for (std::size_t r = 1; r < got.size(); ++r) CHECK(got[r] == got[0]);
  return got[0];
}

// Captured steps (StepGraph: folds, integer all-reduce, unfold, the end of a step, SGD) replay
// the eager steps' bits, across micro-step splits.
void check_graph(int gpus) {
  LOCKSTEP_SEEDED(std::mt19937_64 rng);
  CAPTURE(gpus);
  const auto d = make_data(rng(), 120);
  const auto init = rng();
  const auto eager = train_gpu(d, {1, 8}, {}, init);
  const auto graphed = train_gpu(d, {gpus, 8 / gpus}, {}, init, true);
  TestMlp<float> start(d.dims, init);
  CHECK(max_rel_diff(start.flat_values(), graphed) > 1e-3);  // it trained
  CHECK(std::memcmp(graphed.data(), eager.data(), eager.size() * sizeof(float)) == 0);
  // One micro-step a GPU (the all-to-all and the one-pass mean captured).
  const auto eager_one = train_gpu(d, {1, gpus}, {}, init), graphed_one = train_gpu(d, {gpus, 1}, {}, init, true);
  CHECK(std::memcmp(graphed_one.data(), eager_one.data(), eager_one.size() * sizeof(float)) == 0);
}

// A cycle cut short (folds, then begin_cycle without end_step) leaves nothing behind on the
// GPU: the next steps' exponents, counts and sums equal those of a hook that never saw it.
void check_cut_short() {
  LOCKSTEP_SEEDED(std::mt19937_64 rng);
  const auto values = cut_short_values(rng);
  const auto &huge = values.first, &plain = values.second;
  auto run = [&](bool cut_short) {
    cut_short_outcome out;
    lockstep::run(lockstep::Gpus{first_gpus(1)}, [&](lockstep::context<lockstep::NcclComm>& ctx) {
      out = cut_short_on_rank(ctx, huge, plain, cut_short);
    });
    return out;
  };
  const auto cut = run(true), clean = run(false);
  CHECK(cut.exponents == clean.exponents);
  CHECK(cut.clamped_total == 0);
  CHECK(clean.clamped_total == 0);
  CHECK(std::memcmp(cut.grads.data(), clean.grads.data(), clean.grads.size() * sizeof(float)) == 0);
}

void check_training(int gpus) {
  LOCKSTEP_SEEDED(std::mt19937_64 rng);
  CAPTURE(gpus);
  const auto d = make_data(rng(), 120);
  const auto init = rng();
  const auto ref = train_gpu(d, {1, 8}, {}, init);
  TestMlp<float> start(d.dims, init);
  CHECK(max_rel_diff(start.flat_values(), ref) > 1e-3);  // it trained
  const split sp{gpus, 8 / gpus};
  const auto a = train_gpu(d, sp, {}, init), b = train_gpu(d, sp, {.first_bytes = 256, .cap_bytes = 512}, init);
  CHECK(std::memcmp(a.data(), ref.data(), ref.size() * sizeof(float)) == 0);
  CHECK(std::memcmp(b.data(), ref.data(), ref.size() * sizeof(float)) == 0);
  if (gpus == 1) return;
  // One micro-step a GPU against the same micro-batches on one GPU, one after another.
  const auto ref_one = train_gpu(d, {1, gpus}, {}, init);
  const auto c = train_gpu(d, {gpus, 1}, {}, init),
             e = train_gpu(d, {gpus, 1}, {.first_bytes = 256, .cap_bytes = 512}, init);
  CHECK(std::memcmp(c.data(), ref_one.data(), ref_one.size() * sizeof(float)) == 0);
  CHECK(std::memcmp(e.data(), ref_one.data(), ref_one.size() * sizeof(float)) == 0);
}

}  // namespace

TEST_SUITE("gpu") {
TEST_CASE("deterministic_gpu_sums_equal_the_cpu_reference: 1 GPU") {
  LOCKSTEP_REQUIRE_GPUS(1);
  check_against_cpu(1);
}
TEST_CASE("deterministic_gpu_one_micro_step_a_gpu_equals_the_cpu_reference: 1 GPU") {
  LOCKSTEP_REQUIRE_GPUS(1);
  check_one_each_against_cpu(1);
}
TEST_CASE("deterministic_gpu_training_same_bits_over_micro_steps_and_buckets: 1 GPU") {
  LOCKSTEP_REQUIRE_GPUS(1);
  check_training(1);
}
TEST_CASE("deterministic_gpu_a_cycle_cut_short_leaves_no_trace: 1 GPU") {
  LOCKSTEP_REQUIRE_GPUS(1);
  check_cut_short();
}
TEST_CASE("deterministic_gpu_step_graph_replays_the_eager_bits: 1 GPU") {
  LOCKSTEP_REQUIRE_GPUS(1);
  check_graph(1);
}
}

TEST_SUITE("multigpu") {
TEST_CASE("deterministic_gpu_sums_equal_the_cpu_reference: 2 GPUs") {
  LOCKSTEP_REQUIRE_GPUS(2);
  check_against_cpu(2);
}
TEST_CASE("deterministic_gpu_sums_equal_the_cpu_reference: 4 GPUs") {
  LOCKSTEP_REQUIRE_GPUS(4);
  check_against_cpu(4);
}
TEST_CASE("deterministic_gpu_one_micro_step_a_gpu_equals_the_cpu_reference: 2 GPUs") {
  LOCKSTEP_REQUIRE_GPUS(2);
  check_one_each_against_cpu(2);
}
TEST_CASE("deterministic_gpu_one_micro_step_a_gpu_equals_the_cpu_reference: 4 GPUs") {
  LOCKSTEP_REQUIRE_GPUS(4);
  check_one_each_against_cpu(4);
}
TEST_CASE("deterministic_gpu_training_same_bits_over_gpus: 2 GPUs") {
  LOCKSTEP_REQUIRE_GPUS(2);
  check_training(2);
}
TEST_CASE("deterministic_gpu_training_same_bits_over_gpus: 4 GPUs") {
  LOCKSTEP_REQUIRE_GPUS(4);
  check_training(4);
}
TEST_CASE("deterministic_gpu_step_graph_replays_the_eager_bits: 2 GPUs") {
  LOCKSTEP_REQUIRE_GPUS(2);
  check_graph(2);
}
}
