// A Llama-style decoder (llama.hpp: RMSNorm, rotary positions, SwiGLU, causal attention, untied
// head; depth, width, heads, FFN and vocabulary set by flags) trained fully sharded by lockstep
// on real text (the bytes of Debian's fortune cookies, as example 03): FullySharded (ZeRO-3,
// the default) keeps 1/N of the values, gradients and AdamW state per rank; each transformer
// block is gathered for its forward and again for its backward (TorchBlocks), the rest
// (embeddings, final norm, head) is block 0. One body for every mode run(Auto) picks:
//
//   ./llama_fsdp --depth 8                         all local GPUs, one thread each (NcclComm)
//   lockstep-run --nproc 4 ./llama_fsdp            one process per GPU
//   ./llama_fsdp --device cpu --width 64 ...       CPU ranks (LOCKSTEP_CPU_RANKS, ThreadComm)
//
// --zero 0|1|2|3 picks plain data parallelism, ShardedOptimizer, ShardedGradients or
// FullySharded; --recompute recomputes each block in backward (activation checkpointing). On
// GPUs: bf16 autocast, fused AdamW on the shards, and FullySharded lends the blocks bf16 values
// gathered from fp32 shards (param_dtype; --fp32-gather: fp32). The parameters are made on the
// rank's device; once the DataParallel holds them in its shards, TorchModule hands their
// storage back to the device before the gradient shards are allocated. Rank 0 prints the loss, tokens/s
// and, at the end, the peak memory per GPU (libtorch's reserved peak during training — lockstep's
// block buffers come from its allocator — plus lockstep's shards and AdamW state), where rank 0's
// memory went, and the device memory in use at the end; the program exits 1 if the loss did not
// go down.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include <torch/torch.h>

#include <lockstep/lockstep.hpp>
#include <lockstep/torch.hpp>

#if defined(__CUDACC__) && defined(LOCKSTEP_WITH_CUDA)
#define LLAMA_GPU 1
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <lockstep/cuda.cuh>

#include "../03_gpt2_torch/gpu_trace.hpp"
#else
#define LLAMA_GPU 0
#endif

#include "../03_gpt2_torch/bench_util.hpp"
#include "../03_gpt2_torch/text_data.hpp"
#include "llama.hpp"

