# Consumes lockstep one way from a fresh directory and runs the consumer. Run as a ctest test
# (see CMakeLists.txt):
#   cmake -DMODE=subdirectory|fetchcontent|find_package|torch_subdirectory|torch_find_package
#         -DLOCKSTEP_SOURCE=<src> -DWORK_DIR=<dir> [-DGENERATOR=<gen>] [-DCXX_COMPILER=<c++>]
#         [-DTORCH_DIR=<dir of TorchConfig.cmake>] -P run_consumer.cmake
#
# find_package runs the shell blocks of docs/building.md tagged `<!-- packaging-test: NAME -->`
# exactly as written (install, consume, tools), so the documented commands are the tested ones.
# They run with sh in WORK_DIR, where `lockstep` links to the source tree and `my_trainer` to
# tests/packaging/consumer; the only thing passed in is the environment (CXX, and PATH so that
# `cmake` is this CMake).
foreach(var MODE LOCKSTEP_SOURCE WORK_DIR)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "run_consumer.cmake: pass -D${var}=...")
  endif()
endforeach()

function(step what)
  string(TIMESTAMP t0 "%s")
  execute_process(COMMAND ${ARGN} COMMAND_ECHO STDOUT RESULT_VARIABLE rc)
  string(TIMESTAMP t1 "%s")
  math(EXPR dt "${t1} - ${t0}")
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "packaging (${MODE}): ${what} failed (${rc})")
  endif()
  message(STATUS "packaging (${MODE}): ${what} ok (${dt} s)")
endfunction()

function(fail msg)
  message(FATAL_ERROR "packaging (${MODE}): ${msg}")
endfunction()

file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${WORK_DIR})
set(consumer_src ${CMAKE_CURRENT_LIST_DIR}/consumer)

if(MODE STREQUAL "find_package")
  # --- the documented commands -----------------------------------------------------------
  set(doc ${LOCKSTEP_SOURCE}/docs/building.md)
  file(READ ${doc} doc_text)
  function(run_doc_block name)
    set(tag "<!-- packaging-test: ${name} -->")
    string(FIND "${doc_text}" "${tag}" at)
    string(FIND "${doc_text}" "${tag}" last REVERSE)
    if(at EQUAL -1 OR NOT at EQUAL last)
      fail("${doc} must tag exactly one block with '${tag}'")
    endif()
    string(SUBSTRING "${doc_text}" ${at} -1 rest)
    if(NOT rest MATCHES "^${tag}\n```sh\n([^`]*)```")
      fail("in ${doc}, '${tag}' must be followed by a ```sh block")
    endif()
    file(WRITE ${WORK_DIR}/${name}.sh "${CMAKE_MATCH_1}")
    get_filename_component(cmake_dir ${CMAKE_COMMAND} DIRECTORY)
    set(env --unset=DESTDIR PATH=${cmake_dir}:$ENV{PATH})
    if(CXX_COMPILER)
      list(APPEND env CXX=${CXX_COMPILER})
    endif()
    # `sh -ex`: echo each command, stop at the first that fails.
    string(TIMESTAMP t0 "%s")
    execute_process(COMMAND ${CMAKE_COMMAND} -E env ${env} sh -ex ${WORK_DIR}/${name}.sh
                    WORKING_DIRECTORY ${WORK_DIR} RESULT_VARIABLE rc)
    string(TIMESTAMP t1 "%s")
    math(EXPR dt "${t1} - ${t0}")
    if(NOT rc EQUAL 0)
      fail("the '${name}' commands of docs/building.md failed (${rc}); they are in ${WORK_DIR}/${name}.sh")
    endif()
    message(STATUS "packaging (${MODE}): docs/building.md '${name}' commands ok (${dt} s)")
  endfunction()

  file(CREATE_LINK ${LOCKSTEP_SOURCE} ${WORK_DIR}/lockstep SYMBOLIC)
  file(CREATE_LINK ${consumer_src} ${WORK_DIR}/my_trainer SYMBOLIC)
  set(prefix ${WORK_DIR}/lockstep-install)

  # 1. Configure and install, with no build.
  run_doc_block(install)
  foreach(umbrella lockstep.hpp cuda.cuh mpi.hpp version.hpp)
    if(NOT EXISTS ${prefix}/include/lockstep/${umbrella})
      fail("the install lacks include/lockstep/${umbrella}")
    endif()
  endforeach()
  # Every header is installed, and nothing else is installed under include/.
  file(GLOB_RECURSE installed RELATIVE ${prefix}/include ${prefix}/include/*)
  foreach(f IN LISTS installed)
    if(NOT f MATCHES "\\.(hpp|cuh|h)$")
      fail("the install has ${prefix}/include/${f}, which is not a header")
    endif()
  endforeach()
  file(GLOB_RECURSE headers RELATIVE ${LOCKSTEP_SOURCE}/include
       ${LOCKSTEP_SOURCE}/include/*.hpp ${LOCKSTEP_SOURCE}/include/*.cuh ${LOCKSTEP_SOURCE}/include/*.h)
  list(REMOVE_ITEM headers ${installed})
  if(headers)
    fail("headers not installed: ${headers}")
  endif()
  file(GLOB tools ${prefix}/bin/*)
  if(tools)
    fail("a header-only install (no build) installed ${tools}")
  endif()
  file(GLOB_RECURSE config ${prefix}/*/lockstep-config.cmake)
  if(NOT config)
    fail("the install has no lockstep-config.cmake")
  endif()
  get_filename_component(config_dir "${config}" DIRECTORY)

  # 2. A project uses the installed package (find_package + lockstep::lockstep).
  run_doc_block(consume)
  # The consumer builds one more program per optional part the package has (see its
  # CMakeLists.txt): each must be there and run, so a broken lockstep::cuda or lockstep::mpi
  # in the installed config fails here instead of being skipped.
  foreach(part cuda mpi)
    string(SUBSTRING ${part} 0 1 first)
    string(TOUPPER ${first} first)
    string(SUBSTRING ${part} 1 -1 tail)
    if(EXISTS ${config_dir}/lockstep${first}${tail}Targets.cmake)
      set(smoke ${WORK_DIR}/my_trainer-build/my_trainer_${part})
      if(NOT EXISTS ${smoke})
        fail("the package has lockstep::${part} but the consumer did not build my_trainer_${part}")
      endif()
      step("run my_trainer_${part}" ${smoke})
    else()
      message(STATUS "packaging (${MODE}): this install has no lockstep::${part}")
    endif()
  endforeach()

  # 3. Build, then install again: now the tools are installed too.
  run_doc_block(tools)
  foreach(tool lockstep-run lockstep-info)
    if(NOT EXISTS ${prefix}/bin/${tool})
      fail("installing after a build did not install bin/${tool}")
    endif()
  endforeach()
  return()
