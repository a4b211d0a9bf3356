// lockstep::TorchModule on GPUs (NcclComm, one thread per GPU, libtorch's current stream set to
// lockstep's compute stream): the tiny GPT-2 trained on N GPUs x batch B equals one GPU x batch
// N·B (fp32, lockstep's FusedAdamW per bucket, torch::optim::AdamW on the averaged .grad, and
// ShardedOptimizer: FusedAdamW over the shards, the values bound into the shards' arena and
// waited for block by block in the forward; ShardedGradients and FullySharded per transformer
// block, recomputed or with values and gradient shards kept), and one GPU equals plain libtorch
// on the CPU; FullySharded with bf16 gathers is as close to bf16 autocast as fp32 is; fp16
// autocast with DeviceDynamicScale learns, and an inf on one GPU skips that step on every GPU.
// Built where libtorch has CUDA.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <vector>

#include <ATen/autocast_mode.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/torch.h>
#include <torch/version.h>

#include <lockstep/cuda.cuh>
#include <lockstep/lockstep.hpp>
#include <lockstep/torch.hpp>

#include "gpu_test_util.cuh"
#include "test_util.hpp"
#include "torch_test_util.hpp"

namespace {

using namespace lockstep_test;

constexpr double lr = 1e-3, wd = 0.1;

void set_autocast(at::ScalarType t, bool on) {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
  at::autocast::set_autocast_enabled(at::kCUDA, on);
  at::autocast::set_autocast_dtype(at::kCUDA, t);
#else
  at::autocast::set_enabled(on);
  at::autocast::set_autocast_gpu_dtype(t);
#endif
}

std::vector<int> first_gpus(int n) {
  std::vector<int> d(static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i) d[static_cast<std::size_t>(i)] = i;
  return d;
}

// How the optimizer steps: lockstep's FusedAdamW per bucket, torch::optim::AdamW after finish(),
// or sharded (FusedAdamW over dp.shard_parameters(), gather_in_forward); or FusedAdamW over the
// shards of block sharding, each transformer block a block, its buffers from libtorch's
// allocator (TorchModule::block_storage): ShardedGradients; FullySharded with recomputed blocks
// (gradient shards per cycle); FullySharded with the values kept from forward to backward, two
// blocks prefetched and BlockBuffers::keep_gradient_shards.
enum class how { fused, torch_optim, sharded, zero2, zero3, zero3_kept };

struct trained {
  std::vector<std::vector<torch::Tensor>> params;  // per rank, on the CPU
  std::vector<double> loss;                        // mean over ranks, per step
  std::vector<std::string> problems;               // seen on the rank threads
};

// `gpus` GPUs, B sequences each per step, from rank 0's copy of `init`; fp32 (no autocast, no
// TF32), AdamW as `mode` says.
trained train_fp32(int gpus, int B, int steps, const torch::Tensor& data, gpt2::Gpt init, how mode) {
  const auto c = tiny();
  trained out;
  out.params.resize(static_cast<std::size_t>(gpus));
  out.loss.assign(static_cast<std::size_t>(steps), 0.0);
  std::mutex m;
  lockstep::run(lockstep::Gpus{first_gpus(gpus)}, [&](lockstep::context<lockstep::NcclComm>& ctx) {
    const auto rank = static_cast<std::size_t>(ctx.rank());
    const auto dev = static_cast<c10::DeviceIndex>(ctx.device());
    const cudaStream_t s = ctx.comm().compute_stream();
    c10::cuda::CUDAGuard device_guard(dev);
    c10::cuda::CUDAStreamGuard stream_guard(c10::cuda::getStreamFromExternal(s, dev));
    gpt2::Gpt model(nullptr);
    {
      std::lock_guard<std::mutex> lock(m);
      torch::manual_seed(1000 + rank);  // every rank different: DataParallel broadcasts rank 0's
      model = gpt2::Gpt(c);
      if (rank == 0) copy_parameters(*model, *init);
    }
    model->to(torch::Device(torch::kCUDA, dev));
    lockstep::TorchModule tm(model);
    const lockstep::DataParallelOptions o{.buckets = {.first_bytes = 4096, .cap_bytes = 16384}};
    const lockstep::AdamWOptions ao{.lr = lr, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = wd};
    const auto problem = [&](const std::string& what) {
      std::lock_guard<std::mutex> lock(m);
      out.problems.push_back("rank " + std::to_string(rank) + ": " + what);
    };
    // before: each submodule's wait (sharded); finish(step): the step's end, true if applied;
    // run and root (block sharding): the blocks' runner and block 0's use around each pass.
    const auto no_root = [](lockstep::pass) { return std::optional<int>(); };
    const auto loop = [&](auto& dp, const gpt2::before_fn& before, auto&& finish, const gpt2::run_fn& run,
                          auto&& root) {
      for (int k = 0; k < steps; ++k) {
        auto rows = data.narrow(0, static_cast<std::int64_t>(rank) * B, B).to(torch::Device(torch::kCUDA, dev));
        auto step = dp.step();
        torch::Tensor loss;
        {
          [[maybe_unused]] const auto held = root(lockstep::pass::forward);
          loss = model->loss(rows.narrow(1, 0, c.context), rows.narrow(1, 1, c.context), before, run);
        }
        {
          [[maybe_unused]] const auto held = root(lockstep::pass::backward);
          tm.backward(loss, step.on_gradient_ready());
        }
        if (!finish(step)) problem("a step was not applied");
        const double l = lockstep::mean_across_ranks(ctx.comm(), loss.item<double>());
        if (rank == 0) out.loss[static_cast<std::size_t>(k)] = l;
      }
    };
    const auto blocked = [&](auto strategy, bool recompute) {
      tm.set_blocks(std::vector<std::shared_ptr<torch::nn::Module>>(model->blocks->begin(), model->blocks->end()));
      lockstep::DataParallel dp(ctx, tm, o, strategy);
      lockstep::FusedAdamW opt(ao, dp.shard_parameters(), ctx.device());
      lockstep::TorchBlocks blocks;
      lockstep::shard_blocks(dp, blocks);
      loop(
          dp, {},
          [&](auto& step) { return step.finish([&](std::span<const lockstep::param_slice> b) { opt.step(b, s); }); },
          blocks.function(recompute), [&](lockstep::pass p) { return std::optional(dp.use_block(0, p)); });
      dp.wait_all_parameters();  // the whole values attached while dp lives
      LOCKSTEP_TRY_CUDA(cudaStreamSynchronize(s));
      for (auto& p : model->parameters()) out.params[rank].push_back(p.detach().cpu());
    };
    if (mode == how::zero2) {
      blocked(lockstep::ShardedGradients{}, false);
      return;
    }
    if (mode == how::zero3 || mode == how::zero3_kept) {
      lockstep::FullySharded fs;
      if (mode == how::zero3_kept) {
        fs.keep_after_forward = true;
        fs.buffers.prefetch = 2;
        fs.buffers.keep_gradient_shards = true;
      }
      blocked(fs, mode == how::zero3);
      return;
    }
    if (mode == how::sharded) {
      lockstep::DataParallel dp(ctx, tm, o, lockstep::ShardedOptimizer{.gather_in_forward = true});
      lockstep::FusedAdamW opt(ao, dp.shard_parameters(), ctx.device());
      loop(
          dp,
          [&](torch::nn::Module& sub) {
            for (auto i : tm.indices_of(sub)) dp.wait_parameters(i);
          },
          [&](auto& step) { return step.finish([&](std::span<const lockstep::param_slice> b) { opt.step(b, s); }); },
          {}, no_root);
      if (!dp.stats().values_bound) problem("the parameters were not bound into the shards' arena");
      if (tm.tensors()[0].data_ptr() != dp.parameters()[0].value) problem("parameter 0 is not a view of the arena");
    } else {
      lockstep::DataParallel dp(ctx, tm, o);
      if (mode == how::fused) {
        lockstep::FusedAdamW opt(ao, dp.parameters(), ctx.device());
        loop(
            dp, {},
            [&](auto& step) { return step.finish([&](std::span<const lockstep::param_slice> b) { opt.step(b, s); }); },
            {}, no_root);
      } else {
        torch::optim::AdamW opt(tm.tensors(),
                                torch::optim::AdamWOptions(lr).betas({0.9, 0.999}).eps(1e-8).weight_decay(wd));
        loop(
            dp, {},
            [&](auto& step) {
              const bool applied = static_cast<bool>(step.finish());
              if (applied) opt.step();
              return applied;
            },
            {}, no_root);
      }
    }
    // The DataParallel is gone: the module holds its parameters (and, sharded, its values) itself.
    LOCKSTEP_TRY_CUDA(cudaStreamSynchronize(s));
    for (auto& p : model->parameters()) out.params[rank].push_back(p.detach().cpu());
  });
  return out;
}

double rel_diff(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  REQUIRE(a.size() == b.size());
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    auto x = a[i].to(torch::kDouble), y = b[i].to(torch::kDouble);
    num += (x - y).pow(2).sum().item<double>();
    den += y.pow(2).sum().item<double>();
  }
  return std::sqrt(num) / std::max(std::sqrt(den), 1e-300);
}

