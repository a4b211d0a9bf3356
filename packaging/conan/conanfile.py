"""Conan 2 recipe for lockstep, a header-only library (docs/install.md).

    conan create packaging/conan                     # from lockstep's source tree, no remote
    conan create packaging/conan -o "&:mpi=True"     # with lockstep::mpi

The package is lockstep's own `cmake --install` (headers and CMake package), so a consumer
uses it exactly as an installed lockstep: find_package(lockstep CONFIG COMPONENTS ...) and the
targets lockstep::lockstep, ::cuda, ::mpi, ::torch. The options cuda, mpi and torch put those
parts in (each must then be found when the package is made: the CUDA toolkit and NCCL, MPI,
libtorch, all from the system; Conan Center has no NCCL or libtorch); the package config looks
for them again where it is used, and names what is missing.
"""
import os
import re

from conan import ConanFile
from conan.errors import ConanInvalidConfiguration
from conan.tools.build import check_min_cppstd
from conan.tools.cmake import CMake, CMakeToolchain, cmake_layout
from conan.tools.files import copy, load

_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")


class LockstepConan(ConanFile):
    name = "lockstep"
    package_type = "header-library"
    description = "Header-only C++20/CUDA data-parallel training"
    topics = ("deep-learning", "data-parallel", "nccl", "cuda", "mpi", "header-only")
    settings = "os", "arch", "compiler", "build_type"
    options = {"cuda": [True, False], "mpi": [True, False], "torch": [True, False]}
    default_options = {"cuda": False, "mpi": False, "torch": False}
    no_copy_source = True

    def set_version(self):
        # The one place the version is written: include/lockstep/version.hpp.
        text = load(self, os.path.join(self.recipe_folder, "..", "..", "include", "lockstep", "version.hpp"))
        parts = [re.search(rf"^#define LOCKSTEP_VERSION_{p} (\d+)$", text, re.M) for p in ("MAJOR", "MINOR", "PATCH")]
        if not all(parts):
            raise ConanInvalidConfiguration("include/lockstep/version.hpp has no LOCKSTEP_VERSION_MAJOR/MINOR/PATCH")
        self.version = ".".join(m.group(1) for m in parts)

    def export_sources(self):
        root = os.path.join(self.recipe_folder, "..", "..")
        for pattern in ("CMakeLists.txt", "CHANGELOG.md", "README.md", "cmake/*", "include/*", "tools/*",
                        "packaging/debian/*"):
            copy(self, pattern, root, self.export_sources_folder)

    def layout(self):
        cmake_layout(self)

    def validate(self):
        if self.settings.get_safe("compiler.cppstd"):
            check_min_cppstd(self, 20)

    def package_id(self):
        self.info.clear()  # headers: one package for every compiler and build type

    def generate(self):
        tc = CMakeToolchain(self)
        for part in ("cuda", "mpi", "torch"):
            tc.cache_variables[f"LOCKSTEP_ENABLE_{part.upper()}"] = "ON" if self.options.get_safe(part) else "OFF"
        for what in ("TESTS", "EXAMPLES", "BENCH", "TOOLS"):
            tc.cache_variables[f"LOCKSTEP_BUILD_{what}"] = "OFF"
        tc.cache_variables["LOCKSTEP_INSTALL"] = "ON"
        tc.generate()

    def package(self):
        cmake = CMake(self)
        cmake.configure()
        cmake.install()

    def package_info(self):
        # The package's own lockstep-config.cmake, not one Conan writes: its components look for
        # their dependencies and explain what is missing (cmake/lockstep-config.cmake.in).
        self.cpp_info.set_property("cmake_find_mode", "none")
        self.cpp_info.builddirs = [os.path.join("lib", "cmake", "lockstep")]
        self.cpp_info.bindirs = []
        self.cpp_info.libdirs = []