endif()

set(common_args -DCMAKE_BUILD_TYPE=Release -DLOCKSTEP_ENABLE_CUDA=OFF)
if(GENERATOR)
  list(APPEND common_args -G ${GENERATOR})
endif()
if(CXX_COMPILER)
  list(APPEND common_args -DCMAKE_CXX_COMPILER=${CXX_COMPILER})
endif()

# configure_must_fail(<what> <regex> <cmake args>...): the configure fails, with exactly one
# CMake error, whose text (lines joined) matches <regex>.
function(configure_must_fail what regex)
  execute_process(COMMAND ${CMAKE_COMMAND} ${ARGN} RESULT_VARIABLE rc
                  OUTPUT_VARIABLE out ERROR_VARIABLE out)
  string(REGEX REPLACE "[ \n]+" " " flat "${out}")
  string(REGEX MATCHALL "CMake Error" errors "${out}")
  list(LENGTH errors n)
  if(rc EQUAL 0 OR NOT n EQUAL 1 OR NOT flat MATCHES "${regex}")
    message("${out}")
    fail("${what}: expected the configure to fail with one error matching '${regex}' (exit ${rc}, ${n} errors)")
  endif()
  message(STATUS "packaging (${MODE}): ${what}: fails as it should")
endfunction()

# --- lockstep::torch, the consumer never calling find_package(Torch) (label torch) --------
if(MODE MATCHES "^torch_")
  set(torch_args -DLOCKSTEP_CONSUMER_TORCH=ON -DLOCKSTEP_ENABLE_MPI=OFF)
  if(TORCH_DIR)
    list(APPEND torch_args -DTorch_DIR=${TORCH_DIR})  # a libtorch found through CMAKE_PREFIX_PATH
  endif()
  set(no_torch -DCMAKE_DISABLE_FIND_PACKAGE_Torch=ON)
  set(todo "libtorch-dev.*torch\\.utils\\.cmake_prefix_path")
  set(consumer_bin ${WORK_DIR}/consumer-build)
  if(MODE STREQUAL "torch_subdirectory")
    set(sub_args -DLOCKSTEP_CONSUME=subdirectory -DLOCKSTEP_SOURCE=${LOCKSTEP_SOURCE}
                 -DCMAKE_DISABLE_FIND_PACKAGE_doctest=ON)
    # No optimisation (an empty build type): the program runs in a second, while compiling
    # libtorch's headers is most of this test's time.
    step("configure consumer" ${CMAKE_COMMAND} -S ${consumer_src} -B ${consumer_bin} ${common_args}
         ${sub_args} ${torch_args} -DCMAKE_BUILD_TYPE=)
    step("build my_trainer_torch" ${CMAKE_COMMAND} --build ${consumer_bin} --target my_trainer_torch)
    step("run my_trainer_torch" ${consumer_bin}/my_trainer_torch)
    # Without libtorch, linking lockstep::torch gives lockstep's one message saying what to do.
    configure_must_fail("linking lockstep::torch without libtorch"
      "lockstep::torch is linked by my_trainer_torch, but libtorch was not found.*${todo}"
      -S ${consumer_src} -B ${WORK_DIR}/no-torch-build ${common_args} ${sub_args} ${torch_args} ${no_torch})
  elseif(MODE STREQUAL "torch_find_package")
    set(prefix ${WORK_DIR}/lockstep-install)
    set(lockstep_args -DLOCKSTEP_BUILD_TESTS=OFF -DLOCKSTEP_BUILD_EXAMPLES=OFF
                      -DLOCKSTEP_BUILD_BENCH=OFF -DLOCKSTEP_BUILD_TOOLS=OFF)
    step("configure lockstep" ${CMAKE_COMMAND} -S ${LOCKSTEP_SOURCE} -B ${WORK_DIR}/lockstep-build
         ${common_args} ${lockstep_args} ${torch_args} -DLOCKSTEP_ENABLE_TORCH=ON)
    step("install lockstep" ${CMAKE_COMMAND} --install ${WORK_DIR}/lockstep-build --prefix ${prefix})
    step("configure consumer" ${CMAKE_COMMAND} -S ${consumer_src} -B ${consumer_bin} ${common_args}
         ${torch_args} -DCMAKE_PREFIX_PATH=${prefix})
    step("build my_trainer_torch_package" ${CMAKE_COMMAND} --build ${consumer_bin}
         --target my_trainer_torch_package)
    step("run my_trainer_torch_package" ${consumer_bin}/my_trainer_torch_package)
    # COMPONENTS torch where libtorch cannot be found now, and from a package without the part.
    configure_must_fail("COMPONENTS torch without libtorch"
      "lockstep::torch needs libtorch, which was not found.*${todo}"
      -S ${consumer_src} -B ${WORK_DIR}/no-torch-build ${common_args} ${torch_args}
      -DCMAKE_PREFIX_PATH=${prefix} ${no_torch})
    set(prefix_off ${WORK_DIR}/lockstep-install-no-torch)
    step("configure lockstep without torch" ${CMAKE_COMMAND} -S ${LOCKSTEP_SOURCE}
         -B ${WORK_DIR}/lockstep-build-no-torch ${common_args} ${lockstep_args} -DLOCKSTEP_ENABLE_MPI=OFF
         -DLOCKSTEP_ENABLE_TORCH=OFF)
    step("install lockstep without torch" ${CMAKE_COMMAND} --install ${WORK_DIR}/lockstep-build-no-torch
         --prefix ${prefix_off})
    configure_must_fail("COMPONENTS torch from a package without it"
      "This lockstep was installed without lockstep::torch.*${todo}"
      -S ${consumer_src} -B ${WORK_DIR}/no-part-build ${common_args} ${torch_args}
      -DCMAKE_PREFIX_PATH=${prefix_off})
  else()
    fail("unknown MODE '${MODE}'")
  endif()
  return()
endif()

# --- add_subdirectory / FetchContent of the source tree ---------------------------------
if(NOT MODE STREQUAL "subdirectory" AND NOT MODE STREQUAL "fetchcontent")
  fail("unknown MODE '${MODE}'")
endif()
# A subproject must not look for doctest (its tests are off there): make finding it fail.
set(consumer_bin ${WORK_DIR}/consumer-build)
step("configure consumer" ${CMAKE_COMMAND} -S ${consumer_src} -B ${consumer_bin} ${common_args}
     -DLOCKSTEP_CONSUME=${MODE} -DLOCKSTEP_SOURCE=${LOCKSTEP_SOURCE}
     -DCMAKE_DISABLE_FIND_PACKAGE_doctest=ON -DFETCHCONTENT_FULLY_DISCONNECTED=ON)
step("build consumer" ${CMAKE_COMMAND} --build ${consumer_bin})
step("run consumer" ${consumer_bin}/my_trainer)
if(EXISTS ${consumer_bin}/my_trainer_mpi)
  step("run my_trainer_mpi" ${consumer_bin}/my_trainer_mpi)
endif()
