// lockstep example 04: data parallelism × tensor parallelism. run(Hybrid{...}) makes the job's
// ranks a mesh of replicas × parts; each replica's middle block is split over its parts
// (tp_mlp.hpp on CPU threads, gpu_tp_mlp.cuh on GPUs), DataParallel averages the gradients over
// the replicas, and every replica reads its own batches (DistributedSampler over the data
// axis). Fashion-MNIST.
//
//   hybrid_fashion_mnist [--ranks 4] [--parts 2] [--epochs 2] [--batch 64] [--lr 0.05]
//                        [--data DIR] [--limit-train N] [--limit-test N]
//   hybrid_fashion_mnist --gpus 4 --parts 2 [...]    GPUs 0..3: 2 replicas x 2 parts (CUDA builds)
//   hybrid_fashion_mnist --gpus 4 --parts 2 --check-equivalence [--seed S] [--check-omit f|g]
//       the split model against the unsplit one on GPU 0 (and the host TpMlp), random data;
//       exit 0 when equal within tolerance. --check-omit leaves the f or g all-reduce out: it must fail.
// With --gpus, fewer visible GPUs than asked for exit 77 (skipped), as a missing data set does.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include <lockstep/lockstep.hpp>

#include "../01_fashion_mnist/fashion_mnist.hpp"
#include "common.hpp"
#include "tp_mlp.hpp"
#if defined(HYBRID_WITH_GPUS)
#include "gpu_hybrid.hpp"
#endif

namespace {

hybrid::options parse(int argc, char** argv) {
  hybrid::options a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    if (k == "--check-equivalence") {
      a.check_equivalence = true;
      continue;
    }
    if (i + 1 >= argc) throw std::invalid_argument(k + " needs a value (see the usage at the top of main.cpp)");
    const std::string v = argv[++i];
    if (k == "--ranks") a.ranks = std::stoi(v);
    else if (k == "--parts") a.parts = std::stoi(v);
    else if (k == "--gpus") a.gpus = std::stoi(v);
    else if (k == "--epochs") a.epochs = std::stoi(v);
    else if (k == "--batch") a.batch = std::stoul(v);
    else if (k == "--lr") a.lr = std::stof(v);
    else if (k == "--data") a.data = v;
    else if (k == "--limit-train") a.limit_train = std::stoul(v);
    else if (k == "--limit-test") a.limit_test = std::stoul(v);
    else if (k == "--seed") a.seed = std::stoull(v);
    else if (k == "--check-omit" && (v == "f" || v == "g")) a.omit = v[0];
    else if (k == "--check-omit") throw std::invalid_argument("--check-omit takes f or g");
    else throw std::invalid_argument("unknown option " + k);
  }
  if (a.ranks < 1 || a.parts < 1 || a.epochs < 1 || a.batch < 1 || a.gpus < 0)
    throw std::invalid_argument("--ranks, --parts, --epochs and --batch must be at least 1, --gpus at least 0");
  if ((a.check_equivalence || a.omit) && a.gpus == 0)
    throw std::invalid_argument("--check-equivalence and --check-omit need --gpus N");
  if (a.gpus > 0 && a.gpus % a.parts != 0)
    throw std::invalid_argument("--parts " + std::to_string(a.parts) + " does not divide --gpus " +
                                std::to_string(a.gpus));
  return a;
}

// The training on CPU threads: TpMlp on host memory, its all-reduces on ThreadComm.
void train_on_threads(const hybrid::options& a, const fmnist::dataset& data) {
  const hybrid::dims d = hybrid::example_dims();
  const lockstep::Hybrid mode{.model_parallel = a.parts, .inner = lockstep::Threads{a.ranks}};
  lockstep::run(mode, [&](auto& mesh) {
    auto& world = mesh.world();  // the whole job: all replicas' parts
    using Comm = std::remove_cvref_t<decltype(mesh.model)>;
    hybrid::TpMlp<Comm> model(d, mesh.part(), mesh.parts(), &mesh.model, hybrid::example_seed);
    lockstep::DataParallel dp(mesh.data, model);
    lockstep::DistributedSampler sampler(data.train.size, mesh.data, {.seed = 7});
    const bool root = world.is_root();
    if (root)
      std::printf("hybrid: %d ranks = %d replicas x %d tensor-parallel parts, batch %zu per replica\n", world.size(),
                  mesh.replicas(), mesh.parts(), a.batch);
    std::vector<float> x;
    std::vector<std::uint8_t> y;
    for (; sampler.epoch() < static_cast<std::size_t>(a.epochs); sampler.set_epoch(sampler.epoch() + 1)) {
      double loss = 0;
      std::size_t steps = 0;
      for (auto batch : sampler.batches(a.batch)) {
        fmnist::gather(data.train, batch, data.table.data(), x, y);
        auto step = dp.step();
        loss += model.forward_backward(x, y, step.on_gradient_ready());
        if (step.finish()) model.sgd(a.lr);
        sampler.advance(batch.size());
        ++steps;
      }
      if (root)
        std::printf("epoch %zu: mean training loss %.4f over %zu steps\n", sampler.epoch() + 1, loss / steps, steps);
    }
    // Every replica evaluates the whole test set (its parts together).
    std::vector<std::size_t> rows(data.test.size);
    for (std::size_t i = 0; i < rows.size(); ++i) rows[i] = i;
    fmnist::gather(data.test, rows, data.table.data(), x, y);
    const std::size_t right = model.correct(x, y);
    const bool same = hybrid::identical_on_all_ranks(world.comm(), model.gathered_values());
    if (root)
      std::printf("final: test accuracy %.2f%% (%zu of %zu); parameters %s\n", 100.0 * right / data.test.size, right,
                  data.test.size, same ? "identical on all ranks" : "DIFFER across ranks");
  });
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const hybrid::options a = parse(argc, argv);
    if (a.gpus > 0) {
#if defined(HYBRID_WITH_GPUS)
      if (const int visible = hybrid::visible_gpus(); visible < a.gpus) {
        std::printf("[lockstep-skip] --gpus %d: %d GPU(s) visible\n", a.gpus, visible);
        return 77;
      }
      if (a.check_equivalence) return hybrid::check_equivalence(a);
#else
      std::fprintf(stderr, "hybrid_fashion_mnist: --gpus: this build has no GPU path (configure with lockstep's CUDA "
                           "part and FASHION_MNIST_CUDA=ON)\n");
      return 1;
#endif
    }
    fmnist::dataset data;
    constexpr std::size_t all = static_cast<std::size_t>(-1);
    try {
      data.train = fmnist::load_split(a.data, "train", a.limit_train.value_or(all));
      data.test = fmnist::load_split(a.data, "t10k", a.limit_test.value_or(all));
    } catch (const fmnist::data_error& e) {
      std::fprintf(stderr, "%s\n", e.what());
      return e.missing ? 77 : 1;  // 77: skipped (no data set installed)
    }
    fmnist::make_table(data);
    const auto t0 = std::chrono::steady_clock::now();
    if (a.gpus > 0) {
#if defined(HYBRID_WITH_GPUS)
      hybrid::train_on_gpus(a, data);
#endif
    } else {
      train_on_threads(a, data);
    }
    std::printf("time: %.1f s\n", std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "hybrid_fashion_mnist: %s\n", e.what());
    return 1;
  }
}
