# LockstepTorch.cmake — the libtorch adapter (target lockstep::torch: lockstep::TorchModule).
# Included by the top-level CMakeLists.txt after lockstep::lockstep exists.
#
#   LOCKSTEP_ENABLE_TORCH = AUTO (default): build it when find_package(Torch) finds libtorch
#                           (Debian: libtorch-dev; PyTorch's: -DCMAKE_PREFIX_PATH=$(python3 -c
#                           'import torch;print(torch.utils.cmake_prefix_path)'))
#                           ON:  Torch is required
#                           OFF: no torch part
# Sets LOCKSTEP_HAS_TORCH (ON/OFF) and LOCKSTEP_TORCH_CUDA (libtorch built with CUDA).
#
# lockstep looks for libtorch itself, so a project that adds lockstep (add_subdirectory,
# FetchContent) and links lockstep::torch needs no find_package(Torch) of its own. For that the
# imported targets find_package(Torch) creates here are made global: libtorch's targets name
# each other in generator expressions ($<TARGET_PROPERTY:torch_cpu,...>, $<TARGET_FILE:torch>),
# which CMake evaluates in the directory of the target being built, the consumer's, where
# targets imported in lockstep's directory would not be visible. Which targets they are is read
# from the directory's IMPORTED_TARGETS (libtorch 2.x with CUDA makes many more than 1.13).

set(LOCKSTEP_HAS_TORCH OFF)
set(LOCKSTEP_TORCH_CUDA OFF)
lockstep_part_mode(TORCH "Build the libtorch adapter (lockstep::torch)" _lockstep_torch_mode)

string(CONCAT _lockstep_torch_todo
  "Install libtorch (Debian: apt-get install libtorch-dev), or point CMake at PyTorch's with "
  "-DCMAKE_PREFIX_PATH=$(python3 -c 'import torch;print(torch.utils.cmake_prefix_path)'), "
  "or configure with -DLOCKSTEP_ENABLE_TORCH=OFF")

if(NOT _lockstep_torch_mode STREQUAL "OFF")
  get_property(_lockstep_imported_before DIRECTORY PROPERTY IMPORTED_TARGETS)
  set(_lockstep_cuda_std "${CMAKE_CUDA_STANDARD}")
  set(_lockstep_cuda_std_defined OFF)
  if(DEFINED CMAKE_CUDA_STANDARD)
    set(_lockstep_cuda_std_defined ON)
  endif()
  set(_lockstep_cuda_std_required "${CMAKE_CUDA_STANDARD_REQUIRED}")

  find_package(Torch QUIET)

  # A CUDA build of libtorch (its Caffe2 package, public/cuda.cmake) sets CMAKE_CUDA_STANDARD
  # to CMAKE_CXX_STANDARD, REQUIRED, in this directory. When CMake has no nvcc flag for that
  # level (CUDA20 before CMake 3.25.2), every CUDA target here would fail to generate
  # ("requires the language dialect CUDA20"); lockstep::cuda asks nvcc for C++20 itself.
  if(NOT "${CMAKE_CUDA_STANDARD}" STREQUAL "${_lockstep_cuda_std}"
     AND NOT DEFINED CMAKE_CUDA${CMAKE_CUDA_STANDARD}_STANDARD_COMPILE_OPTION)
    message(STATUS "lockstep: libtorch set CMAKE_CUDA_STANDARD to ${CMAKE_CUDA_STANDARD}, which "
                   "CMake ${CMAKE_VERSION} cannot give this CUDA compiler; not keeping it")
    if(_lockstep_cuda_std_defined)
      set(CMAKE_CUDA_STANDARD "${_lockstep_cuda_std}")
    else()
      unset(CMAKE_CUDA_STANDARD)
    endif()
    set(CMAKE_CUDA_STANDARD_REQUIRED "${_lockstep_cuda_std_required}")
  endif()

  if(Torch_FOUND OR TORCH_FOUND)
    set(LOCKSTEP_HAS_TORCH ON)
    get_property(_lockstep_imported DIRECTORY PROPERTY IMPORTED_TARGETS)
    if(_lockstep_imported_before)
      list(REMOVE_ITEM _lockstep_imported ${_lockstep_imported_before})
    endif()
    foreach(_t IN LISTS _lockstep_imported)
      get_property(_global TARGET ${_t} PROPERTY IMPORTED_GLOBAL)
      if(NOT _global)
        set_property(TARGET ${_t} PROPERTY IMPORTED_GLOBAL TRUE)
      endif()
    endforeach()
    unset(_lockstep_imported)
    unset(_global)
    unset(_t)
  elseif(_lockstep_torch_mode STREQUAL "ON")
    message(FATAL_ERROR "LOCKSTEP_ENABLE_TORCH=ON but libtorch was not found. ${_lockstep_torch_todo}.")
  else()
    message(STATUS "lockstep: no libtorch found; building without lockstep::torch (its tests report themselves skipped)")
  endif()
  unset(_lockstep_imported_before)
  unset(_lockstep_cuda_std)
  unset(_lockstep_cuda_std_defined)
  unset(_lockstep_cuda_std_required)
