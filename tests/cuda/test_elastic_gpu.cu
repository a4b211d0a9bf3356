// Shrinking a job in place on GPUs (issue 29), one process driving them (run(Gpus)): a rank
// dies mid-step, the survivor agrees through the store that it goes on, regroups its NcclComm
// (a new NCCL communicator from an id shared through the store), rebuilds DataParallel, redoes
// the step with the whole global batch, and ends where a run that switched from 2 GPUs to 1 at
// that step without a failure ends. And NcclComm's ring shift (PeerCopy's transport).
#include <doctest/doctest.h>

#include <cuda_runtime_api.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <optional>
#include <random>
#include <stdexcept>
#include <vector>

#include <lockstep/cuda.cuh>
#include <lockstep/lockstep.hpp>

#include "equivalence.hpp"
#include "gpu_mlp.cuh"
#include "gpu_test_util.cuh"
#include "test_util.hpp"

using namespace lockstep_test;

namespace {

struct rank_killed : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// The values of parameters() in order, cut from a flat vector (GpuMlp::flat_values' order).
std::vector<std::vector<float>> cut(const std::vector<float>& flat, TestMlp<float>& shape) {
  std::vector<std::vector<float>> out;
  std::size_t at = 0;
  for (auto& p : shape.parameters()) {
    const std::size_t n = p.value_as<float>().size();
    out.emplace_back(flat.begin() + static_cast<std::ptrdiff_t>(at),
                     flat.begin() + static_cast<std::ptrdiff_t>(at + n));
    at += n;
  }
  return out;
}

constexpr int global_rows = 8;

// Trains steps [from, to) on the first `gpus` GPUs from `values` (null: the seed's), each step's
// global batch rows [step · 8, step · 8 + 8) split evenly over the group's ranks. With `die`,
// job rank 1 throws in its backward of step `die` (after 2 gradients were handed over), and the
// survivor goes on through an ElasticGroup. Returns rank 0's parameters; `redo` gets the
// seconds from the death to the survivor's next applied step.
std::vector<float> train(const dataset& d, std::uint64_t seed, int gpus, int from, int to,
                         const std::vector<float>* values, std::optional<int> die, double* redo = nullptr) {
  std::vector<float> out;
  lockstep::HashStore store(gpus);
  std::chrono::steady_clock::time_point died{};
  auto body = [&](lockstep::context<lockstep::NcclComm>& ctx) {
    const cudaStream_t s = ctx.comm().compute_stream();
    TestMlp<float> init(d.dims, seed);
    GpuMlp m(d.dims, values ? cut(*values, init) : split_params(init), s);
    float* dX = nullptr;
    int *dy = nullptr, *drows = nullptr;
    LOCKSTEP_TRY_CUDA(cudaMalloc(&dX, d.X32.size() * sizeof(float)));
    LOCKSTEP_TRY_CUDA(cudaMalloc(&dy, d.y.size() * sizeof(int)));
    LOCKSTEP_TRY_CUDA(cudaMalloc(&drows, global_rows * sizeof(int)));
    LOCKSTEP_TRY_CUDA(cudaMemcpy(dX, d.X32.data(), d.X32.size() * sizeof(float), cudaMemcpyHostToDevice));
    LOCKSTEP_TRY_CUDA(cudaMemcpy(dy, d.y.data(), d.y.size() * sizeof(int), cudaMemcpyHostToDevice));
    LOCKSTEP_TRY_CUDA(cudaDeviceSynchronize());
    lockstep::ElasticGroup group(ctx, store, {.min_ranks = 1});
    using DP = lockstep::DataParallel<GpuMlp, lockstep::NcclComm>;
    std::optional<DP> dp(std::in_place, group.comm(), m);
    group.on_change([&](const lockstep::membership_change&) {
      dp.reset();          // the model takes its gradients back,
      m.zero_gradients();  // which hold what the interrupted backward added (it adds: +=)
      dp.emplace(group.comm(), m);
    });
    bool changed_once = false;
    for (int st = from; st < to;) {
      const int n = group.size(), per = global_rows / n;
      std::vector<int> rows(static_cast<std::size_t>(per));
      for (int i = 0; i < per; ++i)
        rows[static_cast<std::size_t>(i)] =
            static_cast<int>((static_cast<std::size_t>(st * global_rows + group.rank() * per + i)) % d.samples);
      LOCKSTEP_TRY_CUDA(cudaMemcpyAsync(drows, rows.data(), rows.size() * sizeof(int), cudaMemcpyHostToDevice, s));
      const bool dies = die && ctx.rank() == 1 && st == *die;
      const auto change = group.attempt([&] {
        auto step = dp->step();
        auto hook = step.on_gradient_ready();
        int handed = 0;
        m.forward_backward(dX, dy, drows, per, [&](std::size_t i) {
          if (dies && handed++ == 2) {
            died = std::chrono::steady_clock::now();
            throw rank_killed("job rank 1 killed");
          }
          hook(i);
        });
        if (step.finish()) m.sgd(0.1f);
      });
      if (change) {
        CHECK(change->after.ranks == std::vector<int>{0});
        changed_once = true;
        continue;  // redo the step over the survivors
      }
      if (changed_once && redo && *redo == 0) {
        LOCKSTEP_TRY_CUDA(cudaStreamSynchronize(s));
        *redo = std::chrono::duration<double>(std::chrono::steady_clock::now() - died).count();
      }
      ++st;
    }
    if (ctx.rank() == 0) out = m.flat_values();
    dp.reset();
    cudaFree(dX);
    cudaFree(dy);
    cudaFree(drows);
  };
  std::vector<int> devices;
  for (int g = 0; g < gpus; ++g) devices.push_back(g);
  if (die) CHECK_THROWS_AS(lockstep::run(lockstep::Gpus{devices}, body), rank_killed);  // run() names the dead rank
  else lockstep::run(lockstep::Gpus{devices}, body);
  return out;
}

}  // namespace

