// lockstep example 01: an MLP learns Fashion-MNIST, data-parallel over all local GPUs (cuBLAS)
// or over CPU threads.
//
//   sudo apt-get install dataset-fashion-mnist       # the data (or pass --data DIR)
//   cmake -S . -B build && cmake --build build --target fashion_mnist    # CUDA when nvcc is found
//   ./build/examples/01_fashion_mnist/fashion_mnist --epochs 5           # every GPU, else CPU threads
//   ./build/examples/01_fashion_mnist/fashion_mnist --device gpu --gpus 2 --check
//   ./build/examples/01_fashion_mnist/fashion_mnist --device gpu --no-prefetch   # input in the step
//   ./build/examples/01_fashion_mnist/fashion_mnist --device cpu --ranks 2
//   ./build/examples/01_fashion_mnist/fashion_mnist --checkpoint run.lsck --stop-after 2
//   ./build/examples/01_fashion_mnist/fashion_mnist --resume run.lsck          # epochs 3..5
//
// What it shows: the data set is loaded once and shared read-only by every rank (on GPUs,
// a lockstep::Prefetcher per rank gathers its batches on a helper thread into pinned memory
// and copies them ahead on a copy stream while the previous steps compute; --input sync
// or device for the other ways in); each rank builds the same model
// (lockstep::model_seed), wraps it in lockstep::DataParallel (zero-copy gradients through
// bind_gradient, buckets reduced as backward reports gradients ready), reads its own shard
// through lockstep::DistributedSampler, and steps SGD with momentum after finish()
// (lockstep::Sgd on the CPU, lockstep::FusedSgd per bucket on GPUs). --batch is the
// GLOBAL batch (split across the ranks), so the training does not depend on the number of
// ranks or on the device. Test accuracy is computed distributed (each rank its slice of the
// test set, counts all-reduced). Checkpoints resume bit for bit. The training loop is
// fashion_mnist.hpp (one loop for both devices); the trainers are cpu_trainer.hpp and
// gpu_train.cu, the GPU model gpu_mlp.cuh. See docs/example_fashion_mnist.md.
//
// Exit status: 0 done, 1 error (bad data, checkpoint, no GPU for --device gpu, a failed
// --check, ...), 2 bad command line, 77 data not installed (ctest counts that as skipped).
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <iostream>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <lockstep/launch/detect.hpp>
#include <lockstep/lockstep.hpp>
#include <lockstep/optim/sgd.hpp>

#include "cpu_trainer.hpp"
#include "fashion_mnist.hpp"
#include "idx.hpp"
#include "mlp.hpp"

#if defined(FASHION_MNIST_WITH_GPUS)
#include "gpu_train.hpp"
inline constexpr bool built_with_gpus = true;
#else
inline constexpr bool built_with_gpus = false;
#endif

namespace {

// The GPUs --device/--gpus select: LOCKSTEP_DEVICES (else every visible GPU), the first
// --gpus of them. Empty: run on CPU threads.
std::vector<int> choose_gpus(const fmnist::options& opt, const lockstep::environment& env) {
  if (opt.device == fmnist::device_kind::cpu) return {};
  if (!built_with_gpus) {
    if (opt.device == fmnist::device_kind::gpu)
      throw lockstep::config_error("--device gpu: this fashion_mnist was built without CUDA (lockstep::cuda was not "
                                   "available); rebuild it with the CUDA toolkit and NCCL installed "
                                   "(-DLOCKSTEP_ENABLE_CUDA=ON), or use --device cpu");
    return {};
  }
  if (opt.device == fmnist::device_kind::automatic &&
      lockstep::decide(env, true).kind != lockstep::mode_kind::local_gpus)
    return {};  // no GPU visible, or LOCKSTEP_CPU_RANKS asks for CPU ranks
  if (env.gpus.empty())
    throw lockstep::config_error("--device gpu: no GPU is visible" +
                                 (env.cuda_error.empty() ? std::string() : " (CUDA: " + env.cuda_error + ")") +
                                 "; check the driver and CUDA_VISIBLE_DEVICES, or use --device cpu");
  std::vector<int> devices;
  if (env.devices) devices = *env.devices;
  else
    for (const auto& g : env.gpus) devices.push_back(g.id);
  if (opt.gpus > 0) {
    if (static_cast<std::size_t>(opt.gpus) > devices.size())
      throw lockstep::config_error("--gpus " + std::to_string(opt.gpus) + ": only " + std::to_string(devices.size()) +
                                   " GPU(s) available" + (env.devices ? " in LOCKSTEP_DEVICES" : "") +
                                   "; ask for fewer");
    devices.resize(static_cast<std::size_t>(opt.gpus));
  }
  return devices;
}

}  // namespace

