#pragma once
// The hybrid (data × tensor parallel) property, one rank's part, for any splittable
// communicator (ThreadComm in tests/cpu/test_hybrid.cpp, MpiComm in tests/mpi/test_mpi_split.cpp):
// the tensor-parallel MLP of examples/04_hybrid trained on a mesh of replicas × parts ends
// with the parameters of the unsplit network trained on one rank with the global batch.
#include <cstdint>
#include <random>
#include <vector>

#include <lockstep/lockstep.hpp>

#include "../../examples/04_hybrid/tp_mlp.hpp"
#include "test_util.hpp"

namespace lockstep_test {

struct hybrid_data {
  hybrid::dims d{20, 12, 24, 5};  // 24 hidden units: 1, 2, 3 or 4 parts
  std::size_t n = 0;
  std::vector<float> x;
  std::vector<std::uint8_t> y;
};

inline hybrid_data make_hybrid_data(std::uint64_t seed, std::size_t n) {
  hybrid_data h;
  h.n = n;
  std::mt19937_64 rng(seed);
  h.x = random_vector<float>(n * static_cast<std::size_t>(h.d.in), rng, -2, 2);
  for (std::size_t i = 0; i < n; ++i)
    h.y.push_back(static_cast<std::uint8_t>(rng() % static_cast<std::uint64_t>(h.d.classes)));
  return h;
}

//! The batch of `replica` (of `replicas`, `batch` rows each) at step s: consecutive rows.
inline std::vector<std::size_t> hybrid_rows(const hybrid_data& h, int s, int replica, int replicas, std::size_t batch) {
  std::vector<std::size_t> rows;
  const std::size_t first =
      (static_cast<std::size_t>(s) * static_cast<std::size_t>(replicas) + static_cast<std::size_t>(replica)) * batch;
  for (std::size_t i = 0; i < batch; ++i) rows.push_back((first + i) % h.n);
  return rows;
}

inline void hybrid_batch(const hybrid_data& h, const std::vector<std::size_t>& rows, std::vector<float>& x,
                         std::vector<std::uint8_t>& y) {
  const auto in = static_cast<std::size_t>(h.d.in);
  x.clear();
  y.clear();
  for (auto r : rows) {
    x.insert(x.end(), h.x.begin() + static_cast<std::ptrdiff_t>(r * in),
             h.x.begin() + static_cast<std::ptrdiff_t>((r + 1) * in));
    y.push_back(h.y[r]);
  }
}

//! The unsplit network on one rank, batch replicas·batch per step.
template <class Comm>
std::vector<float> hybrid_reference(const hybrid_data& h, std::uint64_t seed, int replicas, std::size_t batch,
                                    int steps, float lr) {
  hybrid::TpMlp<Comm> m(h.d, 0, 1, nullptr, seed);
  std::vector<float> x;
  std::vector<std::uint8_t> y;
  for (int s = 0; s < steps; ++s) {
    std::vector<std::size_t> rows;
    for (int r = 0; r < replicas; ++r) {
      const auto mine = hybrid_rows(h, s, r, replicas, batch);
      rows.insert(rows.end(), mine.begin(), mine.end());
    }
    hybrid_batch(h, rows, x, y);
    for (auto p : m.parameters()) std::fill_n(static_cast<float*>(p.grad), p.numel(), 0.0f);
    m.forward_backward(x, y, [](std::size_t) {});
    m.sgd(lr);
  }
  return m.gathered_values();
}

//! This rank's part of the hybrid run: the whole network's values afterwards (gathered).
template <class Comm>
std::vector<float> hybrid_rank(lockstep::context<Comm>& ctx, const hybrid_data& h, std::uint64_t seed, int parts,
                               std::size_t batch, int steps, float lr) {
  auto mesh = lockstep::make_mesh(ctx, {.model_parallel = parts});
  hybrid::TpMlp<Comm> m(h.d, mesh.part(), mesh.parts(), &mesh.model, seed);
  lockstep::DataParallel dp(mesh.data, m);
  std::vector<float> x;
  std::vector<std::uint8_t> y;
  for (int s = 0; s < steps; ++s) {
    hybrid_batch(h, hybrid_rows(h, s, mesh.replica(), mesh.replicas(), batch), x, y);
    auto step = dp.step();
    m.forward_backward(x, y, step.on_gradient_ready());
    if (step.finish()) m.sgd(lr);
  }
  return m.gathered_values();
}

}  // namespace lockstep_test