TEST_SUITE("gpu") {
TEST_CASE("NcclComm shift: each rank gets the block of the rank d places after it - 1 GPU") {
  LOCKSTEP_REQUIRE_GPUS(1);
  lockstep::run(lockstep::Gpus{{0}}, [](lockstep::context<lockstep::NcclComm>& ctx) {
    LOCKSTEP_SEEDED(std::mt19937_64 rng);
    const auto mine = random_vector<float>(37, rng, -1, 1);
    lockstep::CudaMemory mem = ctx.comm().memory();
    auto send = mem.allocate(mine.size() * 4), recv = mem.allocate(mine.size() * 4);
    mem.upload(send.get(), mine.data(), mine.size() * 4);
    ctx.comm().shift(send.get(), recv.get(), mine.size(), lockstep::dtype::f32, 3).wait();
    std::vector<float> got(mine.size());
    mem.download(got.data(), recv.get(), got.size() * 4);
    CHECK(got == mine);
  });
}
}

TEST_SUITE("multigpu") {
TEST_CASE("NcclComm shift: each rank gets the block of the rank d places after it - 2 GPUs") {
  LOCKSTEP_REQUIRE_GPUS(2);
  LOCKSTEP_SEEDED(std::mt19937_64 rng);
  const std::size_t count = 1000 + rng() % 3000;
  std::vector<std::vector<float>> blocks;
  for (int r = 0; r < 2; ++r) blocks.push_back(random_vector<float>(count, rng, -1, 1));
  for (int distance : {-3, -1, 0, 1, 2}) {
    CAPTURE(distance);
    lockstep::run(lockstep::Gpus{{0, 1}}, [&](lockstep::context<lockstep::NcclComm>& ctx) {
      const auto& mine = blocks[static_cast<std::size_t>(ctx.rank())];
      lockstep::CudaMemory mem = ctx.comm().memory();
      auto send = mem.allocate(count * 4), recv = mem.allocate(count * 4);
      mem.upload(send.get(), mine.data(), count * 4);
      ctx.comm().shift(send.get(), recv.get(), count, lockstep::dtype::f32, distance).wait();
      std::vector<float> got(count);
      mem.download(got.data(), recv.get(), count * 4);
      const int from = ((ctx.rank() + distance) % 2 + 2) % 2;
      CHECK(got == blocks[static_cast<std::size_t>(from)]);
    });
  }
}

TEST_CASE("elastic_gpu: a rank dies mid-backward - the survivor regroups and goes on alone - as a switch from 2 "
          "GPUs to 1 at that step") {
  LOCKSTEP_REQUIRE_GPUS(2);
  LOCKSTEP_SEEDED(std::mt19937_64 rng);
  const auto d = make_data(rng(), 64);
  const auto init_seed = rng();
  constexpr int steps = 6, die = 3;
  double redo = 0;
  const auto elastic = train(d, init_seed, 2, 0, steps, nullptr, die, &redo);
  // The switch without a failure: 2 GPUs up to the step, then 1 GPU from their parameters.
  const auto before = train(d, init_seed, 2, 0, die, nullptr, std::nullopt);
  const auto after = train(d, init_seed, 1, die, steps, &before, std::nullopt);
  TestMlp<float> init(d.dims, init_seed);
  auto norm = [](const std::vector<float>& v) {
    double s = 0;
    for (float x : v) s += static_cast<double>(x) * x;
    return std::sqrt(s);
  };
  MESSAGE("norms: init " << norm(init.flat_values()) << " before " << norm(before) << " elastic " << norm(elastic)
                         << " after " << norm(after) << " elastic vs before " << max_rel_diff(elastic, before));
  REQUIRE(elastic.size() == after.size());
  CHECK(max_rel_diff(init.flat_values(), elastic) > 1e-3);  // it trained
  CHECK(max_rel_diff(elastic, after) <= 1e-5);
  MESSAGE("the survivor's next applied step came " << redo << " s after the death");
  CHECK(redo > 0);
  CHECK(redo < 5.0);
}
}
