// lockstep example 04: data parallelism × tensor parallelism on CPU ranks. run(Hybrid{...})
// makes the job's ranks a mesh of replicas × parts; each replica's middle block is split over
// its parts (tp_mlp.hpp), DataParallel averages the gradients over the replicas, and every
// replica reads its own batches (DistributedSampler over the data axis). Fashion-MNIST.
//
//   hybrid_fashion_mnist [--ranks 4] [--parts 2] [--epochs 2] [--batch 64] [--lr 0.05]
//                        [--data DIR] [--limit-train N] [--limit-test N]
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
#include "tp_mlp.hpp"

namespace {

struct args {
  int ranks = 4, parts = 2, epochs = 2;
  std::size_t batch = 64;  // per replica
  float lr = 0.05f;
  std::filesystem::path data = "/usr/share/datasets/fashion-mnist";
  std::optional<std::size_t> limit_train, limit_test;
};

args parse(int argc, char** argv) {
  args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    if (i + 1 >= argc) throw std::invalid_argument(k + " needs a value (see the usage at the top of main.cpp)");
    const std::string v = argv[++i];
    if (k == "--ranks") a.ranks = std::stoi(v);
    else if (k == "--parts") a.parts = std::stoi(v);
    else if (k == "--epochs") a.epochs = std::stoi(v);
    else if (k == "--batch") a.batch = std::stoul(v);
    else if (k == "--lr") a.lr = std::stof(v);
    else if (k == "--data") a.data = v;
    else if (k == "--limit-train") a.limit_train = std::stoul(v);
    else if (k == "--limit-test") a.limit_test = std::stoul(v);
    else throw std::invalid_argument("unknown option " + k);
  }
  if (a.ranks < 1 || a.parts < 1 || a.epochs < 1 || a.batch < 1)
    throw std::invalid_argument("--ranks, --parts, --epochs and --batch must be at least 1");
  return a;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const args a = parse(argc, argv);
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
    const hybrid::dims d{fmnist::image_pixels, 128, 256, fmnist::classes};
    const auto t0 = std::chrono::steady_clock::now();
    const lockstep::Hybrid mode{.model_parallel = a.parts, .inner = lockstep::Threads{a.ranks}};
    lockstep::run(mode, [&](auto& mesh) {
      auto& world = mesh.world();  // the whole job: all replicas' parts
      using Comm = std::remove_cvref_t<decltype(mesh.model)>;
      hybrid::TpMlp<Comm> model(d, mesh.part(), mesh.parts(), &mesh.model, 2026);
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
        if (root) std::printf("epoch %zu: mean training loss %.4f over %zu steps\n", sampler.epoch() + 1, loss / steps, steps);
      }
      // Every replica evaluates the whole test set (its parts together).
      std::vector<std::size_t> rows(data.test.size);
      for (std::size_t i = 0; i < rows.size(); ++i) rows[i] = i;
      fmnist::gather(data.test, rows, data.table.data(), x, y);
      const std::size_t right = model.correct(x, y);
      const auto whole = model.gathered_values();
      std::uint64_t h = 1469598103934665603ull;
      for (float v : whole) h = (h ^ std::bit_cast<std::uint32_t>(v)) * 1099511628211ull;
      std::vector<std::uint64_t> hashes(static_cast<std::size_t>(world.size()));
      world.comm().all_gather(&h, hashes.data(), 1, lockstep::dtype::i64);
      bool same = true;
      for (auto v : hashes) same = same && v == hashes[0];
      if (root)
        std::printf("final: test accuracy %.2f%% (%zu of %zu); parameters %s\n", 100.0 * right / data.test.size, right,
                    data.test.size, same ? "identical on all ranks" : "DIFFER across ranks");
    });
    std::printf("time: %.1f s\n", std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "hybrid_fashion_mnist: %s\n", e.what());
    return 1;
  }
}
