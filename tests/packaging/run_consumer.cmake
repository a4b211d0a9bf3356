# Configures, builds and runs tests/packaging/consumer in a fresh directory, consuming
# lockstep one way. Run as a ctest test (see CMakeLists.txt):
#   cmake -DMODE=subdirectory|fetchcontent|find_package -DLOCKSTEP_SOURCE=<src>
#         -DWORK_DIR=<dir> [-DGENERATOR=<gen>] [-DCXX_COMPILER=<c++>] -P run_consumer.cmake
foreach(var MODE LOCKSTEP_SOURCE WORK_DIR)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "run_consumer.cmake: pass -D${var}=...")
  endif()
endforeach()

set(common_args -DCMAKE_BUILD_TYPE=Release -DLOCKSTEP_ENABLE_CUDA=OFF
                # Only the lockstep this test installs may be found, never a registry's.
                -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF -DCMAKE_FIND_USE_SYSTEM_PACKAGE_REGISTRY=OFF)
if(GENERATOR)
  list(APPEND common_args -G ${GENERATOR})
endif()
if(CXX_COMPILER)
  list(APPEND common_args -DCMAKE_CXX_COMPILER=${CXX_COMPILER})
endif()

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

file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${WORK_DIR})
set(consumer_src ${CMAKE_CURRENT_LIST_DIR}/consumer)
set(consumer_bin ${WORK_DIR}/consumer-build)

if(MODE STREQUAL "find_package")
  set(prefix ${WORK_DIR}/prefix)
  step("configure lockstep" ${CMAKE_COMMAND} -S ${LOCKSTEP_SOURCE} -B ${WORK_DIR}/lockstep-build
       ${common_args} -DLOCKSTEP_BUILD_TESTS=OFF -DLOCKSTEP_BUILD_EXAMPLES=OFF
       -DLOCKSTEP_BUILD_BENCH=OFF -DLOCKSTEP_INSTALL=ON)
  # Build first (the install includes the lockstep-info tool), as a user would.
  step("build lockstep" ${CMAKE_COMMAND} --build ${WORK_DIR}/lockstep-build)
  step("install lockstep" ${CMAKE_COMMAND} --install ${WORK_DIR}/lockstep-build --prefix ${prefix})
  set(consume_args -DCMAKE_PREFIX_PATH=${prefix} -DLOCKSTEP_EXPECT_PREFIX=${prefix})
elseif(MODE STREQUAL "subdirectory" OR MODE STREQUAL "fetchcontent")
  # A subproject must not look for doctest (its tests are off there): make finding it fail.
  set(consume_args -DLOCKSTEP_SOURCE=${LOCKSTEP_SOURCE} -DCMAKE_DISABLE_FIND_PACKAGE_doctest=ON
                   -DFETCHCONTENT_FULLY_DISCONNECTED=ON)
else()
  message(FATAL_ERROR "run_consumer.cmake: unknown MODE '${MODE}'")
endif()

step("configure consumer" ${CMAKE_COMMAND} -S ${consumer_src} -B ${consumer_bin}
     ${common_args} -DLOCKSTEP_CONSUME=${MODE} ${consume_args})
step("build consumer" ${CMAKE_COMMAND} --build ${consumer_bin})
step("run consumer" ${consumer_bin}/consumer)
