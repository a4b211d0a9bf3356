// Full sharding on GPUs — ShardedGradients (ZeRO-2) and FullySharded (ZeRO-3) over NcclComm:
// GpuMlp's layers are blocks used through dp.use_block, FusedSgd (momentum) steps this GPU's
// shards in finish(on_shard); after k steps every GPU holds the parameters of a CPU reference
// (one rank, the global batch, lockstep::Sgd) — with accumulation, dynamic loss scaling and an
// inf planted on one GPU (the step skipped on all), clipping by the global norm, ZeRO-3's
// prefetch and kept values; and the lent block buffers hold a few layers, not the model. join():
// uneven batches, the ranks out of data shadowing the others' steps, equal a CPU reference.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <span>
#include <string>
#include <vector>

#include <lockstep/cuda.cuh>
#include <lockstep/lockstep.hpp>

#include "gpu_mlp.cuh"
#include "device_vector.cuh"
#include "gpu_test_util.cuh"
#include "mlp.hpp"
#include "test_util.hpp"
#include "value_wire_check.hpp"

using namespace lockstep_test;

namespace {

namespace kern {
__global__ void mul(float* g, std::size_t n, float f) {
  for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < n;
       i += std::size_t(gridDim.x) * blockDim.x)
    g[i] *= f;
}
__global__ void poison(float* g, float v) { *g = v; }
}  // namespace kern

struct fs_config {
  int gpus = 1;
  int accumulate = 1;
  double clip = 0;
  bool keep_after_forward = false;
  int prefetch = 1;
  std::uint64_t seed = 0;  // 0: fresh_seed()
};

