# LockstepCuda.cmake — the CUDA/NCCL part of lockstep (target lockstep::cuda).
# Included by the top-level CMakeLists.txt after lockstep::lockstep exists.
#
#   LOCKSTEP_ENABLE_CUDA = AUTO (default): build it when a CUDA compiler is found
#                          ON:  CUDA, the toolkit and NCCL are required
#                          OFF: CPU only
# Sets LOCKSTEP_HAS_CUDA (ON/OFF) for the rest of the build, and defines
# lockstep_cuda_target_flags(<target>) for lockstep's own CUDA targets (tests, examples, bench).

set(LOCKSTEP_HAS_CUDA OFF)
lockstep_part_mode(CUDA "Build the CUDA/NCCL parts" _lockstep_cuda_mode)

if(NOT _lockstep_cuda_mode STREQUAL "OFF")
  # nvcc is often not on PATH (e.g. /usr/local/cuda/bin): look in the usual places before
  # CMake's own detection, unless the user already chose a compiler.
  if(NOT DEFINED CMAKE_CUDA_COMPILER AND NOT DEFINED ENV{CUDACXX})
    find_program(LOCKSTEP_NVCC nvcc
      HINTS "$ENV{CUDA_HOME}/bin" "$ENV{CUDA_PATH}/bin" "${CUDAToolkit_ROOT}/bin"
            "$ENV{CUDAToolkit_ROOT}/bin" /usr/local/cuda/bin)
    mark_as_advanced(LOCKSTEP_NVCC)
    if(LOCKSTEP_NVCC)
      set(CMAKE_CUDA_COMPILER "${LOCKSTEP_NVCC}" CACHE FILEPATH "CUDA compiler")
    endif()
  endif()

  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    set(LOCKSTEP_HAS_CUDA ON)
  elseif(_lockstep_cuda_mode STREQUAL "ON")
    message(FATAL_ERROR
      "LOCKSTEP_ENABLE_CUDA=ON but no CUDA compiler was found. Put nvcc on PATH, set CUDACXX "
      "or CMAKE_CUDA_COMPILER, or configure with -DLOCKSTEP_ENABLE_CUDA=OFF for a CPU-only build.")
  else()
    message(STATUS "lockstep: no CUDA compiler found; building the CPU parts only")
  endif()
endif()

if(LOCKSTEP_HAS_CUDA)
  # One architecture keeps compile times down (H100/H200 = 90); override with
  # -DCMAKE_CUDA_ARCHITECTURES=... or the CUDAARCHS environment variable.
  if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES AND NOT DEFINED ENV{CUDAARCHS})
    set(CMAKE_CUDA_ARCHITECTURES 90 CACHE STRING "CUDA architectures to build lockstep's CUDA code for")
  endif()
  enable_language(CUDA)
  find_package(CUDAToolkit REQUIRED)
  find_package(NCCL REQUIRED)   # cmake/FindNCCL.cmake (CMAKE_MODULE_PATH)
  message(STATUS "lockstep: CUDA ${CMAKE_CUDA_COMPILER_VERSION} (architectures: "
                 "${CMAKE_CUDA_ARCHITECTURES}), NCCL ${NCCL_VERSION} (${NCCL_LIBRARY})")

  add_library(lockstep_cuda INTERFACE)
  add_library(lockstep::cuda ALIAS lockstep_cuda)
  set_target_properties(lockstep_cuda PROPERTIES EXPORT_NAME cuda)
  target_link_libraries(lockstep_cuda INTERFACE lockstep::lockstep CUDA::cudart NCCL::NCCL)
  if("cuda_std_20" IN_LIST CMAKE_CUDA_COMPILE_FEATURES)
    target_compile_features(lockstep_cuda INTERFACE cuda_std_20)
  else()
    # CMake < 3.26 does not know nvcc's C++20 mode; ask for it directly.
    target_compile_options(lockstep_cuda INTERFACE $<$<COMPILE_LANGUAGE:CUDA>:-std=c++20>)
  endif()
  # LOCKSTEP_WITH_NVTX: NVTX ranges around each step (observe/detail/nvtx.hpp; NVTX3 is header-only,
  # in the toolkit's include directory, and loads a tool with dlopen only when one is attached).
  target_compile_definitions(lockstep_cuda INTERFACE LOCKSTEP_WITH_CUDA=1 LOCKSTEP_WITH_NVTX=1)
  # Device code in the headers may call constexpr host functions (size_of(dtype) and the like),
  # so every consumer that compiles them needs this, not just lockstep's own targets.
  target_compile_options(lockstep_cuda INTERFACE
    $<$<COMPILE_LANGUAGE:CUDA>:--expt-relaxed-constexpr>)

  if(LOCKSTEP_INSTALL)
    install(TARGETS lockstep_cuda EXPORT lockstepCudaTargets)
    install(EXPORT lockstepCudaTargets NAMESPACE lockstep::
            DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/lockstep)
    install(FILES ${CMAKE_CURRENT_LIST_DIR}/FindNCCL.cmake
            DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/lockstep)
  endif()
endif()

# Warnings for lockstep's own CUDA targets (not passed on to consumers). nvcc rejects -Wall
# itself, so host-compiler warnings go through -Xcompiler.
function(lockstep_cuda_target_flags target)
  if(CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
    target_compile_options(${target} PRIVATE
      $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Wall,-Wextra>
      $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra>)
  endif()
endfunction()

# CUDA code this build only needs to compile: the GPU tests, the CUDA benchmarks and the docs'
# CUDA units on a machine without GPUs (scripts/test.sh turns LOCKSTEP_CUDA_COMPILE_ONLY on
# there), and the header self-containment units always (ALWAYS). In the calling directory,
# its CUDA targets become unoptimised PTX of the first architecture: no ptxas, no optimiser,
# about a third less compile time. The library's consumers and the examples are not affected.
option(LOCKSTEP_CUDA_COMPILE_ONLY
       "Compile lockstep's GPU tests and CUDA benchmarks unoptimised, as PTX only (a machine that cannot run them)" OFF)
macro(lockstep_cuda_compile_only)
  if(LOCKSTEP_CUDA_COMPILE_ONLY OR "${ARGN}" STREQUAL "ALWAYS")
    foreach(_lockstep_config RELEASE RELWITHDEBINFO MINSIZEREL)
      string(REGEX REPLACE "(^| )-O[1-3s]( |$)" " -O0 " CMAKE_CUDA_FLAGS_${_lockstep_config}
                           "${CMAKE_CUDA_FLAGS_${_lockstep_config}}")
    endforeach()
    string(APPEND CMAKE_CUDA_FLAGS " -Xcicc=-O0")
    list(GET CMAKE_CUDA_ARCHITECTURES 0 _lockstep_first_arch)
    if(_lockstep_first_arch MATCHES "^([0-9]+[af]?)(-real|-virtual)?$")  # not native, all, all-major
      set(CMAKE_CUDA_ARCHITECTURES ${CMAKE_MATCH_1}-virtual)
    endif()
  endif()
endmacro()

unset(_lockstep_cuda_mode)
