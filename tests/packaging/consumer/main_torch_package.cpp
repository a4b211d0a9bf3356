// lockstep::torch from an installed package (find_package(lockstep COMPONENTS torch), no
// find_package(Torch) of the project's own): lockstep's and libtorch's headers are on the
// include path, LOCKSTEP_WITH_TORCH is defined, and the program links and runs against the
// libtorch the package found. Cheap on purpose: libtorch's small headers only (main_torch.cpp,
// built through add_subdirectory, trains with TorchModule).
#include <lockstep/version.hpp>

#include <torch/cuda.h>
#include <torch/version.h>

#include <cstdio>

#if !defined(LOCKSTEP_WITH_TORCH) || LOCKSTEP_WITH_TORCH != 1
#error "lockstep::torch did not define LOCKSTEP_WITH_TORCH=1"
#endif

int main() {
  const auto gpus = torch::cuda::device_count();  // a call into libtorch: 0 on a CPU build
  std::printf("lockstep %s with libtorch %s (%zu CUDA device(s)): ok\n", lockstep::version_string, TORCH_VERSION,
              static_cast<std::size_t>(gpus));
  return 0;
}
