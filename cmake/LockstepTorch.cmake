# LockstepTorch.cmake — the libtorch adapter (target lockstep::torch: lockstep::TorchModule).
# Included by the top-level CMakeLists.txt after lockstep::lockstep exists.
#
#   LOCKSTEP_ENABLE_TORCH = AUTO (default): build it when find_package(Torch) finds libtorch
#                           (Debian: libtorch-dev; PyTorch's: -DCMAKE_PREFIX_PATH=$(python3 -c
#                           'import torch;print(torch.utils.cmake_prefix_path)'))
#                           ON:  Torch is required
#                           OFF: no torch part
# Sets LOCKSTEP_HAS_TORCH (ON/OFF) and LOCKSTEP_TORCH_CUDA (libtorch built with CUDA).

set(LOCKSTEP_HAS_TORCH OFF)
set(LOCKSTEP_TORCH_CUDA OFF)
lockstep_part_mode(TORCH "Build the libtorch adapter (lockstep::torch)" _lockstep_torch_mode)

if(NOT _lockstep_torch_mode STREQUAL "OFF")
  find_package(Torch QUIET)
  if(Torch_FOUND OR TORCH_FOUND)
    set(LOCKSTEP_HAS_TORCH ON)
  elseif(_lockstep_torch_mode STREQUAL "ON")
    message(FATAL_ERROR
      "LOCKSTEP_ENABLE_TORCH=ON but libtorch was not found. Install it (Debian: libtorch-dev), or "
      "point CMake at PyTorch's with -DCMAKE_PREFIX_PATH=$(python3 -c 'import torch;print(torch.utils.cmake_prefix_path)'), "
      "or configure with -DLOCKSTEP_ENABLE_TORCH=OFF.")
  else()
    message(STATUS "lockstep: no libtorch found; building without lockstep::torch (its tests report themselves skipped)")
  endif()
endif()

if(LOCKSTEP_HAS_TORCH)
  if(TARGET torch_cuda OR TARGET c10_cuda)
    set(LOCKSTEP_TORCH_CUDA ON)
  endif()
  message(STATUS "lockstep: libtorch ${Torch_VERSION} (${TORCH_INSTALL_PREFIX}; CUDA: ${LOCKSTEP_TORCH_CUDA})")
  add_library(lockstep_torch INTERFACE)
  add_library(lockstep::torch ALIAS lockstep_torch)
  set_target_properties(lockstep_torch PROPERTIES EXPORT_NAME torch)
  target_link_libraries(lockstep_torch INTERFACE lockstep::lockstep ${TORCH_LIBRARIES})
  target_compile_definitions(lockstep_torch INTERFACE LOCKSTEP_WITH_TORCH=1)
  # TORCH_CXX_FLAGS carries the C++ ABI choice (-D_GLIBCXX_USE_CXX11_ABI=...), which must match.
  separate_arguments(_lockstep_torch_flags NATIVE_COMMAND "${TORCH_CXX_FLAGS}")
  target_compile_options(lockstep_torch INTERFACE ${_lockstep_torch_flags})
  unset(_lockstep_torch_flags)
endif()

unset(_lockstep_torch_mode)