template <class Strategy>
void check_fullshard(const fs_config& c) {
  const auto seed = c.seed != 0 ? c.seed : fresh_seed();
  std::mt19937_64 rng(seed);
  const int steps = 7;
  const int inf_step = 1 + static_cast<int>(rng() % 5);
  const int inf_rank = static_cast<int>(rng() % static_cast<unsigned>(c.gpus));
  const std::vector<int> dims{37, 64, 33, 19, 10};
  const std::size_t inf_param = rng() % (2 * (dims.size() - 1));
  const lockstep::DynamicScaleOptions so{.init_scale = 256, .growth_interval = 3};
  const lockstep::SgdOptions sgd{.lr = 0.05, .momentum = 0.9, .dampening = 0.0, .weight_decay = 1e-3};
  CAPTURE(seed);
  CAPTURE(c.gpus);
  CAPTURE(c.accumulate);
  CAPTURE(c.clip);
  CAPTURE(c.keep_after_forward);
  CAPTURE(c.prefetch);
  CAPTURE(inf_step);
  CAPTURE(inf_rank);
  CAPTURE(inf_param);

  const std::size_t samples = 1024;
  const int batch = 8;
  auto X = random_vector<float>(samples * dims[0], rng, -2, 2);
  std::vector<int> y(samples);
  std::uniform_int_distribution<int> lab(0, 9);
  for (auto& v : y) v = lab(rng);
  const std::size_t global = static_cast<std::size_t>(batch * c.gpus * c.accumulate);

  // CPU reference: one rank, the global batch, no scaling, the inf step skipped.
  TestMlp<float> ref(dims, seed + 1);
  lockstep::Sgd ref_opt(sgd);
  for (int s = 0; s < steps; ++s) {
    ref.zero_grad();
    std::vector<std::size_t> rows(global);
    for (std::size_t i = 0; i < global; ++i) rows[i] = (s * global + i) % samples;
    ref.forward_backward(X, y, rows, [](std::size_t) {});
    if (c.clip > 0 && s != inf_step) {  // torch.nn.utils.clip_grad_norm_'s rule, in double
      double sq = 0;
      for (auto& p : ref.parameters())
        for (float g : std::span(static_cast<const float*>(p.grad), p.numel())) sq += double(g) * g;
      const double coef = c.clip / (std::sqrt(sq) + 1e-6);
      if (coef < 1)
        for (auto& p : ref.parameters())
          for (float& g : std::span(static_cast<float*>(p.grad), p.numel())) g = static_cast<float>(g * coef);
    }
    ref_opt.step(ref.parameters(), s == inf_step);
  }
  if (ref.relu_margin() < relu_margin_needed) {  // on a ReLU kink: not comparable, other data
    MESSAGE("seed " << seed << ": a pre-activation within " << ref.relu_margin() << " of 0, drawing other data");
    auto next = c;
    next.seed = next_seed(seed);
    return check_fullshard<Strategy>(next);
  }
  const auto want = ref.flat_values();

  std::vector<int> devices(static_cast<std::size_t>(c.gpus));
  for (int i = 0; i < c.gpus; ++i) devices[static_cast<std::size_t>(i)] = i;
  std::vector<std::vector<float>> got(devices.size());
  std::vector<std::vector<std::string>> problems(devices.size());
  std::size_t lent = 0, shard_bytes = 0;
  lockstep::run(lockstep::Gpus{devices}, [&](lockstep::context<lockstep::NcclComm>& ctx) {
    const auto rank = static_cast<std::size_t>(ctx.rank());
    cudaStream_t s = ctx.comm().compute_stream();
    TestMlp<float> init(dims, seed + 1 + rank * 7919);  // differs per rank: rank 0's is broadcast
    GpuMlp m(dims, split_params(init), s);
    using DP =
        lockstep::DataParallel<GpuMlp, lockstep::NcclComm, lockstep::Accumulate<>, lockstep::DynamicScale, Strategy>;
    Strategy strategy{};
    strategy.buffers.prefetch = c.prefetch;
    if constexpr (std::is_same_v<Strategy, lockstep::FullySharded>) strategy.keep_after_forward = c.keep_after_forward;
    DP dp(ctx, m, {.max_grad_norm = c.clip}, lockstep::Accumulate<>(c.accumulate), lockstep::DynamicScale(so),
          strategy);
    lockstep::FusedSgd opt(sgd, dp.shard_parameters(), ctx.device());
    float* dX = nullptr;
    int *dy = nullptr, *drows = nullptr;
    LOCKSTEP_TRY_CUDA(cudaMalloc(&dX, X.size() * sizeof(float)));
    LOCKSTEP_TRY_CUDA(cudaMalloc(&dy, y.size() * sizeof(int)));
    LOCKSTEP_TRY_CUDA(cudaMalloc(&drows, batch * sizeof(int)));
    LOCKSTEP_TRY_CUDA(cudaMemcpy(dX, X.data(), X.size() * sizeof(float), cudaMemcpyHostToDevice));
    LOCKSTEP_TRY_CUDA(cudaMemcpy(dy, y.data(), y.size() * sizeof(int), cudaMemcpyHostToDevice));
    LOCKSTEP_TRY_CUDA(cudaDeviceSynchronize());
    for (int st = 0; st < steps; ++st) {
      lockstep::step_result r;
      for (int k = 0; k < c.accumulate; ++k) {
        std::vector<int> rows(batch);
        const std::size_t first = st * global + (static_cast<std::size_t>(k) * c.gpus + rank) * batch;
        for (int i = 0; i < batch; ++i) rows[static_cast<std::size_t>(i)] = static_cast<int>((first + i) % samples);
        LOCKSTEP_TRY_CUDA(cudaMemcpyAsync(drows, rows.data(), rows.size() * sizeof(int), cudaMemcpyHostToDevice, s));
        LOCKSTEP_TRY_CUDA(cudaStreamSynchronize(s));
        auto step = dp.step();
        const float scale = static_cast<float>(step.loss_scale());
        const bool plant = st == inf_step && static_cast<int>(rank) == inf_rank && step.synchronizes();
        m.forward_backward(
            dX, dy, drows, batch,
            [&](std::size_t i) {  // the loss scale the loss kernel would apply, and the planted inf
              auto p = m.parameters()[i];
              kern::mul<<<8, 256, 0, s>>>(static_cast<float*>(p.grad), p.numel(), scale);
              LOCKSTEP_CHECK_LAUNCH();
              if (plant && i == inf_param) {
                kern::poison<<<1, 1, 0, s>>>(static_cast<float*>(p.grad) + p.numel() / 2, NAN);
                LOCKSTEP_CHECK_LAUNCH();
              }
              step.gradient_ready(i);
            },
            1.f,
            [&](std::size_t l, bool forward) {
              return dp.use_block(l, forward ? lockstep::pass::forward : lockstep::pass::backward);
            });
        r = step.finish([&](std::span<const lockstep::param_slice> sl) { opt.step(sl, s); });
      }
      if (static_cast<bool>(r) != (st != inf_step))
        problems[rank].push_back("step " + std::to_string(st) + ": applied = " + std::to_string(r.applied));
    }
    dp.wait_all_parameters();
    got[rank] = m.flat_values();
    if (rank == 0) {
      lent = dp.stats().lent_bytes;
      shard_bytes = dp.stats().shard_bytes;
    }
    cudaFree(dX);
    cudaFree(dy);
    cudaFree(drows);
  });

  TestMlp<float> init(dims, seed + 1);
  CHECK(max_rel_diff(init.flat_values(), want) > 1e-3);  // training moved the parameters
  for (std::size_t r = 0; r < got.size(); ++r) {
    CAPTURE(r);
    for (const auto& p : problems[r]) FAIL_CHECK(p);
    CHECK(max_rel_diff(got[r], want) <= 1e-5);
    CHECK(got[r] == got[0]);  // bit for bit on every GPU
  }
  std::size_t P = 0, sizes = 0;  // sizes: Σ of the blocks' (padded) sizes — buffers are pooled per size
  for (std::size_t l = 0; l + 1 < dims.size(); ++l) {
    const auto b = static_cast<std::size_t>(dims[l] * dims[l + 1] + dims[l + 1]);
    P += b;
    sizes += b + static_cast<std::size_t>(c.gpus);
  }
  MESSAGE("GPU 0: shards " << shard_bytes << " bytes, lent block buffers " << lent << " bytes, model " << P * 4
                           << " bytes");
  CHECK(shard_bytes <= (P / static_cast<std::size_t>(c.gpus) + 4 * static_cast<std::size_t>(c.gpus)) * 4);
  if (!c.keep_after_forward) CHECK(lent <= 6 * sizes * 4);  // a few of each size, never one per use
}

