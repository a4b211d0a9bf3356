// Hybrid parallelism on CPU ranks: the tensor-parallel MLP of examples/04_hybrid on a mesh of
// replicas × parts (4 ranks as 2 × 2, 4 × 1, 1 × 4; 3 ranks as 3 × 1, 1 × 3; 6 as 2 × 3 and
// 3 × 2) ends with the parameters of the unsplit network trained with the global batch on one
// rank (fp32 ≤ 1e-5), every rank holding the same whole network. run(Hybrid{...}) builds the
// mesh itself: its axes, DataParallel over the data axis, the model axis's sums,
// LOCKSTEP_MODEL_PARALLEL, and a degree that does not divide the job.
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <lockstep/lockstep.hpp>

#include "equivalence.hpp"
#include "equivalence_run.hpp"
#include "hybrid_check.hpp"
#include "mlp.hpp"
#include "test_util.hpp"

using namespace lockstep_test;

namespace {

//! Sets (value) or unsets (nullptr) an environment variable for a scope; restores it after.
class scoped_env {
 public:
  scoped_env(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    if (value) ::setenv(name, value, 1);
    else ::unsetenv(name);
  }
  ~scoped_env() {
    if (old_) ::setenv(name_, old_->c_str(), 1);
    else ::unsetenv(name_);
  }
  scoped_env(const scoped_env&) = delete;
  scoped_env& operator=(const scoped_env&) = delete;

 private:
  const char* name_;
  std::optional<std::string> old_;
};

//! One parameter whose gradient the test sets by hand.
struct Flat {
  std::vector<float> w = std::vector<float>(8, 0.5f), gw = std::vector<float>(8, 0.0f);
  std::vector<lockstep::parameter> parameters() { return {lockstep::param<float>("w", std::span(w), std::span(gw))}; }
};

//! What each rank of a run(Hybrid) saw: its place in the mesh and the two axes' results.
struct seen {
  int world_rank = -1, world_size = 0, replica = -1, replicas = 0, part = -1, parts = 0;
  float data_avg = 0, model_sum = 0;
};

//! run(mode, body) where body records what every rank saw; a DataParallel step over mesh.data
//! averages the gradient 10·(world rank) + 1, an all-reduce over mesh.model sums world rank + 1.
template <class Mode>
std::vector<seen> run_and_record(Mode mode, int ranks) {
  std::vector<seen> out(static_cast<std::size_t>(ranks));
  lockstep::run(mode, [&](auto& mesh) {
    static_assert(std::is_same_v<std::remove_cvref_t<decltype(mesh)>, lockstep::Mesh<lockstep::ThreadComm>>);
    const int r = mesh.world().rank();
    seen& s = out[static_cast<std::size_t>(r)];
    s = {r, mesh.world().size(), mesh.replica(), mesh.replicas(), mesh.part(), mesh.parts()};
    Flat model;
    lockstep::DataParallel dp(mesh.data, model);
    auto step = dp.step();
    std::fill(model.gw.begin(), model.gw.end(), 10.0f * static_cast<float>(r) + 1.0f);
    step.finish();
    s.data_avg = model.gw[3];
    float v = static_cast<float>(r + 1);
    mesh.model.all_reduce(&v, &v, 1, lockstep::dtype::f32, lockstep::reduce_op::sum).wait();
    s.model_sum = v;
  });
  return out;
}

}  // namespace

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
    auto mesh = lockstep::make_mesh(ctx, {.model_parallel = 2});      // 2 replicas × 2 parts
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
  CHECK_THROWS_WITH_AS(
      lockstep::run(lockstep::Threads{4}, [](auto& ctx) { (void)lockstep::make_mesh(ctx, {.model_parallel = 3}); }),
      doctest::Contains("model_parallel = 3 does not divide the 4 ranks"), lockstep::config_error);
}