// N GPUs x B == 1 GPU x N·B (≤ 1e-5), every GPU the same bit for bit; 1 GPU == libtorch on the
// CPU (≤ 1e-4: cuBLAS and the CPU's GEMMs round differently, and AdamW's normalisation lifts
// that); the loss goes down (one batch, learned by heart).
void check_fp32(int gpus, how mode) {
  torch::set_num_threads(1);
  at::globalContext().setAllowTF32CuBLAS(false);
  const auto seed = fresh_seed();
  CAPTURE(seed);
  CAPTURE(gpus);
  CAPTURE(static_cast<int>(mode));
  const auto c = tiny();
  const int B = 2, steps = 5;
  const auto data = tokens(gpus * B, c, seed + 1);
  torch::manual_seed(seed);
  gpt2::Gpt init(c);

  gpt2::Gpt cpu(c);  // the CPU reference: plain libtorch, the whole batch
  copy_parameters(*cpu, *init);
  torch::optim::AdamW cpu_opt(cpu->parameters(),
                              torch::optim::AdamWOptions(lr).betas({0.9, 0.999}).eps(1e-8).weight_decay(wd));
  for (int k = 0; k < steps; ++k) {
    cpu_opt.zero_grad();
    cpu->loss(data.narrow(1, 0, c.context), data.narrow(1, 1, c.context)).backward();
    cpu_opt.step();
  }
  std::vector<torch::Tensor> want;
  for (auto& p : cpu->parameters()) want.push_back(p.detach());

  const auto one = train_fp32(1, gpus * B, steps, data, init, mode);
  const auto many = gpus > 1 ? train_fp32(gpus, B, steps, data, init, mode) : one;
  for (const auto* t : {&one, &many}) {
    for (const auto& p : t->problems) FAIL_CHECK(p);
    CHECK(t->loss.back() < t->loss.front());
  }
  const double d_cpu = rel_diff(one.params[0], want);
  MESSAGE("1 GPU vs libtorch on the CPU: relative difference " << d_cpu);
  CHECK(d_cpu <= 1e-4);
  for (int r = 0; r < gpus; ++r) {
    CAPTURE(r);
    const double d = rel_diff(many.params[static_cast<std::size_t>(r)], one.params[0]);
    MESSAGE(gpus << " GPUs, rank " << r << " vs 1 GPU with the whole batch: relative difference " << d);
    CHECK(d <= 1e-5);
    CHECK(rel_diff(many.params[static_cast<std::size_t>(r)], many.params[0]) == 0.0);
  }
}