// join() on GPUs: rank r has batches[r] batches (one rank two or more short, with 3+ GPUs one
// with none); a rank out of data replays its last step's block uses (gathers, prefetches,
// zero-gradient reduce-scatters) and steps its shards, so every GPU ends with the parameters of
// a CPU reference that averages, each step, the gradients of the ranks that had a batch.
template <class Strategy>
void check_join(int gpus, const Strategy& strategy, std::uint64_t seed_in = 0) {
  const auto seed = seed_in != 0 ? seed_in : fresh_seed();
  std::mt19937_64 rng(seed);
  const std::vector<int> dims{37, 64, 33, 19, 10};
  const lockstep::SgdOptions sgd{.lr = 0.05, .momentum = 0.9, .dampening = 0.0, .weight_decay = 1e-3};
  std::vector<int> batches(static_cast<std::size_t>(gpus));
  for (auto& b : batches) b = 2 + static_cast<int>(rng() % 4);
  batches[0] = 6;
  batches.back() = std::min(batches.back(), 3);
  if (gpus >= 3) batches[1] = 0;
  const int cycles = *std::max_element(batches.begin(), batches.end());
  CAPTURE(seed);
  CAPTURE(gpus);
  const std::size_t samples = 512;
  const int batch = 8;
  auto X = random_vector<float>(samples * dims[0], rng, -2, 2);
  std::vector<int> y(samples);
  for (auto& v : y) v = static_cast<int>(rng() % 10);
  const auto rows_of = [&](std::size_t r, int j) {
    std::vector<std::size_t> rows(batch);
    for (int i = 0; i < batch; ++i)
      rows[static_cast<std::size_t>(i)] = ((static_cast<std::size_t>(j) * gpus + r) * batch + i) % samples;
    return rows;
  };

  TestMlp<float> ref(dims, seed + 1);
  lockstep::Sgd ref_opt(sgd);
  for (int cy = 0; cy < cycles; ++cy) {
    int M = 0;
    for (int b : batches) M += b > cy ? 1 : 0;
    ref.zero_grad();
    for (std::size_t r = 0; r < batches.size(); ++r)
      if (batches[r] > cy) ref.forward_backward(X, y, rows_of(r, cy), [](std::size_t) {}, 1.0 / M);
    ref_opt.step(ref.parameters());
  }
  if (ref.relu_margin() < relu_margin_needed) {  // on a ReLU kink: not comparable, other data
    MESSAGE("seed " << seed << ": a pre-activation within " << ref.relu_margin() << " of 0, drawing other data");
    return check_join(gpus, strategy, next_seed(seed));
  }
  const auto want = ref.flat_values();

  std::vector<int> devices(static_cast<std::size_t>(gpus));
  for (int i = 0; i < gpus; ++i) devices[static_cast<std::size_t>(i)] = i;
  std::vector<std::vector<float>> got(devices.size());
  std::vector<std::size_t> shadow(devices.size());
  lockstep::run(lockstep::Gpus{devices}, [&](lockstep::context<lockstep::NcclComm>& ctx) {
    const auto rank = static_cast<std::size_t>(ctx.rank());
    cudaStream_t s = ctx.comm().compute_stream();
    TestMlp<float> init(dims, seed + 1 + rank * 7919);  // differs per rank: rank 0's is broadcast
    GpuMlp m(dims, split_params(init), s);
    lockstep::DataParallel<GpuMlp, lockstep::NcclComm, Strategy> dp(ctx, m, {}, strategy);
    lockstep::FusedSgd opt(sgd, dp.shard_parameters(), ctx.device());
    const auto on_shard = [&](std::span<const lockstep::param_slice> sl) { opt.step(sl, s); };
    float* dX = nullptr;
    int *dy = nullptr, *drows = nullptr;
    LOCKSTEP_TRY_CUDA(cudaMalloc(&dX, X.size() * sizeof(float)));
    LOCKSTEP_TRY_CUDA(cudaMalloc(&dy, y.size() * sizeof(int)));
    LOCKSTEP_TRY_CUDA(cudaMalloc(&drows, batch * sizeof(int)));
    LOCKSTEP_TRY_CUDA(cudaMemcpy(dX, X.data(), X.size() * sizeof(float), cudaMemcpyHostToDevice));
    LOCKSTEP_TRY_CUDA(cudaMemcpy(dy, y.data(), y.size() * sizeof(int), cudaMemcpyHostToDevice));
    {
      auto join = dp.join([](lockstep::step_result r) { CHECK(r.synced); }, on_shard);
      for (int j = 0; j < batches[rank]; ++j) {
        std::vector<int> rows;
        for (auto r : rows_of(rank, j)) rows.push_back(static_cast<int>(r));
        LOCKSTEP_TRY_CUDA(cudaMemcpyAsync(drows, rows.data(), rows.size() * sizeof(int), cudaMemcpyHostToDevice, s));
        LOCKSTEP_TRY_CUDA(cudaStreamSynchronize(s));
        auto step = dp.step();
        m.forward_backward(dX, dy, drows, batch, step.on_gradient_ready(), 1.f, [&](std::size_t l, bool forward) {
          return dp.use_block(l, forward ? lockstep::pass::forward : lockstep::pass::backward);
        });
        (void)step.finish(on_shard);
      }
      shadow[rank] = join.leave();
    }
    dp.wait_all_parameters();
    got[rank] = m.flat_values();
    cudaFree(dX);
    cudaFree(dy);
    cudaFree(drows);
  });
  for (std::size_t r = 0; r < got.size(); ++r) {
    CAPTURE(r);
    CHECK(shadow[r] == static_cast<std::size_t>(cycles - batches[r]));
    CHECK(max_rel_diff(got[r], want) <= 1e-5);
    CHECK(got[r] == got[0]);  // bit for bit on every GPU
  }
}

