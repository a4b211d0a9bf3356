# Spack package of lockstep, kept in lockstep's own tree (docs/install.md). Put this file in a
# Spack repository of your own as packages/lockstep/package.py, with `git` pointing at your copy
# of lockstep:  spack repo create myrepo && cp package.py myrepo/packages/lockstep/
#               spack install lockstep+mpi
from spack.package import *


class Lockstep(CMakePackage, CudaPackage):
    """Header-only C++20/CUDA data-parallel training: one process driving every local GPU, or
    one process per GPU across machines, for any C++ model."""

    git = "https://example.org/lockstep.git"  # where your copy lives

    version("main", branch="main")

    variant("mpi", default=False, description="lockstep::mpi: MpiComm over MPI")
    variant("torch", default=False, description="lockstep::torch: the libtorch adapter")
    # +cuda (from CudaPackage): lockstep::cuda with NCCL

    depends_on("cxx", type="build")
    depends_on("cmake@3.25:", type="build")
    depends_on("nccl", when="+cuda")
    depends_on("mpi", when="+mpi")
    depends_on("py-torch", when="+torch")
    conflicts("%gcc@:11", msg="lockstep needs C++20 (GCC 12 or later)")

    def cmake_args(self):
        return [
            self.define_from_variant("LOCKSTEP_ENABLE_CUDA", "cuda"),
            self.define_from_variant("LOCKSTEP_ENABLE_MPI", "mpi"),
            self.define_from_variant("LOCKSTEP_ENABLE_TORCH", "torch"),
            self.define("LOCKSTEP_BUILD_TESTS", False),
            self.define("LOCKSTEP_BUILD_EXAMPLES", False),
            self.define("LOCKSTEP_BUILD_BENCH", False),
        ]
