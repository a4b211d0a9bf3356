# Checks of distributed_fashion_mnist under the MPI launcher, run by ctest:
#   cmake -DMODE=matches_01|resume "-DMPIRUN=mpirun|-np|2|..." -DEXE02=<distributed_fashion_mnist>
#         [-DEXE01=<fashion_mnist>] -DWORK=<dir> -P check_mpi.cmake
# matches_01: 2 MPI processes train exactly as example 01's 2 CPU threads: the same samples
#             per step and the same schedule, and for 2 ranks the average (a+b)/2 rounds the
#             same whichever communicator computes it, so every epoch's loss and accuracy and
#             the final parameter checksum must be equal.
# resume:     3 epochs straight == 1 epoch, checkpoint, --resume for epochs 2-3 (same
#             checksum, no warning), all with 2 MPI processes.
# Prints "SKIPPED: ..." (ctest's SKIP_REGULAR_EXPRESSION) when the data set is not installed.
cmake_minimum_required(VERSION 3.25)
foreach(v MODE MPIRUN EXE02 WORK)
  if(NOT DEFINED ${v})
    message(FATAL_ERROR "check_mpi.cmake: pass -D${v}=...")
  endif()
endforeach()
string(REPLACE "|" ";" mpirun "${MPIRUN}")
set(args --smoke --epochs 3 --progress 0)
file(REMOVE_RECURSE "${WORK}")
file(MAKE_DIRECTORY "${WORK}")

# Runs one program; sets rc_<tag>, out_<tag>, err_<tag>; skips the test on exit 77.
function(run tag)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(rc STREQUAL "77")
    message(STATUS "SKIPPED: Fashion-MNIST is not installed (${err})")
    set(skipped ON PARENT_SCOPE)
    return()
  endif()
  if(NOT rc STREQUAL "0")
    message(FATAL_ERROR "${tag}: exit ${rc}: ${ARGN}\n${out}\n${err}")
  endif()
  set(out_${tag} "${out}" PARENT_SCOPE)
  set(err_${tag} "${err}" PARENT_SCOPE)
endfunction()

# "epoch e/E | train loss L | test accuracy A% (c/t)" lines and the final checksum.
function(summary out var)
  string(REGEX MATCHALL "epoch [0-9]+/[0-9]+ \\| train loss [0-9.]+ \\| test accuracy [0-9.]+% \\([0-9/]+\\)"
         epochs "${out}")
  if(NOT out MATCHES "final: [^\n]*fnv1a (0x[0-9a-f]+) \\(identical on all ranks\\)")
    message(FATAL_ERROR "no final line with agreeing ranks in:\n${out}")
  endif()
  set(${var} "${epochs};${CMAKE_MATCH_1}" PARENT_SCOPE)
endfunction()

if(MODE STREQUAL "matches_01")
  if(NOT DEFINED EXE01)
    message(FATAL_ERROR "check_mpi.cmake: matches_01 needs -DEXE01=<fashion_mnist>")
  endif()
  run(a01 "${EXE01}" --device cpu --ranks 2 ${args})
  if(skipped)
    return()
  endif()
  run(a02 ${mpirun} "${EXE02}" ${args})
  summary("${out_a01}" s01)
  summary("${out_a02}" s02)
  list(LENGTH s01 n)
  if(NOT n EQUAL 4)  # 3 epoch lines + the checksum
    message(FATAL_ERROR "expected 3 epoch lines from example 01, got: ${s01}")
  endif()
  if(NOT s01 STREQUAL s02)
    message(FATAL_ERROR "example 02 (2 MPI processes) differs from example 01 (2 threads):\n"
                        "  01: ${s01}\n  02: ${s02}\n--- 01:\n${out_a01}\n--- 02:\n${out_a02}")
  endif()
  message(STATUS "example 02 (2 MPI processes) == example 01 (2 threads): ${s02}")

elseif(MODE STREQUAL "resume")
  run(straight ${mpirun} "${EXE02}" ${args})
  if(skipped)
    return()
  endif()
  summary("${out_straight}" s)
  list(GET s -1 straight)
  run(part ${mpirun} "${EXE02}" ${args} --stop-after 1 --checkpoint "${WORK}/part.lsck")
  if(out_part MATCHES "epoch 2/3" OR NOT EXISTS "${WORK}/part.lsck")
    message(FATAL_ERROR "--stop-after 1 did not stop after epoch 1 and save:\n${out_part}")
  endif()
  run(resumed ${mpirun} "${EXE02}" ${args} --resume "${WORK}/part.lsck")
  if(NOT out_resumed MATCHES "resumed from [^\n]*: 1 epoch done" OR out_resumed MATCHES "epoch 1/3"
     OR err_resumed MATCHES "warning")
    message(FATAL_ERROR "the resumed run did not continue at epoch 2 cleanly:\n${out_resumed}\n${err_resumed}")
  endif()
  summary("${out_resumed}" r)
  list(GET r -1 resumed)
  if(NOT resumed STREQUAL straight)
    message(FATAL_ERROR "resume is not exact: straight ${straight}, resumed ${resumed}\n${out_resumed}")
  endif()
  message(STATUS "resume: ok, parameters ${straight} both ways")
else()
  message(FATAL_ERROR "check_mpi.cmake: unknown MODE '${MODE}'")
endif()