// fp16 autocast, the loss multiplied by DeviceDynamicScale's device scale, FusedAdamW reading
// its device flag: the loss goes down; at a drawn step one drawn GPU's loss is multiplied by
// inf, and that step changes no parameter on any GPU (the scale backs off once: one skip).
void check_fp16_device_scaling(int gpus) {
  const auto seed = fresh_seed();
  std::mt19937_64 rng(seed);
  const int steps = 30, inf_step = 3 + static_cast<int>(rng() % 20);
  const int inf_rank = static_cast<int>(rng() % static_cast<unsigned>(gpus));
  CAPTURE(seed);
  CAPTURE(gpus);
  CAPTURE(inf_step);
  CAPTURE(inf_rank);
  const auto c = tiny();
  const int B = 4;
  const auto data = tokens(gpus * B, c, seed + 1);
  std::vector<std::string> problems;
  std::vector<double> mean_loss(steps, 0.0);
  std::vector<lockstep::loss_scale_state> states(static_cast<std::size_t>(gpus));
  std::mutex m;
  lockstep::run(lockstep::Gpus{first_gpus(gpus)}, [&](lockstep::context<lockstep::NcclComm>& ctx) {
    const auto rank = static_cast<int>(ctx.rank());
    const auto dev = static_cast<c10::DeviceIndex>(ctx.device());
    const cudaStream_t s = ctx.comm().compute_stream();
    c10::cuda::CUDAGuard device_guard(dev);
    c10::cuda::CUDAStreamGuard stream_guard(c10::cuda::getStreamFromExternal(s, dev));
    gpt2::Gpt model(nullptr);
    {
      std::lock_guard<std::mutex> lock(m);
      torch::manual_seed(seed);
      model = gpt2::Gpt(c);
    }
    model->to(torch::Device(torch::kCUDA, dev));
    lockstep::TorchModule tm(model);
    set_autocast(at::kHalf, true);
    // [snippet docs/torch.md#2]
    lockstep::DataParallel<lockstep::TorchModule, lockstep::NcclComm, lockstep::EveryStep, lockstep::DeviceDynamicScale>
        dp(ctx, tm, {}, lockstep::EveryStep{}, lockstep::DeviceDynamicScale({.init_scale = 1024.0}));
    dp.scaler().attach(dp.comm());  // the scale lives on the GPU from here on
    const auto fopts = torch::TensorOptions().dtype(torch::kFloat).device(torch::kCUDA, dev);
    const auto scale = torch::from_blob(const_cast<float*>(dp.scaler().device_scale()), {}, fopts);
    const int* found = dp.scaler().device_found_inf();
    lockstep::FusedAdamW opt({.lr = 3e-3, .weight_decay = wd}, dp.parameters(), ctx.device());
    // [end snippet]
    for (int k = 0; k < steps; ++k) {
      auto rows = data.narrow(0, rank * B, B).to(torch::Device(torch::kCUDA, dev));
      // [snippet docs/torch.md#2]
      // every step (rows: this rank's batch on its GPU):
      auto step = dp.step();
      auto loss = model->loss(rows.narrow(1, 0, c.context), rows.narrow(1, 1, c.context));
      auto scaled = loss * scale;
      // [end snippet]
      if (k == inf_step && rank == inf_rank) scaled = scaled * std::numeric_limits<float>::infinity();
      std::vector<torch::Tensor> before;
      if (k == inf_step)
        for (auto& p : model->parameters()) before.push_back(p.detach().clone());
      // [snippet docs/torch.md#2]
      tm.backward(scaled, step.on_gradient_ready());
      at::autocast::clear_cache();
      (void)step.finish(
          [&](std::span<const lockstep::param_slice> b) { opt.step(b, s, found); });  // skipped on inf/NaN
      // [end snippet]
      if (k == inf_step) {
        auto ps = model->parameters();
        for (std::size_t i = 0; i < ps.size(); ++i)
          if (!torch::equal(ps[i].detach(), before[i])) {
            std::lock_guard<std::mutex> lock(m);
            problems.push_back("rank " + std::to_string(rank) + ": parameter " + std::to_string(i) +
                               " changed in the skipped step");
          }
      }
      const double mean = lockstep::mean_across_ranks(ctx.comm(), loss.item<double>());
      if (rank == 0) mean_loss[static_cast<std::size_t>(k)] = mean;
    }
    set_autocast(at::kHalf, false);
    states[static_cast<std::size_t>(rank)] = dp.scaler().state();
  });
  for (const auto& p : problems) FAIL_CHECK(p);
  MESSAGE("fp16 on " << gpus << " GPU(s): loss " << mean_loss.front() << " -> " << mean_loss.back());
  CHECK(mean_loss.back() < 0.9 * mean_loss.front());
  for (const auto& st : states) {
    CHECK(st.skipped_steps == 1);
    CHECK(st.steps == steps);
    CHECK(st == states[0]);
  }
}

