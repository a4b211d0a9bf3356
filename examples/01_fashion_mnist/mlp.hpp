#pragma once
// The example's model: an MLP 784-256-128-10 with ReLU and softmax cross-entropy, written
// plainly on batch matrices. It meets lockstep::model: parameters() returns value/gradient
// views, backward *adds* into the gradients, bind_gradient(i, p) lets lockstep place
// gradient i in its arena (zero copy), and backward reports each gradient as final
// (last layer first) so its bucket can be reduced while earlier layers still compute.
//
// Weights are stored [in, out] (PyTorch's nn.Linear stores [out, in]) so that all three
// GEMMs — forward X·W, dW = Xᵀ·dY and dX = dY·Wᵀ — become C += A·B on row-major matrices
// (after cheap explicit transposes), looped i-k-j with a contiguous inner loop the
// compiler vectorises.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include <lockstep/core/parameter.hpp>
#include <lockstep/data/seeding.hpp>

namespace fmnist {

namespace detail {

// c_r[j] += a_r · b[j] for four rows at once: b is loaded once for four FMAs.
inline void axpy4(std::size_t n, float a0, float a1, float a2, float a3, const float* __restrict b,
                  float* __restrict c0, float* __restrict c1, float* __restrict c2, float* __restrict c3) {
  for (std::size_t j = 0; j < n; ++j) {
    const float bj = b[j];
    c0[j] += a0 * bj;
    c1[j] += a1 * bj;
    c2[j] += a2 * bj;
    c3[j] += a3 * bj;
  }
}

inline void axpy1(std::size_t n, float a, const float* __restrict b, float* __restrict c) {
  for (std::size_t j = 0; j < n; ++j) c[j] += a * b[j];
}

}  // namespace detail

// C[M×N] += A[M×K] · B[K×N]; all row-major and dense. Loop order i-k-j, four rows of C
// per pass over B (a K-row panel of B is re-read M/4 times, mostly from cache).
inline void gemm_acc(std::size_t M, std::size_t N, std::size_t K, const float* A, const float* B, float* C) {
  std::size_t i = 0;
  for (; i + 4 <= M; i += 4) {
    const float* a = A + i * K;
    float* c = C + i * N;
    for (std::size_t k = 0; k < K; ++k)
      detail::axpy4(N, a[k], a[K + k], a[2 * K + k], a[3 * K + k], B + k * N, c, c + N, c + 2 * N, c + 3 * N);
  }
  for (; i < M; ++i)
    for (std::size_t k = 0; k < K; ++k) detail::axpy1(N, A[i * K + k], B + k * N, C + i * N);
}

// out[c×r] = in[r×c]ᵀ, in tiles so both sides stay in cache.
inline void transpose(std::size_t r, std::size_t c, const float* in, float* out) {
  constexpr std::size_t t = 32;
  for (std::size_t i0 = 0; i0 < r; i0 += t)
    for (std::size_t j0 = 0; j0 < c; j0 += t)
      for (std::size_t i = i0; i < std::min(r, i0 + t); ++i)
        for (std::size_t j = j0; j < std::min(c, j0 + t); ++j) out[j * r + i] = in[i * c + j];
}

class Mlp {
 public:
  static constexpr std::array<std::size_t, 4> dims{784, 256, 128, 10};
  static constexpr std::size_t layers = 3;

  // Kaiming-uniform weights (U(±sqrt(6/in)), suited to ReLU), zero biases, drawn from
  // lockstep's SplitMix64 so every platform and standard library gives the same values.
  explicit Mlp(std::uint64_t seed) {
    lockstep::SplitMix64 rng(seed);
    for (std::size_t l = 0; l < layers; ++l) {
      const std::size_t in = dims[l], out = dims[l + 1];
      const double bound = std::sqrt(6.0 / static_cast<double>(in));
      w_[l].resize(in * out);
      for (auto& x : w_[l]) {
        const double u = static_cast<double>(rng.next() >> 11) * 0x1.0p-53;  // [0, 1)
        x = static_cast<float>((2.0 * u - 1.0) * bound);
      }
      b_[l].assign(out, 0.0f);
      gw_[l].assign(w_[l].size(), 0.0f);
      gb_[l].assign(out, 0.0f);
      gwp_[l] = gw_[l].data();
      gbp_[l] = gb_[l].data();
    }
  }

  // Order: fc1.weight, fc1.bias, fc2.weight, ... (index 2l: weight of layer l, 2l+1: bias).
  std::vector<lockstep::parameter> parameters() {
    std::vector<lockstep::parameter> ps;
    for (std::size_t l = 0; l < layers; ++l) {
      const std::string n = "fc" + std::to_string(l + 1);
      const auto in = static_cast<std::int64_t>(dims[l]), out = static_cast<std::int64_t>(dims[l + 1]);
      ps.push_back(lockstep::param<float>(n + ".weight", w_[l].data(), gwp_[l], {in, out}));
      ps.push_back(lockstep::param<float>(n + ".bias", b_[l].data(), gbp_[l], {out}));
    }
    return ps;
  }

