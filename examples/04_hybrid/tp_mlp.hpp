#pragma once
// A classifier whose middle block is tensor-parallel over the model axis of a lockstep::Mesh
// (Megatron's MLP block): with `parts` ranks per replica, part k holds rows k of fc2 (a
// column-parallel layer) and the matching columns of fc3 (a row-parallel layer).
//
//   x ─ fc1 ─ relu ─ f ─ fc2 (part k's hidden units) ─ relu
//     ─ fc3 (part k's inputs) ─ g ─ relu ─ fc4 ─ logits
//
//   f: identity forward; backward, the gradient of its input summed over the parts (all-reduce)
//   g: forward, the parts' partial outputs summed (all-reduce); identity backward
//
// fc1, fc3's bias and fc4 are replicated on every part, and get the same gradient on every
// part (their inputs and output gradients are the same there after f and g), so DataParallel
// averaging over the data axis is all they need. With parts = 1 and no communicator it is
// the plain, unsplit network. Weights are drawn for the whole network from `seed`, then each
// part keeps its slice: any split of one seed is the same function.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <random>
#include <span>
#include <string>
#include <vector>

#include <lockstep/core/dtype.hpp>
#include <lockstep/core/error.hpp>
#include <lockstep/core/parameter.hpp>
#include <lockstep/core/reduce_op.hpp>

namespace hybrid {

struct dims {
  int in = 784, width = 64, hidden = 128, classes = 10;
};

template <class Comm>
class TpMlp {
 public:
  //! Part `part` of `parts`; model_comm: the model axis (nullptr when parts == 1).
  TpMlp(dims d, int part, int parts, Comm* model_comm, std::uint64_t seed)
      : d_(d), part_(part), parts_(parts), comm_(model_comm) {
    if (parts < 1 || d.hidden % parts != 0)
      throw lockstep::config_error("TpMlp: " + std::to_string(parts) + " parts do not divide the " +
                                   std::to_string(d.hidden) + " hidden units");
    if (parts > 1 && (comm_ == nullptr || comm_->size() != parts))
      throw lockstep::config_error("TpMlp: " + std::to_string(parts) +
                                   " parts need a model-axis communicator of that size");
    h_ = d.hidden / parts;
    std::mt19937_64 rng(seed);
    const auto full = [&](int out, int in) {
      std::normal_distribution<double> nd(0.0, std::sqrt(2.0 / in));
      std::vector<float> w(static_cast<std::size_t>(out) * static_cast<std::size_t>(in));
      for (auto& x : w) x = static_cast<float>(nd(rng));
      return w;
    };
    const auto bias = [&](int n) {
      std::uniform_real_distribution<double> u(-0.05, 0.05);
      std::vector<float> b(static_cast<std::size_t>(n));
      for (auto& x : b) x = static_cast<float>(u(rng));
      return b;
    };
    w1_ = full(d.width, d.in);
    b1_ = bias(d.width);
    const auto w2 = full(d.hidden, d.width);  // rows: hidden units
    const auto b2 = bias(d.hidden);
    const auto w3 = full(d.width, d.hidden);  // columns: hidden units
    b3_ = bias(d.width);
    w4_ = full(d.classes, d.width);
    b4_ = bias(d.classes);
    const std::size_t lo = static_cast<std::size_t>(part) * h_;
    w2_.assign(w2.begin() + static_cast<std::ptrdiff_t>(lo * d.width),
               w2.begin() + static_cast<std::ptrdiff_t>((lo + h_) * d.width));
    b2_.assign(b2.begin() + static_cast<std::ptrdiff_t>(lo), b2.begin() + static_cast<std::ptrdiff_t>(lo + h_));
    w3_.resize(static_cast<std::size_t>(d.width) * h_);
    for (int o = 0; o < d.width; ++o)
      for (std::size_t j = 0; j < h_; ++j)
        w3_[static_cast<std::size_t>(o) * h_ + j] = w3[static_cast<std::size_t>(o) * d.hidden + lo + j];
    for (auto* v : values()) grads_.emplace_back(v->size(), 0.0f);
    for (std::size_t i = 0; i < grads_.size(); ++i) gptr_.push_back(grads_[i].data());
  }

  std::vector<lockstep::parameter> parameters() {
    const std::string p = "[part " + std::to_string(part_) + "/" + std::to_string(parts_) + "]";
    const auto W = static_cast<std::int64_t>(d_.width), H = static_cast<std::int64_t>(h_);
    return {
        lockstep::param<float>("fc1.weight", w1_.data(), gptr_[0], {W, d_.in}),
        lockstep::param<float>("fc1.bias", b1_.data(), gptr_[1], {W}),
        lockstep::param<float>("fc2.weight" + p, w2_.data(), gptr_[2], {H, W}),
        lockstep::param<float>("fc2.bias" + p, b2_.data(), gptr_[3], {H}),
        lockstep::param<float>("fc3.weight" + p, w3_.data(), gptr_[4], {W, H}),
        lockstep::param<float>("fc3.bias", b3_.data(), gptr_[5], {W}),
        lockstep::param<float>("fc4.weight", w4_.data(), gptr_[6], {d_.classes, W}),
        lockstep::param<float>("fc4.bias", b4_.data(), gptr_[7], {d_.classes}),
    };
  }
  void bind_gradient(std::size_t i, void* p) { gptr_[i] = static_cast<float*>(p); }