// FullySharded with param_dtype = bf16 (bf16 gathers of fp32 master shards, bf16 gradients
// widened for the reduce-scatter; CudaMemory::convert) on `gpus` GPUs, recomputed blocks, the
// forward under bf16 autocast (the backward without: the recomputation replays it), FusedAdamW
// on the shards — against the same model Replicated under the same autocast (whose casts round
// the weights alike; autocast off: the fp32 reference). Returns each rank's trained parameters,
// on the CPU.
template <class Strategy>
std::vector<std::vector<torch::Tensor>> train_bf16(int gpus, const torch::Tensor& data, gpt2::Gpt init,
                                                   Strategy strategy, bool autocast = true) {
  const auto c = tiny();
  const int B = 2, steps = 4;
  std::vector<std::vector<torch::Tensor>> out(static_cast<std::size_t>(gpus));
  std::mutex m;
  lockstep::run(lockstep::Gpus{first_gpus(gpus)}, [&](lockstep::context<lockstep::NcclComm>& ctx) {
    const auto rank = static_cast<std::size_t>(ctx.rank());
    const auto dev = static_cast<c10::DeviceIndex>(ctx.device());
    const cudaStream_t s = ctx.comm().compute_stream();
    c10::cuda::CUDAGuard device_guard(dev);
    c10::cuda::CUDAStreamGuard stream_guard(c10::cuda::getStreamFromExternal(s, dev));
    gpt2::Gpt model(nullptr);
    {
      std::lock_guard<std::mutex> lock(m);
      model = gpt2::Gpt(c);
      copy_parameters(*model, *init);
    }
    model->to(torch::Device(torch::kCUDA, dev));
    lockstep::TorchModule tm(model);
    constexpr bool blocked = lockstep::detail::is_block_sharded<Strategy>::value;
    if constexpr (blocked)
      tm.set_blocks(std::vector<std::shared_ptr<torch::nn::Module>>(model->blocks->begin(), model->blocks->end()));
    lockstep::DataParallel dp(ctx, tm, strategy);
    const lockstep::AdamWOptions ao{.lr = lr, .weight_decay = wd};
    const auto& stepped = [&]() -> const std::vector<lockstep::parameter>& {
      if constexpr (blocked) return dp.shard_parameters();
      else return dp.parameters();
    }();
    lockstep::FusedAdamW opt(ao, stepped, ctx.device());
    lockstep::TorchBlocks blocks;
    gpt2::run_fn run;
    if constexpr (blocked) {
      lockstep::shard_blocks(dp, blocks);
      run = blocks.function(true);
    }
    const auto root = [&](lockstep::pass p) {
      if constexpr (blocked) return std::optional(dp.use_block(0, p));
      else return std::optional<int>();
    };
    for (int k = 0; k < steps; ++k) {
      auto rows = data.narrow(0, static_cast<std::int64_t>(rank) * B, B).to(torch::Device(torch::kCUDA, dev));
      auto step = dp.step();
      torch::Tensor loss;
      {
        [[maybe_unused]] const auto held = root(lockstep::pass::forward);
        set_autocast(at::kBFloat16, autocast);
        loss = model->loss(rows.narrow(1, 0, c.context), rows.narrow(1, 1, c.context), {}, run);
        set_autocast(at::kBFloat16, false);
        at::autocast::clear_cache();
      }
      {
        [[maybe_unused]] const auto held = root(lockstep::pass::backward);
        tm.backward(loss, step.on_gradient_ready());
      }
      step.finish([&](std::span<const lockstep::param_slice> b) { opt.step(b, s); });
    }
    dp.wait_all_parameters();
    LOCKSTEP_TRY_CUDA(cudaStreamSynchronize(s));
    for (auto& p : model->parameters()) out[rank].push_back(p.detach().cpu());
  });
  return out;
}

