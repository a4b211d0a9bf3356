// MpiComm::split (MPI_Comm_split): sub-communicators of uneven sizes pass the conformance
// suite and are ranked by key; the tensor-parallel MLP of examples/04_hybrid on a mesh of
// processes equals the unsplit network trained on one rank; hierarchical reduction equals flat.
#include <doctest/doctest.h>

#include <cstdint>
#include <type_traits>
#include <vector>

#include <lockstep/lockstep.hpp>
#include <lockstep/mpi/mpi_comm.hpp>
#include <lockstep/mpi/run_mpi.hpp>

#include "comm_conformance.hpp"
#include "equivalence.hpp"
#include "hybrid_check.hpp"
#include "mlp.hpp"
#include "mpi_util.hpp"

using namespace lockstep_mpi_test;
using namespace lockstep_test;

TEST_SUITE("mpi") {

TEST_CASE("MpiComm split: uneven sub-communicators pass the conformance suite - ranked by key") {
  auto world = lockstep::MpiComm::world();
  const int r = world.rank(), n = world.size();
  const int color = r == 0 ? 0 : 1;   // sizes 1 and n − 1
  auto sub = world.split(color, -r);  // reverse order
  CHECK(sub.size() == (color == 0 ? 1 : n - 1));
  std::vector<std::int64_t> ranks(static_cast<std::size_t>(sub.size()));
  const std::int64_t me = r;
  sub.all_gather(&me, ranks.data(), 1, lockstep::dtype::i64).wait();
  for (std::size_t k = 0; k < ranks.size(); ++k)
    CHECK(ranks[k] == (color == 0 ? 0 : n - 1 - static_cast<std::int64_t>(k)));
  conformance_options o;
  o.seed = shared_seed();
  if (sub.size() > 1) check_collectives(sub, o);  // one rank alone has nothing to disagree with
  auto pairs = world.split(r / 2, r);             // nested use: halves of the world
  CHECK(pairs.size() == 2);
  check_all_reduce(pairs, o);
}

TEST_CASE("hybrid over MPI: replicas x tensor-parallel parts equal the unsplit network") {
  lockstep::run(lockstep::Mpi{}, [](lockstep::context<lockstep::MpiComm>& ctx) {
    const auto seed = shared_seed();
    CAPTURE(seed);
    const auto h = make_hybrid_data(seed, 97);
    for (int parts = 1; parts <= ctx.size(); parts *= 2) {
      CAPTURE(parts);
      const auto ref = hybrid_reference<lockstep::MpiComm>(h, seed + 1, ctx.size() / parts, 3, 5, 0.1f);
      const auto got = hybrid_rank(ctx, h, seed + 1, parts, 3, 5, 0.1f);
      CHECK(max_rel_diff(got, ref) <= 1e-5);
      CHECK(same_on_all_ranks(got));
    }
  });
}

TEST_CASE("hybrid over MPI: hierarchical reduction equals the flat all-reduce") {
  lockstep::run(lockstep::Mpi{}, [](lockstep::context<lockstep::MpiComm>& ctx) {
    const auto seed = shared_seed();
    CAPTURE(seed);
    const auto d = make_data(seed, 211);
    for (int per_node : {1, 2}) {
      CAPTURE(per_node);
      std::vector<double> got[2];
      for (int pass = 0; pass < 2; ++pass) {
        TestMlp<double> m(d.dims, seed + static_cast<std::uint64_t>(ctx.rank()));
        const lockstep::DataParallelOptions o{.buckets = {.first_bytes = 52 * 8, .cap_bytes = 97 * 8}};
        auto body = [&](auto& dp) {
          for (int s = 0; s < 4; ++s) {
            std::vector<std::size_t> rows;
            for (std::size_t i = 0; i < 3; ++i)
              rows.push_back((static_cast<std::size_t>(s * ctx.size() + ctx.rank()) * 3 + i) % d.samples);
            auto st = dp.step();
            m.forward_backward(d.X64, d.y, rows, st.on_gradient_ready());
            if (st.finish()) m.sgd(0.2);
          }
        };
        if (pass == 0) {
          lockstep::DataParallel dp(ctx, m, o);
          body(dp);
        } else {
          lockstep::DataParallel dp(ctx, m, o, lockstep::Hierarchical(ctx.comm(), {.ranks_per_node = per_node}));
          body(dp);
        }
        got[pass] = m.flat_values();
      }
      CHECK(max_rel_diff(got[1], got[0]) <= 1e-12);
      CHECK(same_on_all_ranks(got[1]));
    }
  });
}

TEST_CASE("hybrid over MPI: run(Hybrid) over Mpi - each process's replica and part - the two axes' reductions") {
  const int parts = 2;  // np 2: 1 replica × 2 parts; np 4: 2 × 2
  lockstep::run(lockstep::Hybrid{.model_parallel = parts, .inner = lockstep::Mpi{}}, [&](auto& mesh) {
    static_assert(std::is_same_v<std::remove_cvref_t<decltype(mesh)>, lockstep::Mesh<lockstep::MpiComm>>);
    const int r = mesh.world().rank(), n = mesh.world().size();
    CHECK(mesh.replica() == r / parts);
    CHECK(mesh.part() == r % parts);
    CHECK(mesh.replicas() == n / parts);
    CHECK(mesh.parts() == parts);
    double v = r + 1;  // data axis: ranks part, part + parts, ... averaged
    mesh.data.comm().all_reduce(&v, &v, 1, lockstep::dtype::f64, lockstep::reduce_op::avg).wait();
    double avg = 0;
    for (int k = 0; k < n / parts; ++k) avg += k * parts + r % parts + 1;
    CHECK(v == doctest::Approx(avg / (n / parts)));
    double w = r + 1;  // model axis: one replica's ranks summed
    mesh.model.all_reduce(&w, &w, 1, lockstep::dtype::f64, lockstep::reduce_op::sum).wait();
    CHECK(w == (r / parts) * parts * 2 + 3);  // (2k+1) + (2k+2)
  });
}

}  // TEST_SUITE