// FullySharded::gather_wire on n GPUs against the host's numbers (tests/support/
// value_wire_check.hpp, as tests/cpu/test_wire_cpu.cpp checks CPU ranks): GpuMlp trained with
// FusedSgd; after every step, with every block in use at once (an evaluation forward), each
// lent value is its rank's master shard through the codec's round trip, bit for bit; after
// wait_all_parameters(), the masters.
void check_block_wire(int n, lockstep::wire_format wire) {
  const auto seed = fresh_seed();
  CAPTURE(seed);
  CAPTURE(n);
  const std::string format = lockstep::name_of(wire);
  CAPTURE(format);
  std::mt19937_64 rng(seed);
  const std::vector<int> dims{37, 300, 33, 10};  // a block of 11100 + 300 values: several codec blocks
  const int batch = 8, steps = 3;
  const std::size_t samples = 256;
  auto X = random_vector<float>(samples * dims[0], rng, -2, 2);
  std::vector<int> y(samples);
  for (auto& v : y) v = static_cast<int>(rng() % 10);
  std::vector<value_wire_trace> t(static_cast<std::size_t>(n));
  lockstep::run(lockstep::Gpus{first_gpus(n)}, [&](lockstep::context<lockstep::NcclComm>& ctx) {
    const auto rank = static_cast<std::size_t>(ctx.rank());
    auto& tr = t[rank];
    cudaStream_t s = ctx.comm().compute_stream();
    TestMlp<float> init(dims, seed + 1);
    GpuMlp m(dims, split_params(init), s);
    lockstep::FullySharded fs;
    fs.gather_wire = wire;
    lockstep::DataParallel<GpuMlp, lockstep::NcclComm, lockstep::FullySharded> dp(ctx, m, {}, fs);
    using DP = decltype(dp);
    lockstep::FusedSgd opt({.lr = 0.05, .momentum = 0.9}, dp.shard_parameters(), ctx.device());
    lockstep_test::device_vector<float> dX(X.size());
    lockstep_test::device_vector<int> dy(y.size()), drows(batch);
    LOCKSTEP_TRY_CUDA(cudaMemcpy(dX.p, X.data(), X.size() * sizeof(float), cudaMemcpyHostToDevice));
    LOCKSTEP_TRY_CUDA(cudaMemcpy(dy.p, y.data(), y.size() * sizeof(int), cudaMemcpyHostToDevice));
    for (int st = 0; st < steps; ++st) {
      std::vector<int> rows(batch);
      for (int i = 0; i < batch; ++i) rows[static_cast<std::size_t>(i)] = static_cast<int>(rng() % samples);
      LOCKSTEP_TRY_CUDA(cudaMemcpyAsync(drows.p, rows.data(), rows.size() * sizeof(int), cudaMemcpyHostToDevice, s));
      LOCKSTEP_TRY_CUDA(cudaStreamSynchronize(s));
      auto step = dp.step();
      m.forward_backward(dX.p, dy.p, drows.p, batch, step.on_gradient_ready(), 1.f, [&](std::size_t l, bool forward) {
        return dp.use_block(l, forward ? lockstep::pass::forward : lockstep::pass::backward);
      });
      REQUIRE(step.finish([&](std::span<const lockstep::param_slice> sl) { opt.step(sl, s); }));
      {
        std::vector<lockstep::block_use<DP>> held;
        for (std::size_t k = 0; k + 1 < dims.size(); ++k) held.push_back(dp.use_block(k, lockstep::pass::forward));
        LOCKSTEP_TRY_CUDA(cudaStreamSynchronize(s));
        tr.replicas.push_back(m.flat_values());
      }
      auto& ms = tr.masters.emplace_back();
      LOCKSTEP_TRY_CUDA(cudaStreamSynchronize(s));
      for (const auto& sp : dp.shard_parameters()) {
        ms.emplace_back(sp.numel());
        LOCKSTEP_TRY_CUDA(cudaMemcpy(ms.back().data(), sp.value, sp.bytes(), cudaMemcpyDeviceToHost));
      }
    }
    dp.wait_all_parameters();
    LOCKSTEP_TRY_CUDA(cudaStreamSynchronize(s));
    tr.exact = m.flat_values();
    tr.map.assign(dp.shard_map().begin(), dp.shard_map().end());
  });
  const auto flat_at = mlp_flat_offsets(dims);
  std::size_t rounded = 0;  // over the steps, on every rank
  for (std::size_t st = 0; st < static_cast<std::size_t>(steps); ++st) {
    CAPTURE(st);
    CHECK(lent_mismatches(t, flat_at, wire, lockstep::dtype::f32, st) == 0);
    rounded += lent_mismatches(t, flat_at, lockstep::wire_format::fp32, lockstep::dtype::f32, st);
  }
  CHECK(rounded > t.size() * flat_at.back());  // the wire rounded most values
  const std::vector<float> none(flat_at.back(), std::numeric_limits<float>::quiet_NaN());
  const auto exact =
      expected_replica(t, static_cast<std::size_t>(steps - 1), none, flat_at, false, lockstep::wire_format::fp32);
  for (const auto& rank : t) CHECK(rank.exact == exact);
}

