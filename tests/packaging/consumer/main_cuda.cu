// lockstep::cuda from the package: the CUDA headers compile with the flags lockstep::cuda
// carries, and the program links and runs against the CUDA runtime and NCCL. No GPU is
// needed: it only asks how many there are and which NCCL it got.
#include <lockstep/cuda.cuh>

#include <cstdio>
#include <type_traits>

int main() {
  static_assert(std::is_class_v<lockstep::NcclComm>);
  int version = 0;
  if (ncclGetVersion(&version) != ncclSuccess || version <= 0) {
    std::fprintf(stderr, "ncclGetVersion failed\n");
    return 1;
  }
  int gpus = 0;
  if (cudaGetDeviceCount(&gpus) != cudaSuccess) gpus = 0;  // no GPU or no driver: fine here
  std::printf("lockstep %s with NCCL %d, %d GPU(s): ok\n", lockstep::version_string, version, gpus);
  return 0;
}