endif()

if(LOCKSTEP_HAS_TORCH)
  if(TARGET torch_cuda OR TARGET c10_cuda)
    set(LOCKSTEP_TORCH_CUDA ON)
  endif()
  message(STATUS "lockstep: libtorch ${Torch_VERSION} (${TORCH_INSTALL_PREFIX}; CUDA: ${LOCKSTEP_TORCH_CUDA})")
  add_library(lockstep_torch INTERFACE)
  add_library(lockstep::torch ALIAS lockstep_torch)
  set_target_properties(lockstep_torch PROPERTIES EXPORT_NAME torch)
  target_link_libraries(lockstep_torch INTERFACE lockstep::lockstep)
  target_compile_definitions(lockstep_torch INTERFACE LOCKSTEP_WITH_TORCH=1)
  # libtorch itself only in the build tree: an installed lockstep::torch gets the libtorch found
  # where it is used (lockstep-config.cmake), not paths of the machine it was installed from.
  foreach(_lib IN LISTS TORCH_LIBRARIES)
    target_link_libraries(lockstep_torch INTERFACE $<BUILD_INTERFACE:${_lib}>)
  endforeach()
  # TORCH_CXX_FLAGS carries the C++ ABI choice (-D_GLIBCXX_USE_CXX11_ABI=...), which must match.
  separate_arguments(_lockstep_torch_flags NATIVE_COMMAND "${TORCH_CXX_FLAGS}")
  foreach(_flag IN LISTS _lockstep_torch_flags)
    target_compile_options(lockstep_torch INTERFACE $<BUILD_INTERFACE:${_flag}>)
  endforeach()
  unset(_lockstep_torch_flags)
  unset(_flag)
  unset(_lib)

  if(LOCKSTEP_INSTALL)
    install(TARGETS lockstep_torch EXPORT lockstepTorchTargets)
    install(EXPORT lockstepTorchTargets NAMESPACE lockstep::
            DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/lockstep)
  endif()
else()
  # No torch part, yet a target links lockstep::torch: one message that says why and what to
  # do, at the end of the configure (when every target exists), instead of CMake's "target
  # not found ... a find_package call is missing" at generate time.
  if(_lockstep_torch_mode STREQUAL "OFF")
    string(CONCAT _lockstep_torch_why
      "lockstep was configured with LOCKSTEP_ENABLE_TORCH=OFF, so it has no torch part. "
      "Configure with -DLOCKSTEP_ENABLE_TORCH=AUTO (or ON) and libtorch installed (Debian: "
      "libtorch-dev; PyTorch's: -DCMAKE_PREFIX_PATH=$(python3 -c 'import torch;print(torch.utils.cmake_prefix_path)')), "
      "or link lockstep::lockstep instead.")
  else()
    string(CONCAT _lockstep_torch_why
      "libtorch was not found, so lockstep has no torch part. ${_lockstep_torch_todo} and "
      "link lockstep::lockstep instead.")
  endif()
  set_property(GLOBAL PROPERTY LOCKSTEP_TORCH_MISSING "${_lockstep_torch_why}")
  unset(_lockstep_torch_why)
  function(lockstep_torch_check_links)
    set(dirs "${CMAKE_SOURCE_DIR}")
    set(users "")
    while(dirs)
      list(POP_FRONT dirs dir)
      get_property(subdirs DIRECTORY "${dir}" PROPERTY SUBDIRECTORIES)
      list(APPEND dirs ${subdirs})
      get_property(targets DIRECTORY "${dir}" PROPERTY BUILDSYSTEM_TARGETS)
      foreach(t IN LISTS targets)
        get_property(libs TARGET ${t} PROPERTY LINK_LIBRARIES)
        get_property(ilibs TARGET ${t} PROPERTY INTERFACE_LINK_LIBRARIES)
        if("${libs};${ilibs}" MATCHES "(^|[^A-Za-z0-9_])lockstep::torch([^A-Za-z0-9_]|$)")
          list(APPEND users ${t})
        endif()
      endforeach()
    endwhile()
    if(users)
      list(JOIN users ", " users)
      get_property(why GLOBAL PROPERTY LOCKSTEP_TORCH_MISSING)
      message(FATAL_ERROR "lockstep::torch is linked by ${users}, but ${why}")
    endif()
  endfunction()
  cmake_language(DEFER DIRECTORY "${CMAKE_SOURCE_DIR}" CALL lockstep_torch_check_links)
endif()

unset(_lockstep_torch_mode)
unset(_lockstep_torch_todo)