  // lockstep's arena now holds gradient i; our own buffer for it is no longer used.
  void bind_gradient(std::size_t i, void* p) {
    auto* f = static_cast<float*>(p);
    if (i % 2 == 0) gwp_[i / 2] = f;
    else gbp_[i / 2] = f;
  }

  // Mean cross-entropy over a batch of B rows of x (B × 784) with labels y; adds the
  // gradient of that mean into the gradient buffers and calls ready(i) as gradient i
  // becomes final. Returns the mean loss.
  template <class Ready>
  double forward_backward(const float* x, const std::uint8_t* y, std::size_t B, Ready&& ready) {
    forward(x, B);
    constexpr std::size_t C = dims[3];
    delta_.resize(B * C);
    const float* logits = act_[3].data();
    double loss = 0.0;
    const float inv_b = 1.0f / static_cast<float>(B);
    for (std::size_t r = 0; r < B; ++r) {
      const float* z = logits + r * C;
      float m = z[0];
      for (std::size_t c = 1; c < C; ++c) m = std::max(m, z[c]);
      float e[C];
      float sum = 0.0f;
      for (std::size_t c = 0; c < C; ++c) sum += (e[c] = std::exp(z[c] - m));
      loss += std::log(static_cast<double>(sum)) - static_cast<double>(z[y[r]] - m);
      for (std::size_t c = 0; c < C; ++c) delta_[r * C + c] = (e[c] / sum - (c == y[r] ? 1.0f : 0.0f)) * inv_b;
    }
    for (std::size_t l = layers; l-- > 0;) {
      const std::size_t in = dims[l], out = dims[l + 1];
      const float* input = l == 0 ? x : act_[l].data();
      float* gb = gbp_[l];
      for (std::size_t r = 0; r < B; ++r) detail::axpy1(out, 1.0f, delta_.data() + r * out, gb);
      xt_.resize(in * B);
      transpose(B, in, input, xt_.data());
      gemm_acc(in, out, B, xt_.data(), delta_.data(), gwp_[l]);  // dW += inputᵀ · dY
      if (l > 0) {  // dX = dY · Wᵀ, then through the ReLU of the layer below
        wt_.resize(out * in);
        transpose(in, out, w_[l].data(), wt_.data());
        prev_.assign(B * in, 0.0f);
        gemm_acc(B, in, out, delta_.data(), wt_.data(), prev_.data());
        const float* a = act_[l].data();
        for (std::size_t k = 0; k < B * in; ++k) prev_[k] = a[k] > 0.0f ? prev_[k] : 0.0f;
      }
      ready(2 * l);  // both gradients of layer l are final: their bucket may go
      ready(2 * l + 1);
      if (l > 0) delta_.swap(prev_);
    }
    return loss / static_cast<double>(B);
  }

  // How many of the B rows of x the model classifies as their label.
  std::size_t count_correct(const float* x, const std::uint8_t* y, std::size_t B) {
    forward(x, B);
    constexpr std::size_t C = dims[3];
    std::size_t correct = 0;
    for (std::size_t r = 0; r < B; ++r) {
      const float* z = act_[3].data() + r * C;
      std::size_t best = 0;
      for (std::size_t c = 1; c < C; ++c)
        if (z[c] > z[best]) best = c;
      correct += best == y[r];
    }
    return correct;
  }

 private:
  // act_[l+1] = relu(act_[l] · W_l + b_l) (no ReLU on the logits); act_[0] is x itself.
  void forward(const float* x, std::size_t B) {
    for (std::size_t l = 0; l < layers; ++l) {
      const std::size_t in = dims[l], out = dims[l + 1];
      auto& y = act_[l + 1];
      y.resize(B * out);
      for (std::size_t r = 0; r < B; ++r)
        std::copy(b_[l].begin(), b_[l].end(), y.begin() + static_cast<std::ptrdiff_t>(r * out));
      gemm_acc(B, out, in, l == 0 ? x : act_[l].data(), w_[l].data(), y.data());
      if (l + 1 < layers)
        for (auto& v : y) v = v > 0.0f ? v : 0.0f;
    }
  }

  std::array<std::vector<float>, layers> w_, b_, gw_, gb_;
  std::array<float*, layers> gwp_{}, gbp_{};
  std::array<std::vector<float>, layers + 1> act_;  // activations of the last forward
  std::vector<float> delta_, prev_, xt_, wt_;       // backward workspace
};

}  // namespace fmnist
