# Consumes lockstep one way from a fresh directory and runs the consumer. Run as a ctest test
# (see CMakeLists.txt):
#   cmake -DMODE=subdirectory|fetchcontent|find_package -DLOCKSTEP_SOURCE=<src>
#         -DWORK_DIR=<dir> [-DGENERATOR=<gen>] [-DCXX_COMPILER=<c++>] -P run_consumer.cmake
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

# --- add_subdirectory / FetchContent of the source tree ---------------------------------
if(NOT MODE STREQUAL "subdirectory" AND NOT MODE STREQUAL "fetchcontent")
  fail("unknown MODE '${MODE}'")
endif()
set(common_args -DCMAKE_BUILD_TYPE=Release -DLOCKSTEP_ENABLE_CUDA=OFF)
if(GENERATOR)
  list(APPEND common_args -G ${GENERATOR})
endif()
if(CXX_COMPILER)
  list(APPEND common_args -DCMAKE_CXX_COMPILER=${CXX_COMPILER})
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
