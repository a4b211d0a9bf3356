# Builds one target of a build tree and judges the result:
#   EXPECT=COMPILES   the build must succeed;
#   EXPECT=<regex>    the build must FAIL and its output must match <regex>.
# cmake -DBUILD_DIR=<dir> -DTARGET=<target> -DEXPECT=<...> -P check_build.cmake
foreach(var BUILD_DIR TARGET EXPECT)
  if(NOT DEFINED ${var} OR "${${var}}" STREQUAL "")
    message(FATAL_ERROR "check_build.cmake: pass -D${var}=...")
  endif()
endforeach()

execute_process(COMMAND ${CMAKE_COMMAND} --build ${BUILD_DIR} --target ${TARGET}
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)

if(EXPECT STREQUAL "COMPILES")
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${TARGET} must compile but failed (${rc}):\n${out}")
  endif()
  message(STATUS "${TARGET} compiles, as it must")
  return()
endif()

if(rc EQUAL 0)
  message(FATAL_ERROR "${TARGET} compiled, but it must fail with: ${EXPECT}\n${out}")
endif()
if(NOT out MATCHES "${EXPECT}")
  message(FATAL_ERROR "${TARGET} failed to compile, as it must, but without the expected "
                      "message: ${EXPECT}\n${out}")
endif()
message(STATUS "${TARGET} fails to compile with the expected message: ${CMAKE_MATCH_0}")