void check_bf16_fullshard(int gpus) {
  torch::set_num_threads(1);
  const auto seed = fresh_seed();
  CAPTURE(seed);
  CAPTURE(gpus);
  const auto data = tokens(gpus * 2, tiny(), seed + 1);
  torch::manual_seed(seed);
  gpt2::Gpt init(tiny());
  lockstep::FullySharded fs;
  fs.param_dtype = lockstep::dtype::bf16;
  const auto ref = train_bf16(gpus, data, init, lockstep::Replicated{});
  const auto fp32 = train_bf16(gpus, data, init, lockstep::Replicated{}, false);
  const auto got = train_bf16(gpus, data, init, fs);
  // Not the same numbers: here every parameter is bf16 in the forward (FSDP2's param_dtype) —
  // the embeddings too, so the residual stream is bf16 — while autocast keeps the embeddings,
  // norms and residual stream fp32. As far from that reference as fp32 training is (measured
  // 1.1-1.4x on 2 and 4 H200s), not farther: values or gradients gone wrong would be orders
  // beyond. (The CPU test, Linears only, matches autocast bit for bit.)
  const double apart = rel_diff(fp32[0], ref[0]);
  MESSAGE("Replicated fp32 vs Replicated under bf16 autocast: relative difference " << apart);
  for (int r = 0; r < gpus; ++r) {
    CAPTURE(r);
    for (const auto& p : got[static_cast<std::size_t>(r)]) CHECK((p.scalar_type() == torch::kFloat));
    const double d = rel_diff(got[static_cast<std::size_t>(r)], ref[0]);
    MESSAGE("bf16 gathers, rank " << r << " vs Replicated under bf16 autocast: relative difference " << d);
    CHECK(d <= 3 * apart);
    CHECK(rel_diff(got[static_cast<std::size_t>(r)], got[0]) == 0.0);
  }
  std::vector<torch::Tensor> start;
  for (auto& p : init->parameters()) start.push_back(p.detach());
  CHECK(rel_diff(got[0], start) > 1e-3);  // it trained
}

}  // namespace