  //! Mean cross-entropy of rows x (B × in) against labels y; adds its gradient (times
  //! loss_scale) and calls ready(i) for each parameter as its gradient is final. Returns the
  //! loss; `right` (optional) counts the right predictions.
  template <class Ready>
  double forward_backward(std::span<const float> x, std::span<const std::uint8_t> y, Ready&& ready,
                          double loss_scale = 1.0, std::size_t* right = nullptr) {
    const std::size_t B = y.size(), W = static_cast<std::size_t>(d_.width), C = static_cast<std::size_t>(d_.classes);
    const std::size_t I = static_cast<std::size_t>(d_.in);
    acts a;
    forward(x, B, a);
    auto& [a1, z2, a2, z3, a3, z4] = a;
    // loss and its gradient
    double loss = 0;
    std::vector<float> dz4(B * C);
    for (std::size_t r = 0; r < B; ++r) {
      const float* z = z4.data() + r * C;
      const float mx = *std::max_element(z, z + C);
      double s = 0;
      for (std::size_t c = 0; c < C; ++c) s += std::exp(static_cast<double>(z[c] - mx));
      loss += std::log(s) - static_cast<double>(z[y[r]] - mx);
      if (right && static_cast<std::size_t>(std::max_element(z, z + C) - z) == y[r]) ++*right;
      for (std::size_t c = 0; c < C; ++c)
        dz4[r * C + c] = static_cast<float>((std::exp(static_cast<double>(z[c] - mx)) / s - (c == y[r] ? 1.0 : 0.0)) *
                                            loss_scale / static_cast<double>(B));
    }
    // backward, last layer first
    std::vector<float> da3(B * W), da2(B * h_), da1(B * W);
    accumulate(dz4, C, a3, W, gptr_[6], gptr_[7]);
    ready(6), ready(7);
    back(dz4, C, w4_, W, da3);
    mask(da3, a3);  // dz3
    accumulate(da3, W, a2, h_, gptr_[4], gptr_[5]);
    ready(4), ready(5);
    back(da3, W, w3_, h_, da2);  // g backward: identity
    mask(da2, a2);               // dz2
    accumulate(da2, h_, a1, W, gptr_[2], gptr_[3]);
    ready(2), ready(3);
    back(da2, h_, w2_, W, da1);
    sum_over_parts(da1);  // f backward
    mask(da1, a1);        // dz1
    accumulate(da1, W, x, I, gptr_[0], gptr_[1]);
    ready(0), ready(1);
    return loss / static_cast<double>(B);
  }

  //! Right predictions among rows x (forward only; collective over the model axis).
  std::size_t correct(std::span<const float> x, std::span<const std::uint8_t> y) {
    acts a;
    forward(x, y.size(), a);
    const std::size_t C = static_cast<std::size_t>(d_.classes);
    std::size_t n = 0;
    for (std::size_t r = 0; r < y.size(); ++r) {
      const float* z = a.z4.data() + r * C;
      n += static_cast<std::size_t>(std::max_element(z, z + C) - z) == y[r] ? 1 : 0;
    }
    return n;
  }

  void sgd(float lr) {
    std::size_t i = 0;
    for (auto* v : values()) {
      for (std::size_t k = 0; k < v->size(); ++k) (*v)[k] -= lr * gptr_[i][k];
      ++i;
    }
  }

  //! The whole network's values as the unsplit model lays them out (a collective over the
  //! model axis when split): for comparing a split run with an unsplit one.
  std::vector<float> gathered_values() {
    std::vector<float> w2(static_cast<std::size_t>(d_.hidden) * d_.width), b2(d_.hidden),
        w3(static_cast<std::size_t>(d_.width) * d_.hidden);
    const std::size_t lo = static_cast<std::size_t>(part_) * h_;
    std::copy(w2_.begin(), w2_.end(), w2.begin() + static_cast<std::ptrdiff_t>(lo * d_.width));
    std::copy(b2_.begin(), b2_.end(), b2.begin() + static_cast<std::ptrdiff_t>(lo));
    for (int o = 0; o < d_.width; ++o)
      for (std::size_t j = 0; j < h_; ++j)
        w3[static_cast<std::size_t>(o) * d_.hidden + lo + j] = w3_[static_cast<std::size_t>(o) * h_ + j];
    sum_over_parts(w2);  // each part wrote its own slice; the others are zero
    sum_over_parts(b2);
    sum_over_parts(w3);
    std::vector<float> out;
    for (const auto* v : {&w1_, &b1_, &w2, &b2, &w3, &b3_, &w4_, &b4_}) out.insert(out.end(), v->begin(), v->end());
    return out;
  }