namespace {

struct options {
  std::string data = "/usr/share/games/fortunes", device = "auto";
  llama::Config model{.vocab = 32000, .context = 2048, .depth = 8, .heads = 32, .width = 4096, .ffn = 11008};
  std::int64_t batch = 1, seq = 2048, steps = 30, warmup = 5, log_every = 10;
  double lr = 3e-4;
  std::uint64_t seed = 42;
  int zero = 3;
  lockstep::BlockBuffers buffers{};  // ZeRO-2/3: --prefetch, --scatters
  bool recompute = false, fp32_gather = false;
  std::string profile;  // GPUs: a Chrome trace of steps [warmup, warmup + 3) on rank 0
};

constexpr std::int64_t profiled_steps = 3;

[[noreturn]] void usage(int rc) {
  std::printf("usage: llama_fsdp [--data DIR|FILE] [--device auto|cpu] [--depth N] [--width W] [--heads H] [--ffn F]\n"
              "                  [--vocab V] [--batch B] [--seq T] [--steps N] [--warmup N] [--lr X] [--seed S]\n"
              "                  [--log-every N] [--zero 0|1|2|3] [--recompute] [--fp32-gather]\n"
              "                  [--prefetch N] [--scatters N]   (ZeRO-2/3: blocks gathered ahead, reduce-scatters\n"
              "                                                  in flight; lockstep::BlockBuffers)\n"
              "                  [--profile TRACE.json]   (GPUs: rank 0's steps [warmup, warmup + 3))\n"
              "  defaults: the 7B family's width (4096, 32 heads, FFN 11008, vocabulary 32000) at depth 8,\n"
              "  1 x 2048 tokens per rank and step, FullySharded (--zero 3)\n");
  std::exit(rc);
}

options parse(int argc, char** argv) {
  options o;
  lockstep_bench::parse_args(argc, argv, "llama_fsdp", usage, [&o](const std::string& a, auto& next) {
    const auto num = [&] { return std::stoll(next()); };
    if (a == "--data") o.data = next();
    else if (a == "--device") o.device = next();
    else if (a == "--depth") o.model.depth = num();
    else if (a == "--width") o.model.width = num();
    else if (a == "--heads") o.model.heads = num();
    else if (a == "--ffn") o.model.ffn = num();
    else if (a == "--vocab") o.model.vocab = num();
    else if (a == "--batch") o.batch = num();
    else if (a == "--seq") o.seq = num();
    else if (a == "--steps") o.steps = num();
    else if (a == "--warmup") o.warmup = num();
    else if (a == "--lr") o.lr = std::stod(next());
    else if (a == "--seed") o.seed = std::stoull(next());
    else if (a == "--log-every") o.log_every = num();
    else if (a == "--zero") o.zero = static_cast<int>(num());
    else if (a == "--recompute") o.recompute = true;
    else if (a == "--fp32-gather") o.fp32_gather = true;
    else if (a == "--prefetch") o.buffers.prefetch = static_cast<int>(num());
    else if (a == "--scatters") o.buffers.scatters_in_flight = static_cast<int>(num());
    else if (a == "--profile") o.profile = next();
    else return false;
    return true;
  });
  const auto& m = o.model;
  if (m.depth < 1 || m.heads < 1 || m.width % m.heads != 0 || (m.width / m.heads) % 2 != 0 || m.vocab < 256 ||
      o.zero < 0 || o.zero > 3 || o.buffers.prefetch < 0 || o.buffers.scatters_in_flight < 1 || o.batch < 1 ||
      o.seq < 2 || o.steps <= o.warmup || o.log_every < 1 ||
      (!o.profile.empty() && o.steps < o.warmup + profiled_steps)) {
    std::fprintf(stderr, "llama_fsdp: need depth >= 1, width a multiple of heads with an even head size, vocab >= 256 "
                         "(byte tokens), --zero 0..3, --prefetch >= 0, --scatters >= 1, batch >= 1, seq >= 2, steps > "
                         "warmup (warmup + 3 with --profile), log-every >= 1\n");
    usage(2);
  }
  o.model.context = o.seq;
  return o;
}

std::mutex init_mutex;  // the model is built under one seed, one rank at a time

template <class Comm>
constexpr bool on_gpu() {
#if LLAMA_GPU
  return std::is_same_v<Comm, lockstep::NcclComm>;
#else
  return false;
#endif
}

}  // namespace

