# The GPU path of examples 01 and 02: fmnist_gpu_setup(<var>) sets <var> ON when it can be
# built (FASHION_MNIST_CUDA is on and lockstep::cuda exists), enabling CUDA (sm_90 unless
# CMAKE_CUDA_ARCHITECTURES or CUDAARCHS say otherwise) and finding cuBLAS in a standalone build.
option(FASHION_MNIST_CUDA "Build the GPU path when lockstep::cuda is available" ON)
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
