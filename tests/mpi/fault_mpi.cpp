// The fault suite's quiet failures over MPI (driven by mpi_expect_failure, which checks the
// exit status, the message and the time). DataParallel over MpiComm labels each bucket's
// collective, so the order check (on by default; LOCKSTEP_DEBUG=1: before each call) names both sides:
//   skip:   rank 1 lets one bucket's all-reduce fall through (equal bucket sizes);
//   extra:  rank 1 runs a metrics all-reduce the others do not;
//   shapes: rank 1 rebuilds its model with another shape after two steps (caught locally).
#include <cstdio>
#include <cstring>
#include <random>
#include <span>
#include <string>
#include <vector>

#include <lockstep/lockstep.hpp>
#include <lockstep/mpi/run_mpi.hpp>

#include "fault_train.hpp"
#include "mlp.hpp"

namespace {

using Model = lockstep_test::TestMlp<float>;

struct SkipOne {
  int rank = -1, at = -1, seen = 0;
  lockstep::MpiComm::work reduce(lockstep::MpiComm& comm, void* data, std::size_t n, lockstep::dtype t) {
    if (comm.rank() == rank && seen++ == at) return {};
    return comm.all_reduce(data, data, n, t, lockstep::reduce_op::avg);
  }
};

using lockstep_test::train_sgd;

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  const std::vector<int> dims{8, 8, 8, 8, 8};
  const lockstep::BucketPolicy equal{.first_bytes = 256, .cap_bytes = 256, .rebuild_after_first_step = false};
  std::mt19937_64 rng(7);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> x(64);
  for (auto& v : x) v = u(rng);
  const std::vector<int> y{0, 1, 2, 3, 4, 5, 6, 7};
  lockstep::run(lockstep::Mpi{}, [&](lockstep::context<lockstep::MpiComm>& ctx) {
    Model m(dims, 7);
    if (mode == "skip") {
      lockstep::DataParallel dp(ctx, m, {.buckets = equal}, SkipOne{.rank = 1, .at = 11});
      train_sgd(m, dp, 4, x, y);
    } else {
      lockstep::DataParallel dp(ctx, m, {.buckets = equal});
      train_sgd(m, dp, 2, x, y);
      if (mode == "extra" && ctx.rank() == 1) {
        double acc[2] = {0.5, 1.0};
        lockstep::all_reduce_scalars(ctx.comm(), std::span<double>(acc), lockstep::reduce_op::sum);
      }
      if (mode == "shapes" && ctx.rank() == 1) m = Model({8, 8, 9, 8, 8}, 7);
      train_sgd(m, dp, 2, x, y);
    }
    std::printf("rank %d: training ended normally, which it must not\n", ctx.rank());
  });
  return 0;
}
