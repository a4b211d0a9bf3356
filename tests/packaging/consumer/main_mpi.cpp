// lockstep::mpi from the package: the MPI headers compile and the program links and runs
// against MPI. It runs without mpirun, so it only asks MPI whether it is initialized (allowed
// before MPI_Init) instead of starting it.
#include <lockstep/mpi.hpp>

#include <cstdio>
#include <type_traits>

int main() {
  static_assert(std::is_class_v<lockstep::MpiComm>);
  int initialized = 1;
  if (MPI_Initialized(&initialized) != MPI_SUCCESS || initialized) {
    std::fprintf(stderr, "MPI_Initialized failed or says yes before MPI_Init\n");
    return 1;
  }
  std::printf("lockstep %s with MPI %d.%d: ok\n", lockstep::version_string, MPI_VERSION, MPI_SUBVERSION);
  return 0;
}
