#pragma once
// The model of docs/api.md's smallest complete training loop (the first code block there,
// verbatim between the snippet markers: tests/docs/check_snippets.py compares them).
#include <cstddef>
#include <cstdint>
#include <random>
#include <span>
#include <vector>

#include <lockstep/lockstep.hpp>

// [snippet docs/api.md#1]
#include <lockstep/lockstep.hpp>

struct Data {  // n rows of d features; y = x·w* + 1 + noise, the same on every rank
  std::size_t n, d;
  std::vector<float> x, y;
};

inline Data make_data(std::size_t n, std::size_t d, std::uint64_t seed) {
  Data data{n, d, std::vector<float>(n * d), std::vector<float>(n)};
  std::mt19937_64 rng(lockstep::model_seed(seed));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (auto& v : data.x) v = normal(rng);
  for (std::size_t i = 0; i < n; ++i) {
    float t = 1.0f + 0.05f * normal(rng);
    for (std::size_t j = 0; j < d; ++j) t += data.x[i * d + j] * static_cast<float>(j % 3);
    data.y[i] = t;
  }
  return data;
}

// The model: y ≈ x·w + b, its parameters and gradients, a hand-written backward.
class Linear {
 public:
  explicit Linear(std::size_t d) : w_(d, 0.0f), gw_(d, 0.0f) {}

  std::vector<lockstep::parameter> parameters() {
    return {lockstep::param<float>("w", std::span(w_), std::span(gw_)),
            lockstep::param<float>("b", std::span(b_), std::span(gb_))};
  }

  // Mean squared error over the batch's rows (returned); adds d(loss_scale · loss)/dθ into
  // the gradients and reports each gradient when it is final.
  double forward_backward(const Data& data, std::span<const std::size_t> rows, double loss_scale,
                          lockstep::gradient_ready_fn ready) {
    const float k = static_cast<float>(2.0 * loss_scale / static_cast<double>(rows.size()));
    double loss = 0.0;
    for (std::size_t i : rows) {
      const float* x = &data.x[i * data.d];
      float pred = b_[0];
      for (std::size_t j = 0; j < data.d; ++j) pred += x[j] * w_[j];
      const float err = pred - data.y[i];
      loss += static_cast<double>(err) * err;
      gb_[0] += k * err;
      for (std::size_t j = 0; j < data.d; ++j) gw_[j] += k * err * x[j];
    }
    ready(1);  // b
    ready(0);  // w
    return loss / static_cast<double>(rows.size());
  }

 private:
  std::vector<float> w_, gw_, b_ = {0.0f}, gb_ = {0.0f};
};
// [end snippet]
