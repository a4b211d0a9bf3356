#pragma once
// Shared pieces of the equivalence tests (threads, MPI): a random classification data set
// and the one-rank reference — one rank, batch N·K·B per optimizer step, plain SGD, no lockstep.
#include <cstdint>
#include <random>
#include <type_traits>
#include <vector>

#include "mlp.hpp"
#include "test_util.hpp"

namespace lockstep_test {

struct dataset {
  std::vector<int> dims;
  std::size_t samples;
  std::vector<double> X64;
  std::vector<float> X32;
  std::vector<int> y;
};

inline dataset make_data(std::uint64_t seed, std::size_t samples) {
  dataset d{{13, 17, 11, 5}, samples, {}, {}, {}};
  std::mt19937_64 rng(seed);
  d.X64 = random_vector<double>(samples * 13, rng, -2, 2);
  d.X32.assign(d.X64.begin(), d.X64.end());
  std::uniform_int_distribution<int> lab(0, 4);
  for (std::size_t i = 0; i < samples; ++i) d.y.push_back(lab(rng));
  return d;
}

template <class T>
const std::vector<T>& inputs(const dataset& d) {
  if constexpr (std::is_same_v<T, double>) return d.X64;
  else return d.X32;
}

//! Parameters after `steps` optimizer steps of one rank over batches of batch·ranks·accumulate.
template <class T>
std::vector<T> one_rank_reference(const dataset& d, std::size_t batch, int ranks, int accumulate, int steps,
                                  std::uint64_t init_seed, double lr) {
  TestMlp<T> m(d.dims, init_seed);
  const std::size_t global = batch * static_cast<std::size_t>(ranks * accumulate);
  for (int s = 0; s < steps; ++s) {
    m.zero_grad();
    std::vector<std::size_t> rows(global);
    for (std::size_t i = 0; i < global; ++i) rows[i] = (static_cast<std::size_t>(s) * global + i) % d.samples;
    m.forward_backward(inputs<T>(d), d.y, rows, [](std::size_t) {});
    m.sgd(lr);
  }
  return m.flat_values();
}

}  // namespace lockstep_test
