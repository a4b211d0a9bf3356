#pragma once
// A real model for tests: a ReLU MLP with softmax cross-entropy, written plainly.
// Gradients are *added* (the lockstep::model contract); the backward reports each
// gradient as final, last layer first, when a hook is given.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <functional>
#include <limits>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <vector>

#include <lockstep/core/parameter.hpp>

namespace lockstep_test {

//! For forward_backward's `use`: no blocks to request (lockstep's full sharding requests them).
struct no_blocks {
  int operator()(std::size_t, bool) const { return 0; }
};

template <class T, bool Bindable = true>
class TestMlp {
 public:
  //! Full sharding (lockstep::model (h)): each parameter its own block instead of each layer.
  bool block_per_parameter = false;
  //! Full sharding (model (i)'s block_storage): where lent block buffers come from; empty (or
  //! returning null): lockstep's own memory space.
  std::function<std::shared_ptr<void>(std::size_t)> storage;
  std::shared_ptr<void> block_storage(std::size_t bytes) const { return storage ? storage(bytes) : nullptr; }

  TestMlp(std::vector<int> dims, std::uint64_t seed) : dims_(std::move(dims)) {
    std::mt19937_64 rng(seed);
    const std::size_t L = dims_.size() - 1;
    w_.resize(L);
    b_.resize(L);
    gw_.resize(L);
    gb_.resize(L);
    wp_.resize(L);
    bp_.resize(L);
    gwp_.resize(L);
    gbp_.resize(L);
    for (std::size_t l = 0; l < L; ++l) {
      const int in = dims_[l], out = dims_[l + 1];
      std::normal_distribution<double> nd(0.0, std::sqrt(2.0 / in));
      w_[l].resize(static_cast<std::size_t>(in * out));
      for (auto& x : w_[l]) x = static_cast<T>(nd(rng));
      b_[l].resize(static_cast<std::size_t>(out));
      for (auto& x : b_[l]) x = static_cast<T>(0.1 * nd(rng));
      gw_[l].assign(w_[l].size(), T(0));
      gb_[l].assign(b_[l].size(), T(0));
      wp_[l] = w_[l].data();
      bp_[l] = b_[l].data();
      gwp_[l] = gw_[l].data();
      gbp_[l] = gb_[l].data();
    }
  }

  std::vector<lockstep::parameter> parameters() {
    std::vector<lockstep::parameter> ps;
    for (std::size_t l = 0; l < w_.size(); ++l) {
      ps.push_back(
          lockstep::param<T>("layer" + std::to_string(l) + ".weight", wp_[l], gwp_[l], {dims_[l + 1], dims_[l]}));
      ps.push_back(lockstep::param<T>("layer" + std::to_string(l) + ".bias", bp_[l], gbp_[l], {dims_[l + 1]}));
    }
    return ps;
  }

  void bind_gradient(std::size_t i, void* p)
    requires Bindable
  {
    if (i % 2 == 0) gwp_[i / 2] = static_cast<T*>(p);
    else gbp_[i / 2] = static_cast<T*>(p);
  }
  //! Sharded (lockstep::model (e)): the values move into lockstep's storage, copied.
  void bind_value(std::size_t i, void* p)
    requires Bindable
  {
    T*& v = i % 2 == 0 ? wp_[i / 2] : bp_[i / 2];
    const std::size_t n = i % 2 == 0 ? w_[i / 2].size() : b_[i / 2].size();
    std::copy(v, v + n, static_cast<T*>(p));
    v = static_cast<T*>(p);
  }
  //! Full sharding (lockstep::model (h), (i)): the block of each parameter, and where its
  //! values and gradient are now (either may be null: not held, not touched).
  std::vector<std::size_t> blocks() const {
    std::vector<std::size_t> b;
    for (std::size_t i = 0; i < 2 * w_.size(); ++i) b.push_back(block_per_parameter ? i : i / 2);
    return b;
  }
  void attach(std::size_t i, void* v, void* g) {
    (i % 2 == 0 ? wp_[i / 2] : bp_[i / 2]) = static_cast<T*>(v);
    (i % 2 == 0 ? gwp_[i / 2] : gbp_[i / 2]) = static_cast<T*>(g);
  }

  //! lockstep::model (d): the gradients back in the model's own storage when DataParallel
  //! goes (a model wrapped again, e.g. after its job shrank, must not keep the old arena's).
  void unbind_gradients()
    requires Bindable
  {
    take_back(gwp_, gw_);
    take_back(gbp_, gb_);
  }

  void unbind_values()
    requires Bindable
  {
    take_back(wp_, w_);
    take_back(bp_, b_);
  }