TEST_CASE("hybrid: run(Hybrid) over threads - each rank's replica and part - data axis averages replicas only - model "
          "axis sums parts only") {
  for (auto [ranks, parts] : {std::pair{4, 2}, {4, 1}, {4, 4}, {6, 3}}) {
    CAPTURE(ranks);
    CAPTURE(parts);
    const auto got =
        run_and_record(lockstep::Hybrid{.model_parallel = parts, .inner = lockstep::Threads{ranks}}, ranks);
    const int replicas = ranks / parts;
    for (int r = 0; r < ranks; ++r) {
      CAPTURE(r);
      const seen& s = got[static_cast<std::size_t>(r)];
      CHECK(s.world_rank == r);
      CHECK(s.world_size == ranks);
      CHECK(s.replica == r / parts);  // consecutive ranks hold one replica's parts
      CHECK(s.part == r % parts);
      CHECK(s.replicas == replicas);
      CHECK(s.parts == parts);
      // data axis: ranks part, part + parts, ... → mean of 10·rank + 1 over them
      float avg = 0;
      for (int k = 0; k < replicas; ++k) avg += 10.0f * static_cast<float>(k * parts + r % parts) + 1.0f;
      CHECK(s.data_avg == doctest::Approx(avg / static_cast<float>(replicas)));
      // model axis: ranks replica·parts … +parts−1 → sum of rank + 1 over them
      float sum = 0;
      for (int k = 0; k < parts; ++k) sum += static_cast<float>((r / parts) * parts + k + 1);
      CHECK(s.model_sum == sum);
    }
  }
}

TEST_CASE("hybrid: Hybrid{} reads LOCKSTEP_MODEL_PARALLEL - default 1 - the code's degree wins") {
  {
    scoped_env unset("LOCKSTEP_MODEL_PARALLEL", nullptr);
    const auto got = run_and_record(lockstep::Hybrid{.inner = lockstep::Threads{4}}, 4);
    CHECK(got[2].parts == 1);  // a model axis of one rank: plain data parallelism
    CHECK(got[2].replicas == 4);
    CHECK(got[2].data_avg == doctest::Approx(16.0f));
  }
  {
    scoped_env two("LOCKSTEP_MODEL_PARALLEL", "2");
    const auto got = run_and_record(lockstep::Hybrid{.inner = lockstep::Threads{4}}, 4);
    CHECK(got[3].parts == 2);
    CHECK(got[3].part == 1);
    CHECK(got[3].replica == 1);
    CHECK(got[3].model_sum == 7.0f);  // ranks 2 and 3
    const auto mine = run_and_record(lockstep::Hybrid{.model_parallel = 4, .inner = lockstep::Threads{4}}, 4);
    CHECK(mine[3].parts == 4);
  }
}

TEST_CASE("hybrid: the run(Hybrid) code of docs/hybrid.md and lockstep/run.hpp") {
  using TpMlp = hybrid::TpMlp<lockstep::ThreadComm>;
  const hybrid::dims dims{20, 12, 24, 5};
  const std::uint64_t seed = fresh_seed();
  const std::size_t n = 40;
  std::atomic<int> ranks{0};
  // [snippet include/lockstep/run.hpp#1]
  lockstep::run(lockstep::Hybrid{.model_parallel = 2, .inner = lockstep::Threads{4}}, [&](auto& mesh) {
    TpMlp model(dims, mesh.part(), mesh.parts(), &mesh.model, seed);  // 2 parts per replica
    lockstep::DataParallel dp(mesh.data, model);                      // averages over 2 replicas
    // [end snippet]
    CHECK(dp.size() == 2);
    ++ranks;
    // [snippet include/lockstep/run.hpp#1]
  });
  // [end snippet]
  CHECK(ranks == 4);
  // [snippet docs/hybrid.md#1]
  lockstep::run(lockstep::Hybrid{.model_parallel = 2, .inner = lockstep::Threads{4}}, [&](auto& mesh) {
    TpMlp model(dims, mesh.part(), mesh.parts(), &mesh.model, seed);  // all-reduces on mesh.model
    lockstep::DataParallel dp(mesh.data, model);                      // averages over the 2 replicas
    lockstep::DistributedSampler sampler(n, mesh.data, {.seed = 7});  // a batch per replica
    if (mesh.world().is_root()) std::printf("%d replicas x %d parts\n", mesh.replicas(), mesh.parts());
    // [end snippet]
    CHECK(sampler.batches(5).size() == n / 2 / 5);
    // [snippet docs/hybrid.md#1]
  });
  // [end snippet]
  scoped_env cpu_ranks("LOCKSTEP_CPU_RANKS", "4");
  for (const char* m : {"2", static_cast<const char*>(nullptr)}) {
    scoped_env model_parallel("LOCKSTEP_MODEL_PARALLEL", m);
    ranks = 0;
    // [snippet docs/hybrid.md#2]
    // LOCKSTEP_MODEL_PARALLEL=2 LOCKSTEP_CPU_RANKS=4 ./train   → 2 replicas × 2 parts
    // LOCKSTEP_CPU_RANKS=4 ./train                             → 4 replicas × 1 part
    lockstep::run(lockstep::Hybrid{}, [&](auto& mesh) {
      TpMlp model(dims, mesh.part(), mesh.parts(), &mesh.model, seed);
      lockstep::DataParallel dp(mesh.data, model);
      // [end snippet]
      CHECK(mesh.parts() == (m ? 2 : 1));
      CHECK(dp.size() == (m ? 2 : 4));
      ++ranks;
      // [snippet docs/hybrid.md#2]
    });
    // [end snippet]
    CHECK(ranks == 4);
  }
}

