// Hybrid parallelism on CPU ranks: the tensor-parallel MLP of examples/04_hybrid on a mesh of
// replicas × parts (4 ranks as 2 × 2, 4 × 1, 1 × 4; 3 ranks as 3 × 1, 1 × 3; 6 as 2 × 3 and
// 3 × 2) ends with the parameters of the unsplit network trained with the global batch on one
// rank (fp32 ≤ 1e-5), every rank holding the same whole network.
#include <doctest/doctest.h>

#include <type_traits>
#include <utility>
#include <vector>

#include <lockstep/lockstep.hpp>

#include "equivalence.hpp"
#include "hybrid_check.hpp"
#include "mlp.hpp"
#include "test_util.hpp"

using namespace lockstep_test;

TEST_SUITE("cpu") {

TEST_CASE("hybrid: replicas x tensor-parallel parts equal the unsplit network") {
  const auto seed = fresh_seed();
  CAPTURE(seed);
  const auto h = make_hybrid_data(seed, 97);
  const std::size_t batch = 3;
  const int steps = 5;
  const float lr = 0.1f;
  for (auto [ranks, parts] : {std::pair{4, 2}, {4, 1}, {4, 4}, {3, 1}, {3, 3}, {6, 2}, {6, 3}}) {
    CAPTURE(ranks);
    CAPTURE(parts);
    const auto ref = hybrid_reference<lockstep::ThreadComm>(h, seed + 1, ranks / parts, batch, steps, lr);
    hybrid::TpMlp<lockstep::ThreadComm> init(h.d, 0, 1, nullptr, seed + 1);
    CHECK(max_rel_diff(init.gathered_values(), ref) > 1e-3);  // it trained
    std::vector<std::vector<float>> got(static_cast<std::size_t>(ranks));
    lockstep::run(lockstep::Threads{ranks}, [&](auto& ctx) {
      got[static_cast<std::size_t>(ctx.rank())] = hybrid_rank(ctx, h, seed + 1, parts, batch, steps, lr);
    });
    for (int r = 0; r < ranks; ++r) {
      CAPTURE(r);
      CHECK(max_rel_diff(got[static_cast<std::size_t>(r)], ref) <= 1e-5);
      CHECK(got[static_cast<std::size_t>(r)] == got[0]);
    }
  }
}

TEST_CASE("hybrid: the mesh's axes (parallel/mesh.hpp)") {
  using TpMlp = hybrid::TpMlp<lockstep::ThreadComm>;
  const hybrid::dims dims{20, 12, 24, 5};
  const std::uint64_t seed = fresh_seed();
  const std::size_t n = 40;
  // [snippet include/lockstep/parallel/mesh.hpp#1]
  lockstep::run(lockstep::Threads{4}, [&](auto& ctx) {
    auto mesh = lockstep::make_mesh(ctx, {.model_parallel = 2});   // 2 replicas × 2 parts
    TpMlp model(dims, mesh.part(), mesh.parts(), &mesh.model, seed);  // all-reduces on mesh.model
    lockstep::DataParallel dp(mesh.data, model);                      // averages over the replicas
    lockstep::DistributedSampler sampler(n, mesh.data, {.seed = 7});  // a batch per replica
    // [end snippet]
    CHECK(mesh.replica() == ctx.rank() / 2);  // consecutive ranks hold one replica's parts
    CHECK(mesh.part() == ctx.rank() % 2);
    CHECK(mesh.replicas() == 2);
    CHECK(dp.size() == 2);
    CHECK(sampler.batches(5).size() == n / 2 / 5);  // half the data per replica
    // [snippet include/lockstep/parallel/mesh.hpp#1]
  });
  // [end snippet]
}

TEST_CASE("hybrid: a model-parallel degree that does not divide the job is refused") {
  CHECK_THROWS_WITH_AS(lockstep::run(lockstep::Threads{4}, [](auto& ctx) { (void)lockstep::make_mesh(ctx, {.model_parallel = 3}); }),
                       doctest::Contains("model_parallel = 3 does not divide the 4 ranks"), lockstep::config_error);
}

TEST_CASE_TEMPLATE("hybrid: hierarchical reduction (within nodes - across - within) equals the flat all-reduce", T,
                   float, double) {
  const auto seed = fresh_seed();
  CAPTURE(seed);
  const auto d = make_data(seed, 211);
  const double tol = std::is_same_v<T, double> ? 1e-12 : 1e-6;
  for (auto [ranks, per_node] : {std::pair{4, 2}, {6, 3}, {6, 2}, {4, 4}, {3, 1}}) {
    CAPTURE(ranks);
    CAPTURE(per_node);
    std::vector<std::vector<T>> flat(static_cast<std::size_t>(ranks)), hier(flat.size());
    std::size_t flat_calls = 0, hier_calls = 0;  // rank 0's collectives on the whole job's communicator
    for (int pass = 0; pass < 2; ++pass)
      lockstep::run(lockstep::Threads{ranks}, [&](auto& ctx) {
        TestMlp<T> m(d.dims, seed + static_cast<std::uint64_t>(ctx.rank()));
        const lockstep::DataParallelOptions o{.buckets = {.first_bytes = 52 * sizeof(T), .cap_bytes = 97 * sizeof(T)}};
        const auto body = [&](auto& dp) {
          for (int s = 0; s < 4; ++s) {
            std::vector<std::size_t> rows;
            for (std::size_t i = 0; i < 3; ++i) rows.push_back((static_cast<std::size_t>(s * ranks + ctx.rank()) * 3 + i) % d.samples);
            auto st = dp.step();
            m.forward_backward(inputs<T>(d), d.y, rows, st.on_gradient_ready());
            if (st.finish()) m.sgd(0.2);
          }
        };
        if (pass == 0) {
          lockstep::DataParallel dp(ctx, m, o);
          const auto before = ctx.comm().sequence();
          body(dp);
          if (ctx.rank() == 0) flat_calls = ctx.comm().sequence() - before;
          flat[static_cast<std::size_t>(ctx.rank())] = m.flat_values();
        } else {
          lockstep::DataParallel dp(ctx, m, o, lockstep::Hierarchical(ctx.comm(), {.ranks_per_node = per_node}));
          const auto before = ctx.comm().sequence();
          body(dp);
          if (ctx.rank() == 0) hier_calls = ctx.comm().sequence() - before;
          hier[static_cast<std::size_t>(ctx.rank())] = m.flat_values();
        }
      });
    TestMlp<T> init(d.dims, seed);
    CHECK(max_rel_diff(init.flat_values(), flat[0]) > 1e-3);  // it trained
    CHECK(hier_calls < flat_calls);  // the buckets went through the node and cross-node communicators
    for (int r = 0; r < ranks; ++r) {
      CAPTURE(r);
      CHECK(hier[static_cast<std::size_t>(r)] == hier[0]);
      CHECK(max_rel_diff(hier[static_cast<std::size_t>(r)], flat[0]) <= tol);
    }
  }
}

TEST_CASE("hybrid: hierarchical reduction refuses a node size that does not divide the job") {
  CHECK_THROWS_WITH_AS(lockstep::run(lockstep::Threads{4}, [](auto& ctx) {
                         (void)lockstep::Hierarchical(ctx.comm(), {.ranks_per_node = 3});
                       }),
                       doctest::Contains("ranks_per_node = 3 does not divide the 4 ranks"), lockstep::config_error);
}

}  // TEST_SUITE
