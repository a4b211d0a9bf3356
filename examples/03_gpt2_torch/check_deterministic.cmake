# --deterministic runs of gpt2_torch that must end with the same parameters, run by ctest:
#   cmake -DMODE=cpu|gpu -DEXE=<gpt2_torch> [-DSTEPS=N] [-DSEQ=T] [-DDATA=<text>] [-DLAUNCHER=<lockstep-run>]
#         -P check_deterministic.cmake
# cpu: the tiny config on 1, 2 and 3 CPU ranks (LOCKSTEP_CPU_RANKS), 6 micro-batches a step,
#      and 3 ranks with --shard against 2 with --shard (its host AdamW is lockstep's, the
#      unsharded run's torch::optim: their parameters differ from each other, not across ranks).
# gpu: GPT-2 small, 12 micro-batches of 1 x SEQ (256) tokens a step for STEPS (30) steps, on
#      every visible GPU, with 1 MiB buckets, with --shard (the same FusedAdamW: the same bits as
#      unsharded), on the first GPU alone (CUDA_VISIBLE_DEVICES) when more are visible, and as
#      one process per GPU under LAUNCHER. (The control, the plain mean differing over the same
#      splits, is tests/cpu/test_deterministic.cpp's.)
# Each run prints "gpt2_torch: parameters fnv1a 0x..."; prints "SKIPPED: ..." (ctest's
# SKIP_REGULAR_EXPRESSION) without text data or GPUs.
cmake_minimum_required(VERSION 3.25)
foreach(v MODE EXE)
  if(NOT DEFINED ${v})
    message(FATAL_ERROR "check_deterministic.cmake: pass -D${v}=...")
  endif()
endforeach()

# Runs gpt2_torch with `env` (a list of VAR=VALUE, or "-") and the arguments after it; sets
# `sum` (the parameters' checksum) and `ranks` in the caller.
function(run_gpt2 name env)
  set(prefix "")
  if(NOT env STREQUAL "-")
    set(prefix ${CMAKE_COMMAND} -E env ${env})
  endif()
  set(data "")
  if(DEFINED DATA)  # -DDATA=<dir or file>: text elsewhere than the default fortunes
    set(data --data "${DATA}")
  endif()
  execute_process(COMMAND ${prefix} "${EXE}" ${ARGN} ${data} --log-every 1000
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(rc STREQUAL "77" OR err MATCHES "no GPU|CUDA_VISIBLE_DEVICES")
    message(STATUS "SKIPPED: ${name}: ${err}")
    set(skipped TRUE PARENT_SCOPE)
    return()
  endif()
  if(NOT rc STREQUAL "0" OR NOT out MATCHES "parameters fnv1a (0x[0-9a-f]+)")
    message(FATAL_ERROR "${name} failed (exit ${rc}):\n${out}\n${err}")
  endif()
  set(got "${CMAKE_MATCH_1}")
  string(REGEX MATCH "([0-9]+) rank\\(s\\) on" m "${out}")
  set(sum "${got}" PARENT_SCOPE)
  set(ranks "${CMAKE_MATCH_1}" PARENT_SCOPE)
  message(STATUS "${name}: ${CMAKE_MATCH_1} rank(s), parameters ${got}")
endfunction()

function(expect_same name a b)
  if(NOT a STREQUAL b)
    message(FATAL_ERROR "${name}: parameters ${b}, expected ${a} (bit for bit)")
  endif()
endfunction()

set(skipped FALSE)
if(MODE STREQUAL "cpu")
  set(common --device cpu --config tiny --seq 32 --batch 2 --steps 20 --lr 3e-3 --deterministic 6)
  run_gpt2(cpu_1 LOCKSTEP_CPU_RANKS=1 ${common})
  if(skipped)
    return()
  endif()
  set(first ${sum})
  foreach(r 2 3)
    run_gpt2(cpu_${r} LOCKSTEP_CPU_RANKS=${r} ${common})
    expect_same(cpu_${r} ${first} ${sum})
  endforeach()
  run_gpt2(cpu_2_shard LOCKSTEP_CPU_RANKS=2 ${common} --shard)
  set(sharded ${sum})
  run_gpt2(cpu_3_shard LOCKSTEP_CPU_RANKS=3 ${common} --shard)
  expect_same(cpu_3_shard ${sharded} ${sum})
  message(STATUS "deterministic cpu: ok, ${first} on 1, 2 and 3 ranks; sharded ${sharded} on 2 and 3")
elseif(MODE STREQUAL "gpu")
  if(NOT DEFINED STEPS)
    set(STEPS 30)
  endif()
  if(NOT DEFINED SEQ)
    set(SEQ 256)
  endif()
  set(common --batch 1 --seq ${SEQ} --steps ${STEPS} --deterministic 12)
  run_gpt2(gpu_all - ${common})
  if(skipped)
    return()
  endif()
  set(first ${sum})
  set(n ${ranks})
  run_gpt2(gpu_all_1mib - ${common} --bucket-mib 1)
  expect_same(gpu_all_1mib ${first} ${sum})
  run_gpt2(gpu_all_shard - ${common} --shard)
  expect_same(gpu_all_shard ${first} ${sum})
  if(n GREATER 1)
    run_gpt2(gpu_one CUDA_VISIBLE_DEVICES=0 ${common})
    expect_same(gpu_one ${first} ${sum})
  endif()
  if(DEFINED LAUNCHER)  # one process per GPU (lockstep-run) instead of one thread per GPU
    set(exe "${EXE}")
    set(EXE "${LAUNCHER}")
    run_gpt2(gpu_processes - --nproc ${n} "${exe}" ${common})
    set(EXE "${exe}")
    expect_same(gpu_processes ${first} ${sum})
  endif()
  message(STATUS "deterministic gpu: ok, ${first} over ${n} GPU(s), 1 MiB buckets, sharded, one GPU, processes")
else()
  message(FATAL_ERROR "check_deterministic.cmake: unknown MODE '${MODE}'")
endif()
