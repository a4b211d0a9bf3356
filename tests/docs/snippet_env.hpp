#pragma once
// What the code snippets of the docs and the headers presume, so that they compile and run
// verbatim: a model `Mlp` with `backward(batch, hook)`, an optimizer with `update(model)`,
// a data set `train`, a list of batches. The data are random, fresh per run (test_util's seed).
#include <cstddef>
#include <cstdint>
#include <random>
#include <span>
#include <vector>

#include <lockstep/lockstep.hpp>

#include "mlp.hpp"
#include "test_util.hpp"

namespace snippet_env {

inline constexpr int features = 6, classes = 3;

//! A classification table: rows of `features` floats and a label each.
struct Table {
  std::vector<float> x;
  std::vector<int> y;
  std::size_t size() const noexcept { return y.size(); }
};

//! One table per process (threads share it), drawn from a fresh seed.
inline const Table& table() {
  static const Table t = [] {
    std::mt19937_64 rng(lockstep_test::fresh_seed());
    Table d{lockstep_test::random_vector<float>(240 * features, rng), std::vector<int>(240)};
    for (auto& v : d.y) v = static_cast<int>(rng() % classes);
    return d;
  }();
  return t;
}

//! `n` batches of `rows` row indices.
inline std::vector<std::vector<std::size_t>> batches(std::size_t n, std::size_t rows = 8) {
  std::vector<std::vector<std::size_t>> out(n);
  for (std::size_t b = 0; b < n; ++b)
    for (std::size_t r = 0; r < rows; ++r) out[b].push_back((b * rows + r) % table().size());
  return out;
}

}  // namespace snippet_env

using Batch = std::span<const std::size_t>;

//! A small ReLU MLP over snippet_env::table(); backward adds the gradients of the mean loss
//! over the batch's rows and reports each one when it is final.
class Mlp {
 public:
  explicit Mlp(std::uint64_t seed) : net_({snippet_env::features, 8, snippet_env::classes}, seed) {}
  std::vector<lockstep::parameter> parameters() { return net_.parameters(); }
  void bind_gradient(std::size_t i, void* p) { net_.bind_gradient(i, p); }
  void unbind_gradients() { net_.unbind_gradients(); }
  double backward(Batch rows, lockstep::gradient_ready_fn ready, double loss_scale = 1.0) {
    const auto& t = snippet_env::table();
    return net_.forward_backward(t.x, t.y, rows, ready, loss_scale);
  }
  void sgd(double lr) { net_.sgd(lr); }

 private:
  lockstep_test::TestMlp<float> net_;
};

//! The model's parameter values, concatenated.
inline std::vector<float> values_of(Mlp& m) {
  std::vector<float> v;
  for (auto& p : m.parameters()) {
    const auto* x = static_cast<const float*>(p.value);
    v.insert(v.end(), x, x + p.numel());
  }
  return v;
}

//! Every rank's v equals rank 0's, bit for bit (a collective).
template <class Comm>
bool same_on_every_rank(Comm& comm, std::vector<float> v) {
  std::vector<float> root = v;
  lockstep::detail::host_broadcast(comm, root, 0);
  int differs = root == v ? 0 : 1;
  lockstep::detail::host_all_reduce(comm, std::span<int>(&differs, 1), lockstep::reduce_op::max);
  return differs == 0;
}

//! "optimizer.update(model)": plain SGD on the model's own gradient storage.
struct PlainSgd {
  double lr = 0.05;
  void update(Mlp& m) const { m.sgd(lr); }
};
