// ResNet-50 (bench/resnet50/resnet.hpp, torchvision's architecture in libtorch's C++ frontend)
// trained data-parallel by lockstep on synthetic images: the C++ side of bench/resnet50_torch.sh,
// set beside the same model under PyTorch DDP (bench/resnet50_ddp.py). One body for every mode
// run(Auto) picks:
//
//   ./resnet50_torch --bench                         all local GPUs, one thread each (NcclComm)
//   lockstep-run --nproc 4 ./resnet50_torch --bench  one process per GPU (also torchrun --no-python)
//   ./resnet50_torch --device cpu --config tiny      CPU ranks (LOCKSTEP_CPU_RANKS, ThreadComm)
//
// On GPUs: bf16 autocast, channels_last images and conv weights (TorchModule keeps any
// dense layout; the weights' gradients are bound into lockstep's arena in it), cuDNN's
// autotuner on, lockstep's compute stream as libtorch's current stream, lockstep's FusedSgd
// (momentum 0.9, weight decay 1e-4) stepping each bucket as soon as it is averaged. On CPU
// ranks: fp32, torch::optim::SGD on the averaged gradients.
//
// Data: a pool of --pool batches per rank (normal images, uniform labels), made on the
// rank's device from the seed (and the rank) at start and cycled; nothing is read from disk.
//
// --bench prints one line on rank 0,
//   bench: lockstep-<threads|processes|cpu>[+flags] gpus=N step_ms=... images_per_s=... params=...
//          peak_alloc_gib=... reserved_gib=... used_gib=... loss_first=... loss_last=...
// step_ms: each rank's median step after the warm-up (synchronised host timing, as the GPT-2
// programs), the most of any rank; peak_alloc_gib: libtorch's caching allocator's peak plus what
// lockstep allocated outside it (the gradient arena, FusedSgd's state: DDP's buckets and
// optimizer state are in the allocator); reserved_gib: the allocator's reserved bytes at the
// end plus the same; used_gib: cudaMemGetInfo's used bytes at the end, everything included
// (NCCL too), the most of any GPU. [+flags] names the DataParallelOptions given on the command
// line (--bucket-cap-mb, --first-bucket-mb, --broadcast-buffers, --no-zero-copy).
// Without --bench: the loss must be finite and go down (exit 1 otherwise):
// "resnet50_torch: loss A -> B over N steps".
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include <torch/torch.h>

#include <lockstep/lockstep.hpp>
#include <lockstep/torch.hpp>

#if defined(__CUDACC__) && defined(LOCKSTEP_WITH_CUDA)
#define RESNET_GPU 1
#include <ATen/Context.h>
#include <ATen/autocast_mode.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <lockstep/cuda.cuh>

#include "bench_memory.hpp"  // examples/03_gpt2_torch: --memory-trace's line
#else
#define RESNET_GPU 0
#endif

#include "bench_util.hpp"  // examples/03_gpt2_torch: argument loop, median, bf16 autocast
#include "resnet50/resnet.hpp"

