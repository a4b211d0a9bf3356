// libtorch's own multi-GPU path, torch::nn::parallel::data_parallel, training the GPT-2 of
// examples/03_gpt2_torch (gpt2.hpp): the reference row beside lockstep and PyTorch DDP in
// bench/gpt2_torch.sh (issue 12; pytorch/pytorch#40581). The same text, model, bf16 autocast and
// AdamW (0.9, 0.95, eps 1e-8, wd 0.1) as the example; --batch is per GPU, the global batch N x it.
//
// Each step, data_parallel scatters the global batch from GPU 0 over the N visible GPUs, clones
// the model onto each of them (Cloneable::clone: the module is built anew on the CPU, with its
// initialisation, and its parameters are copied from GPU 0), runs the replicas' forward passes
// (at::parallel_for: on OpenMP threads, this file being compiled with OpenMP) and gathers the
// logits onto GPU 0. The loss is computed there; backward sums each parameter's gradients from
// the replicas into the one model on GPU 0, where torch::optim::AdamW steps.
//
//   gpt2_data_parallel [--data DIR|FILE] [--config small|tiny] [--batch B] [--seq T] [--steps N]
//                      [--warmup N] [--lr X] [--seed S] [--gpus N] [--threads N]
//
// Prints "bench: libtorch-data_parallel gpus=N step_ms=... tokens_per_s=... peak_gib=...
// loss_first=... loss_last=..." as the example's --bench does (median step after the warm-up,
// every step synchronised; peak: the most libtorch allocated on any one GPU), and, for N > 1,
// what replicating the model alone costs. Exits 77 where no CUDA device is visible
// (data_parallel runs on CUDA devices only) or the text is missing, 1 on a non-finite loss.
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include <c10/core/DeviceGuard.h>
#include <torch/cuda.h>
#include <torch/torch.h>

// libtorch built with CUDA (CMake: LOCKSTEP_TORCH_CUDA). data_parallel.h includes libtorch's CUDA
// headers (torch/csrc/autograd/functions/comm.h), which a CPU-only libtorch (Debian's 1.13) ships
// incomplete: there the program only says it is skipped.
#if defined(GPT2_DP_TORCH_CUDA)
#include <c10/cuda/CUDACachingAllocator.h>
#include <torch/nn/parallel/data_parallel.h>
#endif

#include "bench_common.hpp"  // examples/03_gpt2_torch: with gpt2.hpp
#include "text_data.hpp"

namespace {

struct options : gpt2::run_options {
  std::int64_t gpus = 0, threads = 0;
};

[[noreturn]] void usage(int rc) {
  std::printf("usage: gpt2_data_parallel [--data DIR|FILE] [--config small|tiny] [--batch B] [--seq T] [--steps N]\n"
              "                          [--warmup N] [--lr X] [--seed S] [--gpus N] [--threads N]\n"
              "  batch: sequences per GPU and step; gpus: the first N visible GPUs (default: all);\n"
              "  threads: libtorch's intra-op threads (1: the replicas run one after another on the main thread)\n");
  std::exit(rc);
}

options parse(int argc, char** argv) {
  options o;
  o.parse(argc, argv, "gpt2_data_parallel", usage, [&o](const std::string& a, auto& next) {
    if (a == "--gpus") o.gpus = std::stoll(next());
    else if (a == "--threads") o.threads = std::stoll(next());
    else if (a == "--bench") {
    }  // always: accepted for the example's command lines
    else
      return false;
    return true;
  });
  if (o.gpus < 0 || o.threads < 0) usage(2);
  return o;
}

// What data_parallel replicates and runs: the model, plus what Python's parallel_apply sets up in
// each of its threads and libtorch's C++ parallel_apply does not. That one runs the replicas'
// forward passes through at::parallel_for, on OpenMP threads where autocast starts off (and at
// fp16), and leaves the current device alone; so each forward turns bf16 autocast on and makes
// its replica's GPU current (Python enters the caller's autocast and torch.cuda.device). clone(),
// which data_parallel's replicate calls, clones the model (gpt2.hpp's modules are Cloneable).
struct ReplicaImpl : torch::nn::Module {
  explicit ReplicaImpl(gpt2::Gpt m) : model(register_module("model", std::move(m))) {}

  torch::Tensor forward(const torch::Tensor& idx) {
    const c10::DeviceGuard on_device(idx.device());
    const gpt2::CudaBf16Autocast autocast;
    return model->forward(idx);
  }

  std::shared_ptr<torch::nn::Module> clone(
      const torch::optional<torch::Device>& device = torch::nullopt) const override {
    return std::make_shared<ReplicaImpl>(gpt2::Gpt(std::dynamic_pointer_cast<gpt2::GptImpl>(model->clone(device))));
  }

  gpt2::Gpt model;
};
TORCH_MODULE(Replica);

#if defined(GPT2_DP_TORCH_CUDA)
void synchronize(const std::vector<torch::Device>& devices) {
  for (const auto& d : devices) torch::cuda::synchronize(d.index());
}

//! The most libtorch's allocator held at once on any of the devices, GiB.
double peak_gib(const std::vector<torch::Device>& devices) {
  double peak = 0;
  for (const auto& d : devices) {
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(d.index());
    peak = std::max(peak, static_cast<double>(stats.allocated_bytes[0].peak) / (1 << 30));
  }
  return peak;
}
#endif

}  // namespace