 private:
  struct acts {
    std::vector<float> a1, z2, a2, z3, a3, z4;
  };
  // The activations of B rows; g's all-reduce is the only communication.
  void forward(std::span<const float> x, std::size_t B, acts& a) {
    const std::size_t W = static_cast<std::size_t>(d_.width), C = static_cast<std::size_t>(d_.classes);
    a.a1.resize(B * W);
    a.z2.resize(B * h_);
    a.z3.resize(B * W);
    a.z4.resize(B * C);
    affine(x, static_cast<std::size_t>(d_.in), w1_, b1_.data(), W, a.a1);
    relu(a.a1);
    affine(a.a1, W, w2_, b2_.data(), h_, a.z2);
    a.a2 = a.z2;
    relu(a.a2);
    affine(a.a2, h_, w3_, nullptr, W, a.z3);  // this part's partial sum
    sum_over_parts(a.z3);                     // g
    for (std::size_t r = 0; r < B; ++r)
      for (std::size_t o = 0; o < W; ++o) a.z3[r * W + o] += b3_[o];
    a.a3 = a.z3;
    relu(a.a3);
    affine(a.a3, W, w4_, b4_.data(), C, a.z4);
  }

  std::vector<std::vector<float>*> values() { return {&w1_, &b1_, &w2_, &b2_, &w3_, &b3_, &w4_, &b4_}; }

  void sum_over_parts(std::vector<float>& v) {
    if (parts_ > 1)
      comm_->all_reduce(v.data(), v.data(), v.size(), lockstep::dtype::f32, lockstep::reduce_op::sum).wait();
  }
  // out[r, o] = b[o] + Σ_i w[o, i] · in[r, i]   (w: n_out × n_in, row-major)
  static void affine(std::span<const float> in, std::size_t n_in, const std::vector<float>& w, const float* b,
                     std::size_t n_out, std::vector<float>& out) {
    const std::size_t B = in.size() / n_in;
    for (std::size_t r = 0; r < B; ++r)
      for (std::size_t o = 0; o < n_out; ++o) {
        float s = b ? b[o] : 0.0f;
        const float* wr = w.data() + o * n_in;
        const float* xr = in.data() + r * n_in;
        for (std::size_t i = 0; i < n_in; ++i) s += wr[i] * xr[i];
        out[r * n_out + o] = s;
      }
  }
  static void relu(std::vector<float>& v) {
    for (auto& x : v) x = x > 0.0f ? x : 0.0f;
  }
  // d ← d where the layer's output was positive, else 0.
  static void mask(std::vector<float>& d, const std::vector<float>& act) {
    for (std::size_t k = 0; k < d.size(); ++k) d[k] = act[k] > 0.0f ? d[k] : 0.0f;
  }
  // gw[o, i] += Σ_r dout[r, o] · in[r, i];  gb[o] += Σ_r dout[r, o]
  static void accumulate(const std::vector<float>& dout, std::size_t n_out, std::span<const float> in, std::size_t n_in,
                         float* gw, float* gb) {
    const std::size_t B = dout.size() / n_out;
    for (std::size_t o = 0; o < n_out; ++o)
      for (std::size_t r = 0; r < B; ++r) {
        const float g = dout[r * n_out + o];
        gb[o] += g;
        const float* xr = in.data() + r * n_in;
        float* gr = gw + o * n_in;
        for (std::size_t i = 0; i < n_in; ++i) gr[i] += g * xr[i];
      }
  }
  // din[r, i] = Σ_o dout[r, o] · w[o, i]
  static void back(const std::vector<float>& dout, std::size_t n_out, const std::vector<float>& w, std::size_t n_in,
                   std::vector<float>& din) {
    const std::size_t B = dout.size() / n_out;
    std::fill(din.begin(), din.end(), 0.0f);
    for (std::size_t r = 0; r < B; ++r)
      for (std::size_t o = 0; o < n_out; ++o) {
        const float g = dout[r * n_out + o];
        const float* wr = w.data() + o * n_in;
        float* dr = din.data() + r * n_in;
        for (std::size_t i = 0; i < n_in; ++i) dr[i] += g * wr[i];
      }
  }

  dims d_;
  int part_, parts_;
  Comm* comm_;
  std::size_t h_ = 0;  // hidden units of this part
  std::vector<float> w1_, b1_, w2_, b2_, w3_, b3_, w4_, b4_;
  std::vector<std::vector<float>> grads_;
  std::vector<float*> gptr_;
};

}  // namespace hybrid