namespace {

struct options {
  std::string config = "full";
  std::string device = "auto";
  std::int64_t batch = 64;  // images per rank and step
  std::int64_t image = 224;
  std::int64_t steps = 30, warmup = 10;
  std::int64_t pool = 4;  // distinct batches per rank, cycled
  std::int64_t log_every = 10;
  double lr = 0.1;
  std::uint64_t seed = 42;
  bool bench = false;
  bool memory_trace = false;  // rank 0 prints the device memory in use after each phase of set-up
  // DataParallelOptions, set only when given (otherwise lockstep's defaults)
  std::optional<double> bucket_cap_mb, first_bucket_mb;
  std::optional<bool> broadcast_buffers;
  bool no_zero_copy = false;
};

[[noreturn]] void usage(int rc) {
  std::printf(
      "usage: resnet50_torch [--config full|tiny] [--device auto|cpu] [--batch B] [--image PX] [--steps N]\n"
      "                      [--warmup N] [--pool N] [--lr X] [--seed S] [--log-every N] [--bench]\n"
      "                      [--bucket-cap-mb X] [--first-bucket-mb X] [--broadcast-buffers on|off] [--no-zero-copy]\n"
      "                      [--memory-trace]\n"
      "  batch: images per rank and step; on GPUs: all local GPUs, or one per process under a launcher\n");
  std::exit(rc);
}

bool on_off(const std::string& v) {
  if (v == "on") return true;
  if (v == "off") return false;
  std::fprintf(stderr, "resnet50_torch: --broadcast-buffers %s: say on or off\n", v.c_str());
  usage(2);
}

options parse(int argc, char** argv) {
  options o;
  lockstep_bench::parse_args(argc, argv, "resnet50_torch", usage, [&o](const std::string& a, auto& next) {
    if (a == "--config") o.config = next();
    else if (a == "--device") o.device = next();
    else if (a == "--batch") o.batch = std::stoll(next());
    else if (a == "--image") o.image = std::stoll(next());
    else if (a == "--steps") o.steps = std::stoll(next());
    else if (a == "--warmup") o.warmup = std::stoll(next());
    else if (a == "--pool") o.pool = std::stoll(next());
    else if (a == "--lr") o.lr = std::stod(next());
    else if (a == "--seed") o.seed = std::stoull(next());
    else if (a == "--log-every") o.log_every = std::stoll(next());
    else if (a == "--bench") o.bench = true;
    else if (a == "--memory-trace") o.memory_trace = true;
    else if (a == "--bucket-cap-mb") o.bucket_cap_mb = std::stod(next());
    else if (a == "--first-bucket-mb") o.first_bucket_mb = std::stod(next());
    else if (a == "--broadcast-buffers") o.broadcast_buffers = on_off(next());
    else if (a == "--no-zero-copy") o.no_zero_copy = true;
    else return false;
    return true;
  });
  resnet::Config c;
  if (!resnet::config_named(o.config, c)) {
    std::fprintf(stderr, "resnet50_torch: --config %s: say full or tiny\n", o.config.c_str());
    usage(2);
  }
  if (o.device != "auto" && o.device != "cpu") {
    std::fprintf(stderr, "resnet50_torch: --device %s: say auto or cpu\n", o.device.c_str());
    usage(2);
  }
  const bool sizes_ok = o.batch >= 1 && o.image >= 32 && o.steps >= 1 && o.warmup >= 0 && o.warmup < o.steps &&
                        o.pool >= 1 && o.log_every >= 0;
  const bool mb_ok = (!o.bucket_cap_mb || *o.bucket_cap_mb > 0) && (!o.first_bucket_mb || *o.first_bucket_mb > 0);
  if (!sizes_ok || !mb_ok) {
    std::fprintf(stderr, "resnet50_torch: give batch >= 1, image >= 32, steps >= 1, 0 <= warmup < steps, pool >= 1 and "
                         "positive bucket sizes\n");
    usage(2);
  }
  return o;
}

//! The DataParallelOptions the command line asked for; the others are lockstep's defaults.
lockstep::DataParallelOptions dp_options(const options& o) {
  lockstep::DataParallelOptions d;
  const auto mib = [](double mb) { return static_cast<std::size_t>(mb * 1024.0 * 1024.0); };
  if (o.bucket_cap_mb) d.buckets.cap_bytes = mib(*o.bucket_cap_mb);
  if (o.first_bucket_mb) d.buckets.first_bytes = mib(*o.first_bucket_mb);
  if (o.broadcast_buffers) d.broadcast_buffers = *o.broadcast_buffers;
  if (o.no_zero_copy) d.zero_copy = false;
  return d;
}

//! "+bucket-cap-mb=50+broadcast-buffers=off..." for the options given: the bench line's label.
std::string flags_label(const options& o) {
  const auto mb = [](const char* name, double v) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "+%s=%g", name, v);
    return std::string(buf);
  };
  std::string s;
  if (o.bucket_cap_mb) s += mb("bucket-cap-mb", *o.bucket_cap_mb);
  if (o.first_bucket_mb) s += mb("first-bucket-mb", *o.first_bucket_mb);
  if (o.broadcast_buffers) s += *o.broadcast_buffers ? "+broadcast-buffers=on" : "+broadcast-buffers=off";
  if (o.no_zero_copy) s += "+no-zero-copy";
  return s;
}

std::mutex init_mutex;  // the model and the data are made under a seed, one rank at a time

template <class Comm>
constexpr bool on_gpu() {
#if RESNET_GPU
  return std::is_same_v<Comm, lockstep::NcclComm>;
#else
  return false;
#endif
}

}  // namespace

