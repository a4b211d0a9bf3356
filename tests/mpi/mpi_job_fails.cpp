// A job that must end, not hang (driven by mpi_expect_failure, which checks the exit status,
// the message and the time):
//   throw: rank 1's body throws while the others wait for it in an all-reduce → run(Mpi{})
//          prints the error and MPI_Aborts the job after the grace period.
//   skip:  rank 1 returns without joining the others' all-reduce (no error on its side) →
//          the others' wait times out (LOCKSTEP_TIMEOUT) → timeout_error → MPI_Abort.
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <vector>

#include <lockstep/mpi/run_mpi.hpp>

int main(int argc, char** argv) {
  const bool skip = argc > 1 && std::strcmp(argv[1], "skip") == 0;
  lockstep::run(lockstep::Mpi{}, [&](lockstep::context<lockstep::MpiComm>& ctx) {
    std::vector<float> v(1000, 1.0f);
    ctx.comm().all_reduce(v.data(), v.data(), v.size(), lockstep::dtype::f32, lockstep::reduce_op::sum).wait();
    if (ctx.rank() == 1) {
      if (skip) return;
      throw std::runtime_error("deliberate failure on rank 1");
    }
    ctx.comm().all_reduce(v.data(), v.data(), v.size(), lockstep::dtype::f32, lockstep::reduce_op::sum).wait();
    std::printf("rank %d: second all-reduce completed, which it must not\n", ctx.rank());
  });
  return 0;
}