  //! Mean cross-entropy over the rows `rows` of X (row-major, dims[0] wide); adds the
  //! gradient of that mean into the gradient buffers; calls hook(i) as gradients finish.
  //! use(l, forward) is held while layer l computes (full sharding requests its blocks).
  template <class Hook, class Use = no_blocks>
  double forward_backward(const std::vector<T>& X, const std::vector<int>& y, std::span<const std::size_t> rows,
                          Hook&& hook, double loss_scale = 1.0, Use&& use = {}) {
    const std::size_t L = w_.size(), B = rows.size();
    std::vector<std::vector<T>> act(L + 1);
    act[0].resize(B * dims_[0]);
    for (std::size_t r = 0; r < B; ++r)
      for (int j = 0; j < dims_[0]; ++j) act[0][r * dims_[0] + j] = X[rows[r] * dims_[0] + j];
    for (std::size_t l = 0; l < L; ++l) {
      [[maybe_unused]] const auto held = use(l, true);
      const int in = dims_[l], out = dims_[l + 1];
      act[l + 1].assign(B * out, T(0));
      for (std::size_t r = 0; r < B; ++r)
        for (int o = 0; o < out; ++o) {
          T s = bp_[l][o];
          for (int i = 0; i < in; ++i) s += wp_[l][o * in + i] * act[l][r * in + i];
          if (l + 1 < L) margin_ = std::min(margin_, static_cast<double>(std::abs(s)));
          act[l + 1][r * out + o] = (l + 1 < L && s < T(0)) ? T(0) : s;
        }
    }
    const int C = dims_.back();
    std::vector<T> delta(B * C);
    double loss = 0;
    for (std::size_t r = 0; r < B; ++r) {
      T m = act[L][r * C];
      for (int c = 1; c < C; ++c) m = std::max(m, act[L][r * C + c]);
      T z = 0;
      for (int c = 0; c < C; ++c) z += std::exp(act[L][r * C + c] - m);
      const int label = y[rows[r]];
      loss += -(static_cast<double>(act[L][r * C + label] - m) - std::log(static_cast<double>(z)));
      for (int c = 0; c < C; ++c)
        delta[r * C + c] = static_cast<T>((std::exp(act[L][r * C + c] - m) / z - (c == label ? 1 : 0)) * loss_scale /
                                          static_cast<double>(B));
    }
    for (std::size_t l = L; l-- > 0;) {
      [[maybe_unused]] const auto held = use(l, false);
      const int in = dims_[l], out = dims_[l + 1];
      T* gw = gwp_[l];
      T* gb = gbp_[l];
      std::vector<T> prev(B * in, T(0));
      for (std::size_t r = 0; r < B; ++r)
        for (int o = 0; o < out; ++o) {
          const T d = delta[r * out + o];
          gb[o] += d;
          for (int i = 0; i < in; ++i) {
            gw[o * in + i] += d * act[l][r * in + i];
            prev[r * in + i] += wp_[l][o * in + i] * d;
          }
        }
      hook(2 * l);
      hook(2 * l + 1);
      if (l > 0)
        for (std::size_t k = 0; k < prev.size(); ++k) prev[k] = act[l][k] > T(0) ? prev[k] : T(0);
      delta = std::move(prev);
    }
    return loss / static_cast<double>(B);
  }

  void sgd(double lr) {
    for (std::size_t l = 0; l < w_.size(); ++l) {
      for (std::size_t k = 0; k < w_[l].size(); ++k) wp_[l][k] -= static_cast<T>(lr) * gwp_[l][k];
      for (std::size_t k = 0; k < b_[l].size(); ++k) bp_[l][k] -= static_cast<T>(lr) * gbp_[l][k];
    }
  }
  void zero_grad() {
    for (std::size_t l = 0; l < w_.size(); ++l) {
      std::fill(gwp_[l], gwp_[l] + w_[l].size(), T(0));
      std::fill(gbp_[l], gbp_[l] + b_[l].size(), T(0));
    }
  }

  std::vector<T> flat_values() const {
    std::vector<T> v;
    for (std::size_t l = 0; l < w_.size(); ++l) {
      v.insert(v.end(), wp_[l], wp_[l] + w_[l].size());
      v.insert(v.end(), bp_[l], bp_[l] + b_[l].size());
    }
    return v;
  }
  std::vector<T> flat_grads() const {
    std::vector<T> v;
    for (std::size_t l = 0; l < w_.size(); ++l) {
      v.insert(v.end(), gwp_[l], gwp_[l] + w_[l].size());
      v.insert(v.end(), gbp_[l], gbp_[l] + b_[l].size());
    }
    return v;
  }
  const std::vector<int>& dims() const { return dims_; }
  //! The smallest |pre-activation| of a hidden unit in every forward so far. Another
  //! implementation (a GPU's summation order) may put one within its rounding of zero on the
  //! other side of the ReLU: a reference this close to a kink cannot be compared with to 1e-5
  //! (draw other data: relu_margin_needed, next_seed in test_util.hpp).
  double relu_margin() const { return margin_; }

 private:
  double margin_ = std::numeric_limits<double>::infinity();
  std::vector<int> dims_;
  std::vector<std::vector<T>> w_, b_, gw_, gb_;  // own storage
  std::vector<T*> wp_, bp_, gwp_, gbp_;          // what is used: own, or lockstep's once bound

  // What `used` points to copied into `own`, and `used` pointed there again.
  static void take_back(std::vector<T*>& used, std::vector<std::vector<T>>& own) {
    for (std::size_t l = 0; l < own.size(); ++l) {
      std::copy(used[l], used[l] + own[l].size(), own[l].begin());
      used[l] = own[l].data();
    }
  }
};

//! TestMlp with a frozen table (lockstep::model (g)): values that are never trained but must
//! be rank 0's on every rank (a frozen embedding), drawn from table_seed.
template <class T>
class TestMlpWithFrozen : public TestMlp<T> {
 public:
  TestMlpWithFrozen(std::vector<int> dims, std::uint64_t seed, std::uint64_t table_seed, std::size_t n = 37)
      : TestMlp<T>(std::move(dims), seed), table_(n) {
    std::mt19937_64 rng(table_seed);
    std::uniform_real_distribution<double> u(-1.0, 1.0);
    for (auto& x : table_) x = static_cast<T>(u(rng));
  }
  std::vector<lockstep::parameter> frozen() {
    const auto n = static_cast<std::int64_t>(table_.size());
    return {lockstep::param<T>("table", table_.data(), static_cast<T*>(nullptr), {n})};
  }
  const std::vector<T>& table() const { return table_; }

 private:
  std::vector<T> table_;
};

}  // namespace lockstep_test
