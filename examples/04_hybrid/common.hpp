#pragma once
// What example 04's CPU path (main.cpp) and GPU path (gpu_hybrid.cu) share: the command line's
// options, the network's shape, the whole network's layout (the order gathered_values() uses)
// and the closing check that every rank of the job holds the same network. Plain C++: it is
// compiled by the host compiler and by nvcc alike.
#include <bit>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <lockstep/core/reduce_op.hpp>
#include <lockstep/observe/metrics.hpp>

#include "../01_fashion_mnist/fashion_mnist.hpp"
#include "tp_mlp.hpp"

namespace hybrid {

struct options {
  int ranks = 4, parts = 2, epochs = 2;
  int gpus = 0;            // > 0: run on GPUs 0 .. gpus-1 instead of CPU threads
  std::size_t batch = 64;  // per replica
  float lr = 0.05f;
  std::filesystem::path data = "/usr/share/datasets/fashion-mnist";
  std::optional<std::size_t> limit_train, limit_test;
  bool check_equivalence = false;     // GPUs: the split run against the unsplit one, then exit
  std::optional<std::uint64_t> seed;  // --check-equivalence: repeat a run's data and weights
  char omit = 0;                      // --check-omit f|g: leave that all-reduce out (the check must fail)
};

//! The network of the example: 784 → 128 → (256, split over the parts) → 128 → 10.
inline dims example_dims() { return {fmnist::image_pixels, 128, 256, fmnist::classes}; }
inline constexpr std::uint64_t example_seed = 2026;  // the weights of the training runs

struct whole_parameter {
  std::string name;
  std::size_t size;
};
//! The whole (unsplit) network's parameters in gathered_values() order.
inline std::vector<whole_parameter> whole_layout(const dims& d) {
  const auto in = static_cast<std::size_t>(d.in), w = static_cast<std::size_t>(d.width),
             h = static_cast<std::size_t>(d.hidden), c = static_cast<std::size_t>(d.classes);
  return {{"fc1.weight", w * in}, {"fc1.bias", w}, {"fc2.weight", h * w}, {"fc2.bias", h},
          {"fc3.weight", w * h},  {"fc3.bias", w}, {"fc4.weight", c * w}, {"fc4.bias", c}};
}

//! FNV-1a over the values' bits.
inline std::uint64_t fingerprint(std::span<const float> v) {
  std::uint64_t h = 1469598103934665603ull;
  for (float x : v) h = (h ^ std::bit_cast<std::uint32_t>(x)) * 1099511628211ull;
  return h;
}

//! Whether every rank of `comm` passes the same values (a collective: the fingerprint's
//! minimum and maximum over the ranks, staged through the communicator's memory, so host and
//! device communicators alike).
template <class Comm>
bool identical_on_all_ranks(Comm& comm, std::span<const float> whole) {
  const auto h = std::bit_cast<std::int64_t>(fingerprint(whole));
  std::int64_t lo = h, hi = h;
  lockstep::all_reduce_scalars(comm, std::span<std::int64_t>(&lo, 1), lockstep::reduce_op::min);
  lockstep::all_reduce_scalars(comm, std::span<std::int64_t>(&hi, 1), lockstep::reduce_op::max);
  return lo == hi;
}

}  // namespace hybrid