// FullySharded::gather_wire into each lent type on n GPUs: lent_probe (no compute, typed attach,
// every parameter its own block) in device memory; after construction, with every block in use,
// each value is its rank's master through the wire rounded to the lent type — the host's numbers
// (tests/support/value_wire_check.hpp) bit for bit, as test_wire_cpu checks CPU ranks.
void check_lent_wire(int n, lockstep::wire_format wire, lockstep::dtype lent) {
  const auto seed = fresh_seed();
  CAPTURE(seed);
  CAPTURE(n);
  const std::string format = lockstep::name_of(wire), lent_name = lockstep::name_of(lent);
  CAPTURE(format);
  CAPTURE(lent_name);
  std::mt19937_64 rng(seed);
  const std::vector<std::size_t> sizes{1000, 37, 50003, 3, 7000};
  const auto flat_at = flat_offsets(sizes);
  const auto init = random_vector<float>(flat_at.back(), rng, -3.0, 3.0);
  std::vector<value_wire_trace> t(static_cast<std::size_t>(n));
  lockstep::run(lockstep::Gpus{first_gpus(n)}, [&](lockstep::context<lockstep::NcclComm>& ctx) {
    auto& tr = t[static_cast<std::size_t>(ctx.rank())];
    lockstep_test::device_vector<float> vals(init), grads(init.size());
    std::vector<void*> v, g;
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      v.push_back(vals.p + flat_at[i]);
      g.push_back(grads.p + flat_at[i]);
    }
    lent_probe m(v, g, sizes);
    lockstep::FullySharded fs;
    fs.gather_wire = wire;
    fs.param_dtype = lent;
    lockstep::DataParallel<lent_probe, lockstep::NcclComm, lockstep::FullySharded> dp(ctx, m, {}, fs);
    using DP = decltype(dp);
    cudaStream_t s = ctx.comm().compute_stream();
    {
      std::vector<lockstep::block_use<DP>> held;
      for (std::size_t k = 0; k < sizes.size(); ++k) held.push_back(dp.use_block(k, lockstep::pass::forward));
      LOCKSTEP_TRY_CUDA(cudaStreamSynchronize(s));
      auto& seen = tr.replicas.emplace_back();
      for (std::size_t i = 0; i < sizes.size(); ++i) {
        REQUIRE(m.type[i] == lent);
        std::vector<unsigned char> raw(sizes[i] * lockstep::size_of(lent));
        LOCKSTEP_TRY_CUDA(cudaMemcpy(raw.data(), m.vals[i], raw.size(), cudaMemcpyDeviceToHost));
        widen(raw.data(), sizes[i], lent, seen);
      }
    }
    auto& ms = tr.masters.emplace_back();
    for (const auto& sp : dp.shard_parameters()) {
      ms.emplace_back(sp.numel());
      LOCKSTEP_TRY_CUDA(cudaMemcpy(ms.back().data(), sp.value, sp.bytes(), cudaMemcpyDeviceToHost));
    }
    tr.map.assign(dp.shard_map().begin(), dp.shard_map().end());
  });
  CHECK(lent_mismatches(t, flat_at, wire, lent) == 0);
  if (wire != lockstep::wire_format::fp32)
    CHECK(lent_mismatches(t, flat_at, lockstep::wire_format::fp32, lent) > init.size() / 2);  // (rounded by the wire)
  else CHECK(lent_mismatches(t, flat_at, wire, lockstep::dtype::f32) > init.size() / 2);      // (rounded to bf16)
}

}  // namespace