int main(int argc, char** argv) {
  const options opt = parse(argc, argv);
  resnet::Config cfg;
  (void)resnet::config_named(opt.config, cfg);
  if (opt.device == "cpu") setenv("CUDA_VISIBLE_DEVICES", "", 1);  // run(Auto) then picks CPU ranks
  const bool launched = lockstep::detect_launcher().has_value();   // one process per GPU
#if RESNET_GPU
  at::globalContext().setBenchmarkCuDNN(true);  // as torch.backends.cudnn.benchmark in the Python peer
#endif
  bool ok = true;
#if RESNET_GPU
  // --memory-trace on one process: libtorch's context on GPU 0 before lockstep's set-up (its
  // communicator, streams and events), to tell the two apart at the body's first mark.
  if (opt.memory_trace && !launched && opt.device != "cpu" && torch::cuda::is_available())
    lockstep_bench::print_device_memory("before lockstep::run", 0);
#endif

  try {
    lockstep::run(lockstep::Auto{}, [&](auto& ctx) {
      using Comm = std::remove_cvref_t<decltype(ctx.comm())>;
      constexpr bool gpu = on_gpu<Comm>();
      if constexpr (!gpu) torch::set_num_threads(1);
#if RESNET_GPU
      std::optional<c10::cuda::CUDAGuard> device_guard;
      std::optional<c10::cuda::CUDAStreamGuard> stream_guard;
      if constexpr (gpu) {
        device_guard.emplace(static_cast<c10::DeviceIndex>(ctx.device()));
        stream_guard.emplace(
            c10::cuda::getStreamFromExternal(ctx.comm().compute_stream(), static_cast<c10::DeviceIndex>(ctx.device())));
        lockstep_bench::set_cuda_bf16_autocast(true);
      }
#endif
      const torch::Device dev =
          gpu ? torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(ctx.device())) : torch::Device(torch::kCPU);
      // --memory-trace: where the device memory goes, phase by phase (rank 0; cudaMemGetInfo's
      // used bytes, everything included, and libtorch's reserved bytes).
      const auto mark = [&](const char* phase) {
#if RESNET_GPU
        if constexpr (gpu)
          if (opt.memory_trace && ctx.is_root()) lockstep_bench::print_device_memory(phase, ctx.device());
#endif
        (void)phase;
      };
      mark("body start (context, NCCL)");
      resnet::ResNet model(nullptr);
      std::vector<torch::Tensor> images, labels;
      {
        std::lock_guard<std::mutex> lock(init_mutex);
        torch::manual_seed(opt.seed);  // the same weights everywhere (rank 0's are broadcast anyway)
        model = resnet::ResNet(cfg);
        // The data: fresh per run from the seed, different on every rank, made on its device.
        torch::manual_seed(opt.seed + 1 + static_cast<std::uint64_t>(ctx.rank()));
        const auto fopts = torch::TensorOptions().dtype(torch::kFloat).device(dev);
        const auto lopts = torch::TensorOptions().dtype(torch::kLong).device(dev);
        for (std::int64_t i = 0; i < opt.pool; ++i) {
          auto x = torch::randn({opt.batch, 3, opt.image, opt.image}, fopts);
          images.push_back(gpu ? x.contiguous(torch::MemoryFormat::ChannelsLast) : x);
          labels.push_back(torch::randint(cfg.classes, {opt.batch}, lopts));
        }
      }
      model->to(dev);
      if (gpu) {  // conv weights channels_last too, as the images (what DDP's peer does)
        torch::NoGradGuard no_grad;
        for (auto& p : model->parameters())
          if (p.dim() == 4) p.set_data(p.contiguous(torch::MemoryFormat::ChannelsLast));
      }
      const std::int64_t params = model->parameter_count();
      if (opt.config == "full" && params != resnet::resnet50_parameters)
        throw std::runtime_error("ResNet-50 has " + std::to_string(params) + " parameters, torchvision's " +
                                 std::to_string(resnet::resnet50_parameters));
      if (ctx.is_root())
        std::printf("resnet50_torch: %s, %lld parameters, %d rank(s) on %s, %lld images of %lld x %lld "
                    "per rank and step\n",
                    opt.config.c_str(), static_cast<long long>(params), ctx.size(), gpu ? "GPUs" : "CPU",
                    static_cast<long long>(opt.batch), static_cast<long long>(opt.image),
                    static_cast<long long>(opt.image));

      mark("model and data on the GPU");
      lockstep::TorchModule tm(model);
      mark("TorchModule (grads)");
      lockstep::DataParallel dp(ctx, tm, dp_options(opt));
      mark("DataParallel");
      const lockstep::SgdOptions sgd{.lr = opt.lr, .momentum = 0.9, .weight_decay = 1e-4};
#if RESNET_GPU
      std::optional<lockstep::FusedSgd> gpu_opt;
      if constexpr (gpu) gpu_opt.emplace(sgd, dp.parameters(), ctx.device());
#endif
      std::optional<torch::optim::SGD> cpu_opt;  // CPU ranks: torch::optim on the averaged .grad
      if constexpr (!gpu)
        cpu_opt.emplace(tm.tensors(),
                        torch::optim::SGDOptions(sgd.lr).momentum(sgd.momentum).weight_decay(sgd.weight_decay));

      auto sync = [&] {
#if RESNET_GPU
        if constexpr (gpu) LOCKSTEP_TRY_CUDA(cudaStreamSynchronize(ctx.comm().compute_stream()));
#endif
      };
      using clock = std::chrono::steady_clock;
      std::vector<double> step_ms;
      double first_loss = 0, last_loss = 0;
      for (std::int64_t s = 0; s < opt.steps; ++s) {
        const auto t0 = clock::now();
        const auto k = static_cast<std::size_t>(s % opt.pool);
        auto step = dp.step();
        auto loss = torch::nn::functional::cross_entropy(model->forward(images[k]).to(torch::kFloat), labels[k]);
        tm.backward(loss, step.on_gradient_ready());
#if RESNET_GPU
        if constexpr (gpu) {
          at::autocast::clear_cache();
          cudaStream_t stream = ctx.comm().compute_stream();
          (void)step.finish([&](std::span<const lockstep::param_slice> b) { gpu_opt->step(b, stream, nullptr); });
        }
#endif
        if constexpr (!gpu) {
          if (step.finish()) cpu_opt->step();
        }
        // The same steps on every rank (the loss is averaged across them).
        const bool record = s == 0 || s + 1 == opt.steps || (!opt.bench && opt.log_every > 0 && s % opt.log_every == 0);
        if (opt.bench || record) sync();
        step_ms.push_back(std::chrono::duration<double, std::milli>(clock::now() - t0).count());
        if (s < 2) mark(s == 0 ? "after step 1" : "after step 2 (bound)");
        if (record) {
          const double l = lockstep::mean_across_ranks(ctx.comm(), loss.template item<double>());
          if (s == 0) first_loss = l;
          last_loss = l;
          if (ctx.is_root() && !opt.bench) {
            std::printf("step %5lld  loss %.4f  %.1f ms\n", static_cast<long long>(s), l, step_ms.back());
            std::fflush(stdout);
          }
        }
      }

      mark("end");
      if (opt.bench) {
        const double median = lockstep_bench::median_after_warmup(step_ms, opt.warmup);
        double own = 0, peak = 0, reserved = 0, used = 0;  // bytes
#if RESNET_GPU
        if constexpr (gpu) {
          // What lockstep allocated itself, outside libtorch's allocator: the gradient arena and
          // the optimizer's state (DDP has both in the allocator: buckets and SGD's momentum).
          own = static_cast<double>(dp.stats().arena_bytes) + static_cast<double>(gpu_opt->state_bytes());
          const auto index = static_cast<c10::DeviceIndex>(ctx.device());
          const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(index);
          peak = static_cast<double>(stats.allocated_bytes[0].peak) + own;
          reserved = static_cast<double>(stats.reserved_bytes[0].current) + own;
          std::size_t free = 0, total = 0;
          LOCKSTEP_TRY_CUDA(cudaMemGetInfo(&free, &total));
          used = static_cast<double>(total - free);
        }
#endif
        double worst[5] = {median, peak, reserved, used, own};
        lockstep::detail::host_all_reduce(ctx.comm(), std::span<double>(worst), lockstep::reduce_op::max);
        constexpr double gib = 1024.0 * 1024.0 * 1024.0;
        if (ctx.is_root()) {
          const std::string label =
              std::string("lockstep-") + (gpu ? (launched ? "processes" : "threads") : "cpu") + flags_label(opt);
          std::printf(
              "bench: %s gpus=%d step_ms=%.2f images_per_s=%.0f params=%lld peak_alloc_gib=%.2f reserved_gib=%.2f "
              "used_gib=%.2f loss_first=%.3f loss_last=%.3f\n",
              label.c_str(), ctx.size(), worst[0], static_cast<double>(opt.batch * ctx.size()) / (worst[0] / 1e3),
              static_cast<long long>(params), worst[1] / gib, worst[2] / gib, worst[3] / gib, first_loss, last_loss);
          if (gpu)
            std::printf("bench-memory: %s lockstep_own_gib=%.2f (gradient arena + FusedSgd state, outside libtorch's "
                        "allocator, included in peak_alloc_gib and reserved_gib)\n",
                        label.c_str(), worst[4] / gib);
          std::fflush(stdout);
        }
      } else if (ctx.is_root()) {
        std::printf("resnet50_torch: loss %.3f -> %.3f over %lld steps\n", first_loss, last_loss,
                    static_cast<long long>(opt.steps));
      }
      // Finite always; going down too when training (a bench run's losses are only reported).
      if (ctx.is_root())
        ok = std::isfinite(first_loss) && std::isfinite(last_loss) && (opt.bench || last_loss < first_loss);
    });
  } catch (const std::exception& e) {
    std::fprintf(stderr, "resnet50_torch: %s\n", e.what());
    return 1;
  }
  if (!ok) {
    std::fprintf(stderr, "resnet50_torch: the loss is not finite%s\n", opt.bench ? "" : " or did not go down");
    return 1;
  }
  return 0;
}
