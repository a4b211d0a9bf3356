// The MPI headers' and docs/mpi.md's code blocks (verbatim between snippet markers, compared
// by check_snippets.py), run under mpirun on every rank. What a block presumes is defined
// around it; the checks after it test what it claims.
#include <cstdint>
#include <algorithm>
#include <random>
#include <span>
#include <vector>

#include <lockstep/lockstep.hpp>
#include <lockstep/mpi/mpi_comm.hpp>
#include <lockstep/mpi/run_mpi.hpp>
#include <lockstep/mpi/mpi_store.hpp>

#include "snippet_env.hpp"

namespace {

//! optimizer.update(model) that also keeps what it left in the model.
struct RecordingSgd {
  double lr = 0.05;
  int updates = 0;
  std::vector<float> last;
  void update(Mlp& m) {
    m.sgd(lr);
    ++updates;
    last = values_of(m);
  }
};

}  // namespace

TEST_SUITE("mpi") {

TEST_CASE("snippets: run(Mpi) with DataParallel (mpi/run_mpi.hpp, docs/mpi.md)") {
  std::uint64_t seed = lockstep_test::fresh_seed();  // rank 0's model wins: seeds may differ
  const auto my_batches = snippet_env::batches(3);
  RecordingSgd optimizer;
  // [snippet include/lockstep/mpi/run_mpi.hpp#1]
  // mpirun -np 4 ./train
  lockstep::run(lockstep::Mpi{}, [&](lockstep::context<lockstep::MpiComm>& ctx) {
    Mlp model(seed);
    lockstep::DataParallel dp(ctx, model);  // a Distributed<Mlp, MpiComm>
    for (auto& batch : my_batches) {
      auto step = dp.step();
      model.backward(batch, step.on_gradient_ready());
      if (step.finish()) optimizer.update(model);
    }
  });
  // [end snippet]
  auto world = lockstep::MpiComm::world();
  CHECK(optimizer.updates == 3);
  CHECK(same_on_every_rank(world, optimizer.last));

  const auto& train = snippet_env::table();
  const std::uint64_t epochs = 2;
  optimizer = RecordingSgd{};
  seed ^= 0x9e3779b97f4a7c15ull;
  // [snippet docs/mpi.md#1]
  // mpirun -np 4 ./train

  lockstep::run(lockstep::Mpi{}, [&](lockstep::context<lockstep::MpiComm>& ctx) {
    Mlp model(seed);
    lockstep::DataParallel dp(ctx, model);  // a DataParallel<Mlp, MpiComm>; rank 0's values everywhere
    lockstep::DistributedSampler sampler(train.size(), ctx, {.seed = 42});
    for (; sampler.epoch() < epochs; sampler.set_epoch(sampler.epoch() + 1))
      for (auto batch : sampler.batches(64)) {
        auto step = dp.step();
        model.backward(batch, step.on_gradient_ready());
        if (step.finish()) optimizer.update(model);
        sampler.advance(batch.size());
      }
  });
  // [end snippet]
  const std::size_t per_rank =
      (train.size() + static_cast<std::size_t>(world.size()) - 1) / static_cast<std::size_t>(world.size());
  CHECK(optimizer.updates == static_cast<int>(epochs * ((per_rank + 63) / 64)));
  CHECK(same_on_every_rank(world, optimizer.last));
}

TEST_CASE("snippets: MpiComm and MpiStore (mpi/mpi_comm.hpp, mpi/mpi_store.hpp)") {
  std::mt19937_64 rng(lockstep_test::fresh_seed());  // differs per rank
  std::vector<std::int64_t> count{static_cast<std::int64_t>(1 + rng() % 1000)};
  {
    auto world = lockstep::MpiComm::world();
    lockstep::detail::host_broadcast(world, count, 0);  // the same n on every rank
  }
  const auto n = static_cast<std::size_t>(count[0]);
  // [snippet include/lockstep/mpi/mpi_comm.hpp#1]
  auto comm = lockstep::MpiComm::world();  // MPI_Init_thread if not yet done
  std::vector<float> g(n, 1.0f);
  comm.all_reduce(g.data(), g.data(), n, lockstep::dtype::f32, lockstep::reduce_op::avg).wait();
  // [end snippet]
  CHECK(g == std::vector<float>(n, 1.0f));

  const auto id = lockstep_test::random_vector<float>(4, rng);
  const auto id_bytes = std::as_bytes(std::span(id));
  const auto local = lockstep_test::random_vector<float>(3, rng);
  const auto local_bytes = std::as_bytes(std::span(local));
  std::vector<std::byte> got, broadcast;
  {
    // [snippet include/lockstep/mpi/mpi_store.hpp#1]
    lockstep::MpiStore st;  // over MPI_COMM_WORLD
    if (st.rank() == 0) st.set("nccl_id", id_bytes);
    auto id = st.get("nccl_id");                    // every rank
    auto cfg = st.broadcast_bytes(0, local_bytes);  // or simply: rank 0's bytes
    // [end snippet]
    got = id;
    broadcast = cfg;
  }
  std::vector<float> root_id = id, root_local = local;  // rank 0's, the reference
  lockstep::detail::host_broadcast(comm, root_id, 0);
  lockstep::detail::host_broadcast(comm, root_local, 0);
  CHECK(std::ranges::equal(got, std::as_bytes(std::span(root_id))));
  CHECK(std::ranges::equal(broadcast, std::as_bytes(std::span(root_local))));
}

}  // TEST_SUITE
