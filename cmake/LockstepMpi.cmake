# LockstepMpi.cmake — the MPI part of lockstep (target lockstep::mpi: MpiComm, run(Mpi{}),
# MpiStore). Included by the top-level CMakeLists.txt after lockstep::lockstep exists.
#
#   LOCKSTEP_ENABLE_MPI = AUTO (default): build it when find_package(MPI COMPONENTS CXX) finds MPI
#                         ON:  MPI is required
#                         OFF: no MPI part
# Sets LOCKSTEP_HAS_MPI (ON/OFF) for the rest of the build.

set(LOCKSTEP_HAS_MPI OFF)
lockstep_part_mode(MPI "Build the MPI part (lockstep::mpi)" _lockstep_mpi_mode)

if(NOT _lockstep_mpi_mode STREQUAL "OFF")
  find_package(MPI QUIET COMPONENTS CXX)
  if(MPI_CXX_FOUND)
    set(LOCKSTEP_HAS_MPI ON)
  elseif(_lockstep_mpi_mode STREQUAL "ON")
    message(FATAL_ERROR
      "LOCKSTEP_ENABLE_MPI=ON but no MPI with C++ support was found. Install one (Debian: "
      "libopenmpi-dev openmpi-bin), point CMake at it with -DMPI_HOME=... or "
      "-DMPI_CXX_COMPILER=mpicxx, or configure with -DLOCKSTEP_ENABLE_MPI=OFF.")
  else()
    message(STATUS "lockstep: no MPI found; building without lockstep::mpi")
  endif()
endif()

if(LOCKSTEP_HAS_MPI)
  message(STATUS "lockstep: MPI ${MPI_CXX_VERSION} (${MPIEXEC_EXECUTABLE})")
  add_library(lockstep_mpi INTERFACE)
  add_library(lockstep::mpi ALIAS lockstep_mpi)
  set_target_properties(lockstep_mpi PROPERTIES EXPORT_NAME mpi)
  target_link_libraries(lockstep_mpi INTERFACE lockstep::lockstep MPI::MPI_CXX)
  target_compile_definitions(lockstep_mpi INTERFACE LOCKSTEP_WITH_MPI=1)
  if(LOCKSTEP_INSTALL)
    install(TARGETS lockstep_mpi EXPORT lockstepMpiTargets)
    install(EXPORT lockstepMpiTargets NAMESPACE lockstep::
            DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/lockstep)
  endif()
endif()

unset(_lockstep_mpi_mode)