int main(int argc, char** argv) {
  const auto t_start = std::chrono::steady_clock::now();
  fmnist::options opt;
  try {
    opt = fmnist::parse(argc, argv);
  } catch (const fmnist::usage_error& e) {
    std::cerr << "fashion_mnist: " << e.what() << "\n" << fmnist::usage;
    return 2;
  }
  // 1. The data, loaded once; every rank reads it (read-only) from its own thread.
  fmnist::dataset data;
  try {
    const auto none = std::numeric_limits<std::size_t>::max();
    data.train = fmnist::load_split(opt.data, "train", opt.limit_train.value_or(none));
    data.test = fmnist::load_split(opt.data, "t10k", opt.limit_test.value_or(none));
  } catch (const fmnist::data_error& e) {
    std::cerr << "fashion_mnist: error: " << e.what() << "\n";
    return e.missing ? 77 : 1;
  }
  fmnist::make_table(data);
  const double load_s = fmnist::seconds_since(t_start);

  try {
    // 2. Where to run: GPUs or CPU threads, and how many ranks.
    const auto env = lockstep::detect();
    const std::vector<int> gpus = choose_gpus(opt, env);
    const bool on_gpus = !gpus.empty();
    const int ranks =
        on_gpus ? static_cast<int>(gpus.size()) : (opt.ranks > 0 ? opt.ranks : lockstep::decide(env).ranks);
    const fmnist::training_plan plan = fmnist::make_plan(opt, data.train.size, ranks, on_gpus);

    std::string where;
    if (on_gpus) {
      where = std::to_string(ranks) + " GPU rank" + (ranks == 1 ? "" : "s") + " (device" + (ranks == 1 ? " " : "s ");
      for (std::size_t i = 0; i < gpus.size(); ++i) {
        if (i > 0) where += ",";
        where += std::to_string(gpus[i]);
      }
      for (const auto& g : env.gpus)
        if (g.id == gpus[0]) where += ": " + g.name;
      where += ", cuBLAS)";
    } else {
      where = std::to_string(ranks) + " CPU rank" + (ranks == 1 ? "" : "s") + " (threads)";
    }
    fmnist::print_header(where, opt, data, plan, load_s);

#if defined(FASHION_MNIST_WITH_GPUS)
    if (on_gpus && opt.check && !fmnist::check_gpu_model(gpus[0], data, opt)) return 1;
#endif
    fmnist::final_result result;
    const auto t_train = std::chrono::steady_clock::now();

    // 3. The SPMD body: runs once per rank, each on its own thread (and GPU).
    if (on_gpus) {
#if defined(FASHION_MNIST_WITH_GPUS)
      fmnist::train_on_gpus(gpus, opt, plan, data, result);
#endif
    } else {
      lockstep::run(lockstep::Threads{ranks}, [&](auto& ctx) {
        fmnist::CpuTrainer trainer(data, opt.seed);
        fmnist::train_rank(ctx, trainer, opt, plan, data, result);
      });
    }

    fmnist::print_final(result, fmnist::seconds_since(t_train));
    return result.ranks_agree ? 0 : 1;
  } catch (const std::exception& e) {
    std::fflush(stdout);
    std::cerr << "fashion_mnist: error: " << e.what() << "\n";
    return 1;
  }
}
