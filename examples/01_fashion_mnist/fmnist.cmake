# Shared by examples 01 and 02 (included from their CMakeLists.txt, standalone or in lockstep's
# tree): the options, the GPU path's set-up and the settings of a Fashion-MNIST executable.
option(FASHION_MNIST_CUDA "Build the GPU path when lockstep::cuda is available" ON)
# Off by default so the binary runs on any x86-64; on makes the GEMMs use AVX2/AVX-512.
option(FASHION_MNIST_NATIVE "Compile the example with -march=native" OFF)
set(FMNIST_DIR ${CMAKE_CURRENT_LIST_DIR})
if(PROJECT_IS_TOP_LEVEL AND NOT CMAKE_BUILD_TYPE AND NOT CMAKE_CONFIGURATION_TYPES)
  set(CMAKE_BUILD_TYPE Release CACHE STRING "Build type" FORCE)  # the GEMMs need -O2/-O3
endif()

# fmnist_gpu_setup(<var>): <var> ON when the GPU path can be built (FASHION_MNIST_CUDA on and
# lockstep::cuda there); then CUDA is enabled (sm_90 unless CMAKE_CUDA_ARCHITECTURES or
# CUDAARCHS say otherwise) and cuBLAS found, in a standalone build too.
macro(fmnist_gpu_setup out_var)
  set(${out_var} OFF)
  if(FASHION_MNIST_CUDA AND TARGET lockstep::cuda)
    set(${out_var} ON)
    get_property(_fm_languages GLOBAL PROPERTY ENABLED_LANGUAGES)
    if(NOT "CUDA" IN_LIST _fm_languages)  # standalone build: lockstep's tree enables it itself
      if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES AND NOT DEFINED ENV{CUDAARCHS})
        set(CMAKE_CUDA_ARCHITECTURES 90 CACHE STRING "CUDA architectures (H100/H200: 90)")
      endif()
      enable_language(CUDA)
    endif()
    if(NOT TARGET CUDA::cublas)
      find_package(CUDAToolkit REQUIRED)
    endif()
  endif()
endmacro()

# fmnist_target(<target> <with_gpu>): C++20, lockstep and zlib, warnings, FASHION_MNIST_NATIVE;
# with_gpu adds example 01's GPU trainer (gpu_train.cu, cuBLAS) and FASHION_MNIST_WITH_GPUS=1.
function(fmnist_target target with_gpu)
  target_link_libraries(${target} PRIVATE lockstep::lockstep ZLIB::ZLIB)
  target_compile_features(${target} PRIVATE cxx_std_20)
  if(with_gpu)
    # The GPU trainer is one translation unit shared by examples 01 and 02: compiled once.
    if(NOT TARGET fmnist_gpu_train)
      add_library(fmnist_gpu_train OBJECT ${FMNIST_DIR}/gpu_train.cu ${FMNIST_DIR}/gpu_train.hpp ${FMNIST_DIR}/gpu_mlp.cuh)
      target_link_libraries(fmnist_gpu_train PUBLIC lockstep::lockstep lockstep::cuda CUDA::cublas)
      target_compile_features(fmnist_gpu_train PUBLIC cxx_std_20)
      target_compile_definitions(fmnist_gpu_train PUBLIC FASHION_MNIST_WITH_GPUS=1)
      if(CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
        target_compile_options(fmnist_gpu_train PRIVATE -Xcompiler=-Wall,-Wextra)
        if(FASHION_MNIST_NATIVE)
          target_compile_options(fmnist_gpu_train PRIVATE -Xcompiler=-march=native)
        endif()
      endif()
    endif()
    target_link_libraries(${target} PRIVATE fmnist_gpu_train)  # its define and libraries too
  endif()
  if(CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
    # nvcc takes host-compiler flags through -Xcompiler.
    target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra>
                                             $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Wall,-Wextra>)
    if(FASHION_MNIST_NATIVE)
      target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-march=native>
                                               $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-march=native>)
    endif()
  endif()
endfunction()
