// GPT-2 small, written with libtorch's C++ frontend (gpt2.hpp), trained data-parallel by
// lockstep on real text (the bytes of Debian's fortune cookies by default). One body for
// every mode run(Auto) picks:
//
//   ./gpt2_torch                               all local GPUs, one thread each (NcclComm)
//   lockstep-run --nproc 4 ./gpt2_torch        one process per GPU (also torchrun --no-python)
//   ./gpt2_torch --device cpu --config tiny    CPU ranks (LOCKSTEP_CPU_RANKS, ThreadComm)
//
// On GPUs: bf16 autocast, lockstep's compute stream as libtorch's current stream, the fused
// AdamW of lockstep stepping each bucket as soon as it is averaged. On CPU ranks:
// torch::optim::AdamW on the averaged gradients. --shard: ShardedOptimizer (each rank's AdamW
// steps 1/N of the parameters, kept in lockstep's arena) with the all-gather waited for block
// by block in the next forward (gather_in_forward); on CPU ranks lockstep's host AdamW. --zero 2|3:
// ShardedGradients / FullySharded, each transformer block a block (TorchBlocks), --recompute
// recomputing each block in backward (activation checkpointing). Rank 0 prints the loss and tokens/s;
// --bench prints one line "bench: ..." with the median step time, tokens/s and peak memory
// (bench/gpt2_torch.sh runs it beside PyTorch DDP, bench/gpt2_ddp.py); --profile FILE writes
// a Chrome trace (libtorch's Kineto profiler) of three steps after the warm-up, for
// bench/kernel_profile.py to set beside the same trace of bench/gpt2_ddp.py.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include <torch/torch.h>
#include <torch/version.h>

#include <lockstep/lockstep.hpp>
#include <lockstep/torch.hpp>

#if defined(__CUDACC__) && defined(LOCKSTEP_WITH_CUDA)
#define GPT2_GPU 1
#include <ATen/autocast_mode.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <lockstep/cuda.cuh>

#include "bench_memory.hpp"
#include "gpu_trace.hpp"
#else
#define GPT2_GPU 0
#endif

#include "bench_common.hpp"  // with gpt2.hpp
#include "options.hpp"
#include "text_data.hpp"

namespace {

using gpt2::graph_warmup;
using gpt2::options;
using gpt2::profiled_steps;

std::mutex init_mutex;  // the model is built under one seed, one rank at a time

template <class Comm>
constexpr bool on_gpu() {
#if GPT2_GPU
  return std::is_same_v<Comm, lockstep::NcclComm>;
#else
  return false;
#endif
}

}  // namespace