TEST_CASE("hybrid: a malformed LOCKSTEP_MODEL_PARALLEL or a negative degree is refused before any rank starts") {
  for (const char* bad : {"two", "0", "-2", "5000"}) {
    CAPTURE(bad);
    scoped_env e("LOCKSTEP_MODEL_PARALLEL", bad);
    CHECK_THROWS_WITH_AS(lockstep::run(lockstep::Hybrid{.inner = lockstep::Threads{2}}, [](auto&) {}),
                         doctest::Contains("LOCKSTEP_MODEL_PARALLEL"), lockstep::config_error);
  }
  CHECK_THROWS_WITH_AS(
      lockstep::run(lockstep::Hybrid{.model_parallel = -1, .inner = lockstep::Threads{2}}, [](auto&) {}),
      doctest::Contains("a negative degree"), lockstep::config_error);
}

TEST_CASE("hybrid: run(Auto) refuses LOCKSTEP_MODEL_PARALLEL above 1 - its body takes a context") {
  scoped_env ranks("LOCKSTEP_CPU_RANKS", "2");
  {
    scoped_env m("LOCKSTEP_MODEL_PARALLEL", "2");
    bool ran = false;
    CHECK_THROWS_WITH_AS(lockstep::run(lockstep::Auto{}, [&](auto&) { ran = true; }), doctest::Contains("run(Hybrid{}"),
                         lockstep::config_error);
    CHECK(!ran);
  }
  scoped_env one("LOCKSTEP_MODEL_PARALLEL", "1");  // a model axis of one asks for nothing
  std::atomic<int> ran{0};
  lockstep::run(lockstep::Auto{}, [&](auto& ctx) { ran += ctx.size(); });
  CHECK(ran == 4);
}

TEST_CASE("hybrid: a degree that does not divide the job fails on every rank - no hang") {
  std::atomic<int> failed{0};
  lockstep::run(lockstep::Threads{4}, [&](auto& ctx) {  // what each rank of run(Hybrid) does first
    try {
      (void)lockstep::make_mesh(ctx, {.model_parallel = 3});
    } catch (const lockstep::config_error&) {
      ++failed;
    }
  });
  CHECK(failed == 4);
  const auto t0 = std::chrono::steady_clock::now();
  bool ran = false;
  CHECK_THROWS_WITH_AS(
      lockstep::run(lockstep::Hybrid{.model_parallel = 3, .inner = lockstep::Threads{4}}, [&](auto&) { ran = true; }),
      doctest::Contains("model_parallel = 3 does not divide the 4 ranks"), lockstep::config_error);
  {
    scoped_env e("LOCKSTEP_MODEL_PARALLEL", "3");
    CHECK_THROWS_WITH_AS(lockstep::run(lockstep::Hybrid{.inner = lockstep::Threads{4}}, [&](auto&) { ran = true; }),
                         doctest::Contains("the degree came from LOCKSTEP_MODEL_PARALLEL=3"), lockstep::config_error);
  }
  CHECK(!ran);
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(10));  // not LOCKSTEP_TIMEOUT
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
            auto st = dp.step();
            m.forward_backward(inputs<T>(d), d.y, rank_rows(d, 3, ranks, ctx.rank(), s), st.on_gradient_ready());
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
    if (per_node > 1 && per_node < ranks)
      CHECK(hier_calls < flat_calls);      // the buckets went through the node and cross-node communicators
    else CHECK(hier_calls == flat_calls);  // one rank per node, or one node: the flat all-reduce
    for (int r = 0; r < ranks; ++r) {
      CAPTURE(r);
      CHECK(hier[static_cast<std::size_t>(r)] == hier[0]);
      CHECK(max_rel_diff(hier[static_cast<std::size_t>(r)], flat[0]) <= tol);
    }
  }
}

TEST_CASE("hybrid: hierarchical reduction refuses a node size that does not divide the job") {
  CHECK_THROWS_WITH_AS(
      lockstep::run(lockstep::Threads{4},
                    [](auto& ctx) { (void)lockstep::Hierarchical(ctx.comm(), {.ranks_per_node = 3}); }),
      doctest::Contains("ranks_per_node = 3 does not divide the 4 ranks"), lockstep::config_error);
}

}  // TEST_SUITE