TEST_SUITE("gpu") {
TEST_CASE("fullshard zero2 zero3 on 1 GPU == CPU reference - accumulation - an inf skipped - clipping") {
  LOCKSTEP_REQUIRE_GPUS(1);
  check_fullshard<lockstep::ShardedGradients>({.gpus = 1});
  check_fullshard<lockstep::FullySharded>({.gpus = 1, .accumulate = 2, .clip = 0.5});
}

TEST_CASE("fullshard bf16 param_dtype on 1 GPU: each use lends the masters rounded to nearest") {
  LOCKSTEP_REQUIRE_GPUS(1);
  check_lent_wire(1, lockstep::wire_format::fp32, lockstep::dtype::bf16);
}
}

TEST_SUITE("multigpu") {
TEST_CASE("fullshard zero2 zero3 on 2 GPUs == CPU reference - accumulation - an inf skipped - clipping") {
  LOCKSTEP_REQUIRE_GPUS(2);
  check_fullshard<lockstep::ShardedGradients>({.gpus = 2});
  check_fullshard<lockstep::ShardedGradients>({.gpus = 2, .accumulate = 2, .clip = 0.5});
  check_fullshard<lockstep::FullySharded>({.gpus = 2});
  check_fullshard<lockstep::FullySharded>({.gpus = 2, .accumulate = 3, .clip = 0.5});
  check_fullshard<lockstep::FullySharded>({.gpus = 2, .keep_after_forward = true, .prefetch = 2});
  check_fullshard<lockstep::FullySharded>({.gpus = 2, .prefetch = 0});
}
TEST_CASE("fullshard gather wire on 2 GPUs: each use lends every rank's master through the codec - into f32 and bf16 - "
          "the host's numbers") {
  LOCKSTEP_REQUIRE_GPUS(2);
  check_block_wire(2, lockstep::wire_format::int8);
  check_block_wire(2, lockstep::wire_format::bf16);
  check_lent_wire(2, lockstep::wire_format::int8, lockstep::dtype::f32);
  check_lent_wire(2, lockstep::wire_format::int8, lockstep::dtype::bf16);
  check_lent_wire(2, lockstep::wire_format::bf16, lockstep::dtype::f32);
  check_lent_wire(2, lockstep::wire_format::fp32, lockstep::dtype::bf16);  // param_dtype's own gather, no wire
}
// A CUDA graph capture of a use whose gathers go through gather_wire is refused by name (its
// staging buffers are reused by the host between replays); the buffers were pooled by an eager
// use first, so that nothing allocates inside the capture.
TEST_CASE("fullshard gather wire on 2 GPUs: a capture of a use is refused naming gather_wire") {
  LOCKSTEP_REQUIRE_GPUS(2);
  std::vector<std::string> seen(2);
  lockstep::run(lockstep::Gpus{first_gpus(2)}, [&](lockstep::context<lockstep::NcclComm>& ctx) {
    const std::vector<std::size_t> sizes{3000, 77};
    lockstep_test::device_vector<float> vals(std::vector<float>(3077, 0.5f)), grads(3077);
    lent_probe m({vals.p, vals.p + 3000}, {grads.p, grads.p + 3000}, sizes);
    lockstep::FullySharded fs;
    fs.gather_wire = lockstep::wire_format::int8;
    lockstep::DataParallel<lent_probe, lockstep::NcclComm, lockstep::FullySharded> dp(ctx, m, {}, fs);
    cudaStream_t s = ctx.comm().compute_stream();
    {
      auto eager = dp.use_block(0, lockstep::pass::forward);
    }
    LOCKSTEP_TRY_CUDA(cudaStreamSynchronize(s));
    LOCKSTEP_TRY_CUDA(cudaStreamBeginCapture(s, cudaStreamCaptureModeRelaxed));
    try {
      auto captured = dp.use_block(0, lockstep::pass::forward);
      seen[static_cast<std::size_t>(ctx.rank())] = "captured";
    } catch (const lockstep::config_error& e) {
      seen[static_cast<std::size_t>(ctx.rank())] = e.what();
    }
    cudaGraph_t graph = nullptr;
    (void)cudaStreamEndCapture(s, &graph);
    if (graph) cudaGraphDestroy(graph);
    (void)cudaGetLastError();
  });
  for (const auto& e : seen) CHECK(e.find("FullySharded::gather_wire in a CUDA graph capture") != std::string::npos);
}
TEST_CASE("join with fullshard zero2 zero3 on 2 GPUs == CPU reference averaging the ranks that had data") {
  LOCKSTEP_REQUIRE_GPUS(2);
  lockstep::FullySharded kept;
  kept.keep_after_forward = true;
  kept.buffers.prefetch = 2;
  check_join(2, lockstep::ShardedGradients{});
  check_join(2, lockstep::FullySharded{});
  check_join(2, kept);
}
TEST_CASE("fullshard zero2 zero3 on 4 GPUs == CPU reference - accumulation - an inf skipped - clipping") {
  LOCKSTEP_REQUIRE_GPUS(4);
  check_fullshard<lockstep::ShardedGradients>({.gpus = 4, .accumulate = 2});
  check_fullshard<lockstep::FullySharded>({.gpus = 4});
  check_fullshard<lockstep::FullySharded>({.gpus = 4, .accumulate = 2, .clip = 0.5});
}
TEST_CASE("join with fullshard zero2 zero3 on 4 GPUs == CPU reference - one rank without a batch") {
  LOCKSTEP_REQUIRE_GPUS(4);
  check_join(4, lockstep::ShardedGradients{});
  check_join(4, lockstep::FullySharded{});
}
}