int main(int argc, char** argv) {
  const options opt = gpt2::parse(argc, argv);
  if (!std::filesystem::exists(opt.data)) {
    std::fprintf(stderr,
                 "gpt2_torch: no text at %s; give --data DIR|FILE (Debian: apt-get install fortunes) [skipped]\n",
                 opt.data.c_str());
    return 77;
  }
  const gpt2::TextData text(opt.data);
  bool learned = true;
  const gpt2::Config cfg = gpt2::config_named(opt.config, opt.seq);
  if (opt.device == "cpu") setenv("CUDA_VISIBLE_DEVICES", "", 1);  // run(Auto) then picks CPU ranks
  // The model's own kernels deterministic (--deterministic, --torch-deterministic; docs/determinism.md).
  if (opt.torch_deterministic) {
    setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8", 0);
    at::globalContext().setDeterministicAlgorithms(true, false);
    at::globalContext().setDeterministicCuDNN(true);
    at::globalContext().setBenchmarkCuDNN(false);
  }

  try {
    lockstep::run(lockstep::Auto{}, [&](auto& ctx) {
      using Comm = std::remove_cvref_t<decltype(ctx.comm())>;
      constexpr bool gpu = on_gpu<Comm>();
      if constexpr (!gpu) torch::set_num_threads(1);
#if GPT2_GPU
      std::optional<c10::cuda::CUDAGuard> device_guard;
      std::optional<c10::cuda::CUDAStreamGuard> stream_guard;
      if constexpr (gpu) {
        device_guard.emplace(static_cast<c10::DeviceIndex>(ctx.device()));
        stream_guard.emplace(
            c10::cuda::getStreamFromExternal(ctx.comm().compute_stream(), static_cast<c10::DeviceIndex>(ctx.device())));
        gpt2::set_cuda_bf16_autocast(true);
      }
#endif
      const torch::Device dev =
          gpu ? torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(ctx.device())) : torch::Device(torch::kCPU);
      const auto mark = [&](const char* phase) {  // --memory-trace
#if GPT2_GPU
        if constexpr (gpu)
          if (opt.memory_trace && ctx.is_root()) lockstep_bench::print_device_memory(phase, ctx.device());
#endif
        (void)phase;
      };
      mark("body start (context, NCCL)");
      gpt2::Gpt model(nullptr);
      {
        std::lock_guard<std::mutex> lock(init_mutex);
        torch::manual_seed(opt.seed);
        model = gpt2::Gpt(cfg);
      }
      model->to(dev);
      mark("model on the device");
      lockstep::TorchModule tm(model);
      if (opt.zero)  // full sharding: each transformer block is a block; the rest is block 0
        tm.set_blocks(std::vector<std::shared_ptr<torch::nn::Module>>(model->blocks->begin(), model->blocks->end()));
      mark("TorchModule (its gradients)");
      const lockstep::DataParallelOptions dp_options = [&] {
        lockstep::DataParallelOptions o;
        if (opt.bucket_mib > 0)
          o.buckets.first_bytes = o.buckets.cap_bytes = static_cast<std::size_t>(opt.bucket_mib) << 20;
        o.buckets.tune = opt.tune;
        return o;
      }();
      // --deterministic Q: each rank's Q / N micro-batches of a step, accumulated.
      if (opt.deterministic % ctx.size() != 0)
        throw lockstep::config_error("--deterministic " + std::to_string(opt.deterministic) +
                                     " micro-batches do not split over " + std::to_string(ctx.size()) +
                                     " ranks; give a multiple of the rank count");
      const std::int64_t micro_steps = opt.deterministic > 0 ? opt.deterministic / ctx.size() : 1;
      const lockstep::ShardedOptimizer sharding{.gather_in_forward = true,
                                                .bind_values = !opt.pack_values,
                                                .copy_engine_gather = opt.ce_gather,
                                                .copy_engine_scatter = opt.ce_scatter,
                                                .gather_wire = lockstep::wire_format_of(opt.gather_wire),
                                                .gather_deltas = !opt.gather_values};
      const lockstep::AnyWire wire(lockstep::wire_format_of(opt.wire), {.error_feedback = opt.wire_feedback});
      // One body for both: ShardedOptimizer is a policy, so the DataParallel's type differs.
      auto train = [&](auto& dp) {
        using DP = std::remove_cvref_t<decltype(dp)>;
        constexpr bool sharded = DP::sharded, blocked = DP::block_sharded;

        std::int64_t params = 0;
        for (const auto& p : dp.parameters()) params += static_cast<std::int64_t>(p.numel());  // held or not
        if (ctx.is_root())
          std::printf(
              "gpt2_torch: %lld parameters, %d rank(s) on %s, %lld x %lld tokens per rank and micro-step, %zu bytes "
              "of text\n",
              static_cast<long long>(params), ctx.size(), gpu ? "GPUs" : "CPU", static_cast<long long>(opt.batch),
              static_cast<long long>(opt.seq), text.size());

        const lockstep::AdamWOptions adamw{.lr = opt.lr, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1};
        // Sharded, the optimizers step this rank's shards, and the forward waits for each block's
        // all-gather just before using it.
        const std::vector<lockstep::parameter>* stepped = &dp.parameters();
        if constexpr (sharded) stepped = &dp.shard_parameters();
        // [snippet docs/sharding.md#7]
        gpt2::before_fn before;
        if constexpr (sharded && !blocked)
          before = [&](torch::nn::Module& sub) {
            for (auto i : tm.indices_of(sub)) dp.wait_parameters(i);
          };
        // [end snippet]
        lockstep::TorchBlocks blocks;  // --zero: the forward runs each transformer block through it
        gpt2::run_fn run;
        if constexpr (blocked) {
          lockstep::shard_blocks(dp, blocks);
          run = blocks.function(opt.recompute);
        }
        // Block 0 (embeddings, final LayerNorm, head) is used around the whole forward and backward.
        const auto root = [&](lockstep::pass p) {
          if constexpr (blocked) return std::optional(dp.use_block(0, p));
          else return std::optional<int>();
        };
#if GPT2_GPU
        using fused = lockstep::FusedAdamW;
        std::optional<fused> gpu_opt;
        if constexpr (gpu) gpu_opt.emplace(adamw, *stepped, ctx.device());
#endif
        std::optional<torch::optim::AdamW> cpu_opt;  // unsharded on CPU ranks: torch::optim on the averaged .grad
        std::optional<lockstep::AdamW> host_opt;     // sharded on CPU ranks: lockstep's, on the shards
        if constexpr (!gpu && !sharded)
          cpu_opt.emplace(tm.tensors(), torch::optim::AdamWOptions(opt.lr).betas({0.9, 0.95}).weight_decay(0.1));
        if constexpr (!gpu && sharded) host_opt.emplace(adamw);
        // --peer-copy K: what an elastic job keeps to survive a lost rank (docs/elastic.md).
        lockstep::PeerCopy copies({.every = std::max<std::int64_t>(1, opt.peer_copy)});
        const auto members = lockstep::membership::whole(ctx.size(), ctx.rank());
        mark("DataParallel, optimizer");

        auto sync = [&] {
#if GPT2_GPU
          if constexpr (gpu) LOCKSTEP_TRY_CUDA(cudaStreamSynchronize(ctx.comm().compute_stream()));
#endif
        };
        using clock = std::chrono::steady_clock;
        std::vector<double> step_ms;
        auto t_log = clock::now();
        double first_loss = 0, last_loss = 0;
        const bool profiling = gpu && !opt.profile.empty() && ctx.is_root();
        if (opt.cuda_graph && !gpu) throw lockstep::config_error("--cuda-graph needs GPUs (this run has CPU ranks)");
        // The batch lives at one address (a captured step reads it there); the loss too.
        torch::Tensor rows = torch::empty({opt.batch, opt.seq + 1}, torch::TensorOptions(torch::kLong).device(dev));
        torch::Tensor loss;
        auto one_step = [&] {
          auto x = rows.narrow(1, 0, opt.seq), y = rows.narrow(1, 1, opt.seq);
          auto step = dp.step();
          {
            [[maybe_unused]] const auto held = root(lockstep::pass::forward);
            // [snippet docs/sharding.md#7]
            loss = model->loss(x, y, before, run);
            // [end snippet]
          }
          {
            [[maybe_unused]] const auto held = root(lockstep::pass::backward);
            tm.backward(loss, step.on_gradient_ready());
          }
#if GPT2_GPU
          if constexpr (gpu) {
            at::autocast::clear_cache();
            cudaStream_t stream = ctx.comm().compute_stream();
            step.finish([&](std::span<const lockstep::param_slice> b) { gpu_opt->step(b, stream, nullptr); });
          }
#endif
          if constexpr (!gpu && sharded)
            step.finish([&](std::span<const lockstep::param_slice> b) { host_opt->step(b); });
          if constexpr (!gpu && !sharded)
            if (step.finish()) cpu_opt->step();  // the last micro-step's: the averaged gradients
        };
#if GPT2_GPU
        std::optional<at::cuda::CUDAGraph> graph;  // --cuda-graph: the captured step
#endif
        for (std::int64_t s = 0; s < opt.steps; ++s) {
#if GPT2_GPU
          if (profiling && s == opt.warmup) {
            sync();
            lockstep_bench::start_gpu_trace();
          }
#endif
          const auto t0 = clock::now();
          // Micro-batch j of step s: windows drawn from (seed, s, j); rank r takes j = r, r + N, ...
          // earlier_losses: the step's micro-steps before the last (their mean is the step's loss).
          torch::Tensor earlier_losses;
          for (std::int64_t k = 0; k + 1 < micro_steps; ++k) {
            rows.copy_(text.batch(opt.batch, opt.seq, opt.seed, s, static_cast<int>(k * ctx.size() + ctx.rank())),
                       /*non_blocking=*/true);
            one_step();
            earlier_losses = k == 0 ? loss.detach().clone() : earlier_losses + loss.detach();
          }
          rows.copy_(text.batch(opt.batch, opt.seq, opt.seed, s,
                                static_cast<int>((micro_steps - 1) * ctx.size() + ctx.rank())),
                     /*non_blocking=*/true);
          if (!opt.cuda_graph || s < graph_warmup + (opt.tune ? dp_options.buckets.tune_step - 1 : 0)) {
            one_step();
          } else {
#if GPT2_GPU
            if constexpr (gpu) {
              if (!graph) {
                // Thread-local: libtorch's autograd threads run lockstep's hooks beside this one, and
                // under run(Gpus) the other ranks' threads capture at the same time.
                const lockstep::CaptureScope no_allocations;  // lockstep's, that is; libtorch's go to the graph's pool
                LOCKSTEP_TRY_CUDA(cudaDeviceSynchronize());   // earlier steps' gathers cannot join the graph
                graph.emplace();
                graph->capture_begin({0, 0}, cudaStreamCaptureModeThreadLocal);
                try {
                  one_step();
                } catch (...) {
                  // End the broken capture and libtorch's allocation to the graph's pool; the
                  // step's error is the one to report.
                  try {
                    graph->capture_end();
                  } catch (...) {
                  }
                  graph.reset();
                  throw;
                }
                graph->capture_end();
              }
              ctx.comm().tracked_launch("the captured GPT-2 step", [&] { graph->replay(); });
            }
#endif
          }
          if constexpr (sharded && !blocked)
            if (opt.peer_copy > 0) {
#if GPT2_GPU
              if constexpr (gpu) copies.save(s + 1, members, dp, *gpu_opt);
#endif
              if constexpr (!gpu) copies.save(s + 1, members, dp, *host_opt);
            }
          const bool log = s % opt.log_every == 0 || s + 1 == opt.steps;  // the same on every rank
          if (opt.bench || log || profiling) sync();
          step_ms.push_back(std::chrono::duration<double, std::milli>(clock::now() - t0).count());
          if (s == 0) mark("after step 1");
#if GPT2_GPU
          if (profiling && s + 1 == opt.warmup + profiled_steps)
            lockstep_bench::save_gpu_trace("gpt2_torch", opt.profile, profiled_steps);
#endif
          if (log) {
            const double mine = micro_steps == 1
                                    ? loss.template item<double>()
                                    : (earlier_losses + loss.detach()).template item<double>() / micro_steps;
            const double l = lockstep::mean_across_ranks(ctx.comm(), mine);
            if (s == 0) first_loss = l;
            last_loss = l;
            if (ctx.is_root()) {
              const double secs = std::chrono::duration<double>(clock::now() - t_log).count();
              const double steps_done = s == 0 ? 1.0 : static_cast<double>(std::min<std::int64_t>(opt.log_every, s));
              std::printf("step %5lld  loss %.4f  %.0f tokens/s\n", static_cast<long long>(s), l,
                          steps_done * static_cast<double>(opt.batch * opt.seq * ctx.size() * micro_steps) / secs);
              std::fflush(stdout);
              t_log = clock::now();
            }
          }
        }
        mark("end");
        if (opt.bench) {
          const double median = gpt2::median_after_warmup(step_ms, opt.warmup);
          double peak_gib = 0;
#if GPT2_GPU
          if constexpr (gpu) {
            // libtorch's allocator (activations, weights) plus what lockstep allocated itself:
            // the gradient arena, sharded the value arena the weights moved into, and the
            // optimizer's state.
            const auto stats =
                c10::cuda::CUDACachingAllocator::getDeviceStats(static_cast<c10::DeviceIndex>(ctx.device()));
            const auto& st = dp.stats();
            // Full sharding: the value shards (ZeRO-3) or whole values (ZeRO-2, as large as the
            // gradients unsharded); its block buffers and gradient shards are libtorch's.
            const double arenas = blocked ? static_cast<double>(st.shard_bytes * (opt.zero == 3 ? 1 : dp.size()))
                                          : static_cast<double>(st.arena_bytes) * (sharded ? 2 : 1);
            peak_gib = (static_cast<double>(stats.allocated_bytes[0].peak) + arenas +
                        static_cast<double>(gpu_opt->state_bytes())) /
                       (1 << 30);
          }
#endif
          double used_gib = 0;  // everything on the GPU: NCCL's communicators and windows, libtorch's cache
#if GPT2_GPU
          if constexpr (gpu) {
            std::size_t free = 0, total = 0;
            LOCKSTEP_TRY_CUDA(cudaMemGetInfo(&free, &total));
            used_gib = static_cast<double>(total - free) / (1 << 30);
          }
#endif
          double worst[4] = {median, peak_gib, used_gib, gpt2::mean_after_warmup(step_ms, opt.warmup)};
          lockstep::detail::host_all_reduce(ctx.comm(), std::span<double>(worst), lockstep::reduce_op::max);
          const double peak = worst[1];
          if (ctx.is_root())
            gpt2::print_bench_line(std::string("lockstep") + (opt.wire != "fp32" ? "-" + opt.wire + "wire" : "") +
                                       (opt.gather_wire != "fp32" ? "-" + opt.gather_wire + "gather" : "") +
                                       (sharded && !blocked ? "-sharded" : "") +
                                       (blocked ? "-zero" + std::to_string(opt.zero) : std::string()) +
                                       (blocked && opt.recompute ? "-recompute" : "") +
                                       (sharded && !dp.stats().values_bound ? "-packed" : "") +
                                       (sharded && dp.stats().gathers_by_copy_engine ? "-cegather" : "") +
                                       (sharded && dp.stats().scatters_by_copy_engine ? "-cescatter" : "") +
                                       (opt.cuda_graph ? "-graph" : "") +
                                       (opt.peer_copy > 0 ? "-peercopy" + std::to_string(opt.peer_copy) : "") +
                                       (opt.deterministic         ? "-deterministic"
                                        : opt.torch_deterministic ? "-torchdeterministic"
                                                                  : ""),
                                   ctx.size(), worst[0], opt.batch * opt.seq * ctx.size() * micro_steps, peak,
                                   first_loss, last_loss);
          if (ctx.is_root() && opt.tune)
            std::printf("bench-tuning: %s\n",
                        dp.stats().tuning.empty() ? "not tuned (one rank, or CPU ranks)" : dp.stats().tuning.c_str());
          if (ctx.is_root() && gpu)
            std::printf("bench-memory: device_used_gib=%.2f (cudaMemGetInfo at the end, the most of any GPU)\n",
                        worst[2]);
          if (ctx.is_root())
            std::printf("bench-mean: step_ms=%.2f (the mean after warm-up, the slowest rank's)\n", worst[3]);
          if (ctx.is_root() && opt.peer_copy > 0)
            std::printf("bench-peercopy: rank 0 holds %.3f GiB of snapshots\n",
                        static_cast<double>(copies.bytes()) / (1 << 30));
        } else if (ctx.is_root()) {
          std::printf("gpt2_torch: loss %.3f -> %.3f over %lld steps\n", first_loss, last_loss,
                      static_cast<long long>(opt.steps));
        }
        // The parameters' checksum (to compare runs; with --zero the module holds no whole values).
        if constexpr (!blocked) {
          if constexpr (sharded) dp.wait_all_parameters();  // the last step's gathers
          const std::uint64_t sum = gpt2::parameter_checksum(*model);
          if (ctx.is_root())
            std::printf("gpt2_torch: parameters fnv1a 0x%016llx\n", static_cast<unsigned long long>(sum));
        }
        if (ctx.is_root()) learned = last_loss < first_loss;
      };
      if (opt.zero == 2) {
        lockstep::ShardedGradients sg;
        sg.buffers.keep_gradient_shards = opt.keep_grads;
        lockstep::DataParallel dp(ctx, tm, dp_options, wire, sg);
        train(dp);
      } else if (opt.zero == 3) {
        lockstep::FullySharded fs;  // on GPUs (bf16 autocast) the blocks get bf16 values gathered from fp32 shards
        if (gpu) fs.param_dtype = lockstep::dtype::bf16;
        fs.buffers.keep_gradient_shards = opt.keep_grads;
        fs.buffers.prefetch = opt.prefetch;
        fs.gather_wire = lockstep::wire_format_of(opt.gather_wire);
        lockstep::DataParallel dp(ctx, tm, dp_options, wire, fs);
        train(dp);
      } else if (opt.deterministic > 0) {  // fixed-point sums over Accumulate<>(micro_steps)
        const lockstep::Accumulate<> acc(static_cast<int>(micro_steps));
        if (opt.shard) {
          lockstep::DataParallel dp(ctx, tm, dp_options, lockstep::Deterministic{}, acc, sharding);
          train(dp);
        } else {
          lockstep::DataParallel dp(ctx, tm, dp_options, lockstep::Deterministic{}, acc);
          train(dp);
        }
      } else if (opt.shard) {
        lockstep::DataParallel dp(ctx, tm, dp_options, wire, sharding);
        train(dp);
      } else {
        lockstep::DataParallel dp(ctx, tm, dp_options, wire);
        train(dp);
      }
    });
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gpt2_torch: %s\n", e.what());
    return 1;
  }
  if (!learned) {
    std::fprintf(stderr, "gpt2_torch: the loss did not go down\n");
    return 1;
  }
  return 0;
}