int main(int argc, char** argv) {
  const options opt = parse(argc, argv);
#if !defined(GPT2_DP_TORCH_CUDA)
  std::fprintf(stderr,
               "gpt2_data_parallel: libtorch %s is built without CUDA, and torch::nn::parallel::data_parallel "
               "runs on CUDA devices only [skipped]\n",
               TORCH_VERSION);
  return 77;
#else
  const auto visible = static_cast<std::int64_t>(torch::cuda::device_count());
  if (visible < 1) {
    std::fprintf(stderr,
                 "gpt2_data_parallel: no CUDA device visible (libtorch %s): torch::nn::parallel::data_parallel "
                 "runs on CUDA devices only [skipped]\n",
                 TORCH_VERSION);
    return 77;
  }
  if (!std::filesystem::exists(opt.data)) {
    std::fprintf(
        stderr,
        "gpt2_data_parallel: no text at %s; give --data DIR|FILE (Debian: apt-get install fortunes) [skipped]\n",
        opt.data.c_str());
    return 77;
  }
  if (opt.gpus > visible) {
    std::fprintf(stderr, "gpt2_data_parallel: --gpus %lld, but %lld visible\n", static_cast<long long>(opt.gpus),
                 static_cast<long long>(visible));
    return 2;
  }
  if (opt.threads > 0) torch::set_num_threads(static_cast<int>(opt.threads));
  const int n = static_cast<int>(opt.gpus > 0 ? opt.gpus : visible);
  std::vector<torch::Device> devices;
  for (int d = 0; d < n; ++d) devices.emplace_back(torch::kCUDA, static_cast<c10::DeviceIndex>(d));
  const torch::Device dev0 = devices.front();

  try {
    const gpt2::TextData text(opt.data);
    const gpt2::Config cfg = gpt2::config_named(opt.config, opt.seq);
    torch::manual_seed(opt.seed);
    gpt2::Gpt model(cfg);
    model->to(dev0);
    Replica net(model);
    torch::optim::AdamW adamw(model->parameters(),
                              torch::optim::AdamWOptions(opt.lr).betas({0.9, 0.95}).eps(1e-8).weight_decay(0.1));
    std::int64_t params = 0;
    for (const auto& p : model->parameters()) params += p.numel();
#ifdef _OPENMP
    const bool threaded = n > 1 && torch::get_num_threads() > 1;
#else
    const bool threaded = false;
#endif
    std::printf(
        "gpt2_data_parallel: %lld parameters, %d GPU(s), %lld x %lld tokens per GPU and step; replicas' forward "
        "%s; libtorch %s\n",
        static_cast<long long>(params), n, static_cast<long long>(opt.batch), static_cast<long long>(opt.seq),
        n == 1     ? "(one GPU: the model itself, no replica)"
        : threaded ? "on OpenMP threads"
                   : "one after another on the main thread",
        TORCH_VERSION);
    std::fflush(stdout);

    // bf16 autocast on this thread, as the example turns it on in each rank's thread: for the
    // loss and for one GPU (where data_parallel calls the model here); ReplicaImpl turns it on in
    // parallel_apply's threads.
    gpt2::set_cuda_bf16_autocast(true);
    using clock = std::chrono::steady_clock;
    std::vector<double> step_ms;
    double first_loss = 0, last_loss = 0;
    for (std::int64_t s = 0; s < opt.steps; ++s) {
      const auto t0 = clock::now();
      // GPU r's rows are rank r's of the example on N GPUs: data_parallel's scatter cuts the
      // global batch into N equal parts along dimension 0, in order.
      std::vector<torch::Tensor> per_gpu;
      for (int r = 0; r < n; ++r) per_gpu.push_back(text.batch(opt.batch, opt.seq, opt.seed, s, r));
      auto rows = torch::cat(per_gpu).to(dev0, /*non_blocking=*/true);
      auto x = rows.narrow(1, 0, opt.seq), y = rows.narrow(1, 1, opt.seq);
      // Gpt::forward returns logits: data_parallel gathers the replicas' logits [N·B, T, vocab]
      // onto GPU 0, and the loss (GptImpl::loss's cross-entropy) is computed there, after the
      // gather, over the whole global batch.
      auto logits = torch::nn::parallel::data_parallel(net, x, devices);
      auto loss =
          torch::nn::functional::cross_entropy(logits.view({-1, logits.size(-1)}).to(torch::kFloat), y.reshape({-1}));
      loss.backward();
      at::autocast::clear_cache();
      adamw.step();
      adamw.zero_grad();
      synchronize(devices);
      step_ms.push_back(std::chrono::duration<double, std::milli>(clock::now() - t0).count());
      if (s == 0 || s + 1 == opt.steps) {
        const double l = loss.item<double>();
        if (s == 0) first_loss = l;
        last_loss = l;
      }
    }
    const double median = gpt2::median_after_warmup(step_ms, opt.warmup);
    gpt2::print_bench_line("libtorch-data_parallel", n, median, opt.batch * opt.seq * n, peak_gib(devices), first_loss,
                           last_loss);

    if (n > 1) {  // the part of each step that is replicate(): the clone of the model onto the N GPUs
      std::vector<double> rep_ms;
      for (int i = 0; i < 3; ++i) {
        const auto t0 = clock::now();
        auto replicas = torch::nn::parallel::replicate(net, devices);
        synchronize(devices);
        rep_ms.push_back(std::chrono::duration<double, std::milli>(clock::now() - t0).count());
      }
      std::printf(
          "gpt2_data_parallel: replicate (the model cloned onto %d GPUs, as every step does) %.2f ms, median of 3\n", n,
          gpt2::median_after_warmup(rep_ms, 0));
    }
    if (!std::isfinite(first_loss) || !std::isfinite(last_loss)) {
      std::fprintf(stderr, "gpt2_data_parallel: the loss is not finite\n");
      return 1;
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gpt2_data_parallel: error: %s\n", e.what());
    return 1;
  }
  return 0;
#endif
}