int main(int argc, char** argv) {
  const options opt = parse(argc, argv);
  if (!std::filesystem::exists(opt.data)) {
    std::fprintf(stderr,
                 "llama_fsdp: no text at %s; give --data DIR|FILE (Debian: apt-get install fortunes) [skipped]\n",
                 opt.data.c_str());
    return 77;
  }
  const gpt2::TextData text(opt.data);
  if (opt.device == "cpu") setenv("CUDA_VISIBLE_DEVICES", "", 1);  // run(Auto) then picks CPU ranks
  bool learned = true;
  try {
    lockstep::run(lockstep::Auto{}, [&](auto& ctx) {
      using Comm = std::remove_cvref_t<decltype(ctx.comm())>;
      constexpr bool gpu = on_gpu<Comm>();
      if constexpr (!gpu) torch::set_num_threads(1);
#if LLAMA_GPU
      std::optional<c10::cuda::CUDAGuard> device_guard;
      std::optional<c10::cuda::CUDAStreamGuard> stream_guard;
      if constexpr (gpu) {  // lockstep's compute stream is libtorch's current stream
        device_guard.emplace(static_cast<c10::DeviceIndex>(ctx.device()));
        stream_guard.emplace(
            c10::cuda::getStreamFromExternal(ctx.comm().compute_stream(), static_cast<c10::DeviceIndex>(ctx.device())));
        lockstep_bench::set_cuda_bf16_autocast(true);
      }
#endif
      const torch::Device dev =
          gpu ? torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(ctx.device())) : torch::Device(torch::kCPU);
      llama::Llama model(nullptr);
      {  // made on the device (the seed sets every device's generator: one rank at a time)
        std::lock_guard<std::mutex> lock(init_mutex);
        torch::manual_seed(opt.seed);
        auto config = opt.model;
        config.device = dev;
        model = llama::Llama(config);
      }
      lockstep::TorchModule tm(model);
      if (opt.zero >= 2)  // each transformer block a block; the rest (embeddings, norm, head) block 0
        tm.set_blocks(std::vector<std::shared_ptr<torch::nn::Module>>(model->blocks->begin(), model->blocks->end()));

      auto train = [&](auto& dp) {
        using DP = std::remove_cvref_t<decltype(dp)>;
        constexpr bool sharded = DP::sharded, blocked = DP::block_sharded;
        std::int64_t params = 0;
        for (const auto& p : dp.parameters()) params += static_cast<std::int64_t>(p.numel());
#if LLAMA_GPU
        if constexpr (gpu)  // the peak of training, not of building (TorchModule::storage_released emptied the cache)
          c10::cuda::CUDACachingAllocator::resetPeakStats(static_cast<c10::DeviceIndex>(ctx.device()));
#endif
        if (ctx.is_root())
          std::printf("llama_fsdp: %.1fM parameters (depth %lld, width %lld), %d rank(s) on %s, zero %d%s, %lld x %lld "
                      "tokens per rank and step\n",
                      static_cast<double>(params) / 1e6, static_cast<long long>(opt.model.depth),
                      static_cast<long long>(opt.model.width), ctx.size(), gpu ? "GPUs" : "CPU", opt.zero,
                      opt.recompute ? ", recomputed" : "", static_cast<long long>(opt.batch),
                      static_cast<long long>(opt.seq));
        const std::vector<lockstep::parameter>* stepped = &dp.parameters();
        if constexpr (sharded) stepped = &dp.shard_parameters();
        const lockstep::AdamWOptions adamw{.lr = opt.lr, .beta1 = 0.9, .beta2 = 0.95, .weight_decay = 0.1};
#if LLAMA_GPU
        std::optional<lockstep::FusedAdamW> gpu_opt;
        if constexpr (gpu) gpu_opt.emplace(adamw, *stepped, ctx.device());
#endif
        std::optional<lockstep::AdamW> host_opt;
        if constexpr (!gpu) host_opt.emplace(adamw);
        const auto step_shard = [&](std::span<const lockstep::param_slice> s) {
#if LLAMA_GPU
          if constexpr (gpu) return gpu_opt->step(s, ctx.comm().compute_stream(), nullptr);
#endif
          host_opt->step(s);
        };
        lockstep::TorchBlocks blocks;
        llama::run_fn run;
        if constexpr (blocked) {
          lockstep::shard_blocks(dp, blocks);
          run = blocks.function(opt.recompute);
        }
        const auto root = [&](lockstep::pass p) {  // block 0 spans the forward, then the backward
          if constexpr (blocked) return std::optional(dp.use_block(0, p));
          else return std::optional<int>();
        };
        const auto sync = [&] {
#if LLAMA_GPU
          if constexpr (gpu) LOCKSTEP_TRY_CUDA(cudaStreamSynchronize(ctx.comm().compute_stream()));
#endif
        };
        using clock = std::chrono::steady_clock;
        std::vector<double> step_ms;
        double first = 0, last = 0;
        auto t_log = clock::now();
        const bool profiling = gpu && !opt.profile.empty() && ctx.is_root();
        for (std::int64_t s = 0; s < opt.steps; ++s) {
#if LLAMA_GPU
          if (profiling && s == opt.warmup) {
            sync();
            lockstep_bench::start_gpu_trace();
          }
#endif
          const auto t0 = clock::now();
          auto rows = text.batch(opt.batch, opt.seq, opt.seed, s, ctx.rank()).to(dev);
          auto step = dp.step();
          torch::Tensor loss;
          {
            [[maybe_unused]] const auto held = root(lockstep::pass::forward);
            loss = model->loss(rows.narrow(1, 0, opt.seq), rows.narrow(1, 1, opt.seq), run);
            at::autocast::clear_cache();  // the next forward casts the updated weights anew
          }
          {
            [[maybe_unused]] const auto held = root(lockstep::pass::backward);
            tm.backward(loss, step.on_gradient_ready());
          }
          if constexpr (sharded) {
            step.finish(step_shard);
          } else if (step.finish()) {  // plain: every averaged gradient at once
#if LLAMA_GPU
            if constexpr (gpu) gpu_opt->step_all(dp.parameters(), ctx.comm().compute_stream());
#endif
            if constexpr (!gpu) host_opt->step(dp.parameters());
          }
          sync();
          step_ms.push_back(std::chrono::duration<double, std::milli>(clock::now() - t0).count());
#if LLAMA_GPU
          if (profiling && s + 1 == opt.warmup + profiled_steps)
            lockstep_bench::save_gpu_trace("llama_fsdp", opt.profile, profiled_steps);
#endif
          if (s % opt.log_every == 0 || s + 1 == opt.steps) {
            const double l = lockstep::mean_across_ranks(ctx.comm(), loss.template item<double>());
            if (s == 0) first = l;
            last = l;
            if (ctx.is_root()) {
              const double secs = std::chrono::duration<double>(clock::now() - t_log).count();
              const double done = s == 0 ? 1.0 : static_cast<double>(std::min<std::int64_t>(opt.log_every, s));
              std::printf("step %5lld  loss %.4f  %.0f tokens/s\n", static_cast<long long>(s), l,
                          done * static_cast<double>(opt.batch * opt.seq * ctx.size()) / secs);
              std::fflush(stdout);
              t_log = clock::now();
            }
          }
        }
        const double median = lockstep_bench::median_after_warmup(step_ms, opt.warmup);
        double peak[3] = {0, median, 0};  // GiB: peak (the most of any rank), step ms, in use at the end
#if LLAMA_GPU
        if constexpr (gpu) {  // libtorch's reserved peak (block buffers included), lockstep's shards, AdamW's state
          const auto st = c10::cuda::CUDACachingAllocator::getDeviceStats(static_cast<c10::DeviceIndex>(ctx.device()));
          const auto& ls = dp.stats();
          // ZeRO-3: the value shards; ZeRO-2: the whole values (block buffers and gradient shards are libtorch's)
          const double own = blocked ? static_cast<double>(ls.shard_bytes * (opt.zero == 3 ? 1 : ctx.size()))
                                     : static_cast<double>(ls.arena_bytes) * (sharded ? 2 : 1);
          const double gib = 1 << 30, state = static_cast<double>(gpu_opt->state_bytes());
          peak[0] = (static_cast<double>(st.reserved_bytes[0].peak) + own + state) / gib;
          std::size_t free = 0, total = 0;
          LOCKSTEP_TRY_CUDA(cudaMemGetInfo(&free, &total));
          peak[2] = static_cast<double>(total - free) / gib;
          if (ctx.is_root())  // where the memory goes (rank 0); the rest: CUDA context, NCCL, cuBLAS
            std::printf("llama_fsdp: memory of rank 0 in GiB: libtorch peak %.2f reserved / %.2f allocated (block "
                        "buffers %.2f at most), lockstep values %.2f, AdamW state %.2f; at the end %.2f in use, "
                        "%.2f reserved by libtorch, %.2f the rest\n",
                        static_cast<double>(st.reserved_bytes[0].peak) / gib,
                        static_cast<double>(st.allocated_bytes[0].peak) / gib, static_cast<double>(ls.lent_bytes) / gib,
                        own / gib, state / gib, peak[2], static_cast<double>(st.reserved_bytes[0].current) / gib,
                        peak[2] - (static_cast<double>(st.reserved_bytes[0].current) + own + state) / gib);
        }
#endif
        lockstep::detail::host_all_reduce(ctx.comm(), std::span<double>(peak), lockstep::reduce_op::max);
        if (ctx.is_root()) {
          std::printf("llama_fsdp: loss %.3f -> %.3f over %lld steps; median step %.1f ms, %.0f tokens/s", first, last,
                      static_cast<long long>(opt.steps), peak[1],
                      static_cast<double>(opt.batch * opt.seq * ctx.size()) / (peak[1] / 1e3));
          if (gpu) std::printf(", peak %.2f GiB per GPU, %.2f GiB in use at the end", peak[0], peak[2]);
          std::printf("\n");
          learned = last < first;
        }
      };
      switch (opt.zero) {
        case 3: {
          lockstep::FullySharded fs;
          fs.buffers = opt.buffers;
          if (gpu && !opt.fp32_gather) fs.param_dtype = lockstep::dtype::bf16;
          lockstep::DataParallel dp(ctx, tm, fs);
          return train(dp);
        }
        case 2: {
          lockstep::DataParallel dp(ctx, tm, lockstep::ShardedGradients{opt.buffers});
          return train(dp);
        }
        case 1: {
          lockstep::DataParallel dp(ctx, tm, lockstep::ShardedOptimizer{});
          return train(dp);
        }
        default: {
          lockstep::DataParallel dp(ctx, tm);
          return train(dp);
        }
      }
    });
  } catch (const std::exception& e) {
    std::fprintf(stderr, "llama_fsdp: %s\n", e.what());
    return 1;
  }
  if (!learned) {
    std::fprintf(stderr, "llama_fsdp: the loss did not go down\n");
    return 1;
  }
  return 0;
}
