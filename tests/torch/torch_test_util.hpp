#pragma once
// What the libtorch adapter's CPU and GPU tests share: the tiny GPT-2, its token batches, and
// comparisons of modules' parameters.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include <torch/torch.h>

#include "../../examples/03_gpt2_torch/gpt2.hpp"

// libtorch builds with glog (Debian's) define CHECK as an abort that doctest never sees.
#undef CHECK
#define CHECK DOCTEST_CHECK

namespace lockstep_test {

//! ‖a−b‖/‖b‖ over all parameters of two modules (b the reference).
inline double rel_diff(torch::nn::Module& a, torch::nn::Module& b) {
  auto pa = a.parameters(), pb = b.parameters();
  REQUIRE(pa.size() == pb.size());
  double num = 0, den = 0;
  for (std::size_t i = 0; i < pa.size(); ++i) {
    auto x = pa[i].detach().to(torch::kDouble), y = pb[i].detach().to(torch::kDouble);
    num += (x - y).pow(2).sum().item<double>();
    den += y.pow(2).sum().item<double>();
  }
  return std::sqrt(num) / std::max(std::sqrt(den), 1e-300);
}

inline gpt2::Config tiny() { return gpt2::Config{.vocab = 61, .context = 16, .layers = 2, .heads = 2, .width = 24}; }

//! Random token ids [rows, T+1]: inputs are [:, :T], targets [:, 1:].
inline torch::Tensor tokens(std::int64_t rows, const gpt2::Config& c, std::uint64_t seed) {
  torch::manual_seed(seed);
  return torch::randint(c.vocab, {rows, c.context + 1}, torch::kLong);
}

//! One module per rank, rank r's made by make(r) right after libtorch's generator was seeded
//! with seed + r: every rank starts from other values (DataParallel must make them rank 0's).
template <class Make>
auto per_rank(int ranks, std::uint64_t seed, Make&& make) {
  std::vector<decltype(make(0))> out;
  for (int r = 0; r < ranks; ++r) {
    torch::manual_seed(seed + static_cast<std::uint64_t>(r));
    out.push_back(make(r));
  }
  return out;
}

inline void copy_parameters(torch::nn::Module& to, torch::nn::Module& from) {
  torch::NoGradGuard g;
  auto a = to.parameters(), b = from.parameters();
  for (std::size_t i = 0; i < a.size(); ++i) a[i].copy_(b[i]);
}

}  // namespace lockstep_test
