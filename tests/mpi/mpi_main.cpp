// doctest main for the MPI tests: initialises MPI (lockstep finalizes it at exit), runs the
// same test cases in the same order on every rank (doctest's default file/line order), and
// makes every rank exit with the same status. Ranks other than 0 print failures only; no colours.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>
#include <mpi.h>

#include <lockstep/mpi/mpi_comm.hpp>

int main(int argc, char** argv) {
  lockstep::detail::mpi_init();
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  doctest::Context ctx;
  ctx.applyCommandLine(argc, argv);
  ctx.setOption("no-colors", true);  // logs go to ctest, and the ranks' lines interleave
  if (rank != 0) ctx.setOption("minimal", true);
  const int rc = ctx.run();
  if (ctx.shouldExit()) return rc;
  int worst = rc != 0 ? 1 : 0;
  MPI_Allreduce(MPI_IN_PLACE, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  return worst;
}