TEST_SUITE("gpu") {
TEST_CASE("TorchModule on 1 GPU == libtorch on the CPU: tiny GPT-2 fp32 - FusedAdamW - torch::optim::AdamW - sharded") {
  LOCKSTEP_REQUIRE_GPUS(1);
  check_fp32(1, how::fused);
  check_fp32(1, how::torch_optim);
  check_fp32(1, how::sharded);
}
TEST_CASE("TorchModule fp16 autocast + DeviceDynamicScale on 1 GPU: learns - an inf step is skipped") {
  LOCKSTEP_REQUIRE_GPUS(1);
  check_fp16_device_scaling(1);
}
}

TEST_SUITE("multigpu") {
TEST_CASE("TorchModule on 2 GPUs x B == 1 GPU x 2B == libtorch on the CPU: tiny GPT-2 fp32 - sharded too") {
  LOCKSTEP_REQUIRE_GPUS(2);
  check_fp32(2, how::fused);
  check_fp32(2, how::torch_optim);
  check_fp32(2, how::sharded);
}
TEST_CASE("TorchModule fullshard zero2 zero3 on 2 GPUs x B == 1 GPU x 2B == libtorch on the CPU: tiny GPT-2 fp32") {
  LOCKSTEP_REQUIRE_GPUS(2);
  check_fp32(2, how::zero2);
  check_fp32(2, how::zero3);
  check_fp32(2, how::zero3_kept);
}
TEST_CASE("TorchModule fullshard zero3 bf16 param_dtype on 2 GPUs == Replicated under bf16 autocast (recomputed)") {
  LOCKSTEP_REQUIRE_GPUS(2);
  check_bf16_fullshard(2);
}
TEST_CASE("TorchModule fp16 autocast + DeviceDynamicScale on 2 GPUs: an inf on one GPU skips the step on both") {
  LOCKSTEP_REQUIRE_GPUS(2);
  check_fp16_device_scaling(2);
}
TEST_CASE("TorchModule on 4 GPUs x B == 1 GPU x 4B == libtorch on the CPU: tiny GPT-2 fp32 - sharded too") {
  LOCKSTEP_REQUIRE_GPUS(4);
  check_fp32(4, how::fused);
  check_fp32(4, how::sharded);
  check_fp32(4, how::zero3);
  check_fp16_device_scaling(4);
  check_bf16_fullshard(4);
}
}
