# Command-line checks of fashion_mnist, run by ctest:
#   cmake -DMODE=missing_data|corrupt_data|resume -DEXE=<fashion_mnist> -DWORK=<dir> -P check_cli.cmake
# missing_data: a directory without the files → exit 77 and a message naming the file and
#               `apt-get install dataset-fashion-mnist`.
# corrupt_data: bad magic, wrong dimensions, truncation, count mismatch, label ≥ 10 (files
#               written here with sh/printf, gzip-compressed when gzip exists) → exit 1 and a
#               message naming the file and the problem.
# resume:       3 epochs straight == 1 epoch, checkpoint, --resume for epochs 2-3 (same
#               parameter checksum); a truncated checkpoint is refused.
# gpu_resume:   the same on every visible GPU (--device gpu); the GPU checkpoint also
#               resumes on one CPU rank (with a warning). Skipped where no GPU is visible.
# gpu_inputs:   --input prefetch, sync and device, and device with --cuda-graph (each step
#               replayed as one CUDA graph), on every visible GPU end with the same parameters
#               bit for bit (the batches are the same floats whichever way they come in, and a
#               graph replays the eager step's kernels), and each run names its input mode.
#               Skipped where no GPU is visible.
# gpu_symmetric: (2+ GPUs) example 02 (EXE) on 2 processes under LAUNCHER with --symmetric
#               and lockstep's peer kernel off (LOCKSTEP_PEER_ALL_REDUCE_MIB=0):
#               NCCL's log says the buckets were all-reduced by its symmetric kernels and
#               that no NVLS algorithm or multimem kernel was chosen.
# deterministic: --deterministic 8 with a global batch of 96 on 1, 2, 3 (16 KiB buckets) and 4
#               CPU ranks end with the same parameters, bit for bit; a checkpoint of 4 ranks
#               after epoch 1 resumed on 1 rank ends with them too, without a warning.
# gpu_deterministic: the same on one GPU (and 16 KiB buckets, --input sync) and on 2, 3, 4 GPUs
#               where visible. Skipped where no GPU is visible.
# tensorboard:  --logdir: TensorBoard's reader (READER, run with PYTHON) finds train/loss and
#               train/lr at every step and test/accuracy at every epoch, equal to the CSV.
# Prints "SKIPPED: ..." (ctest's SKIP_REGULAR_EXPRESSION) when a check needs the real data
# and it is not installed, or needs sh and there is none.
cmake_minimum_required(VERSION 3.25)
foreach(v MODE EXE WORK)
  if(NOT DEFINED ${v})
    message(FATAL_ERROR "check_cli.cmake: pass -D${v}=...")
  endif()
endforeach()
file(REMOVE_RECURSE "${WORK}")
file(MAKE_DIRECTORY "${WORK}")

# Runs the example (under `launch`, a launcher and its options, where set); sets rc, out, err
# in the caller.
function(run_example)
  set(data "")
  if(DEFINED DATA)  # -DDATA=<dir>: the data set elsewhere (first: a check's own --data wins)
    set(data --data "${DATA}")
  endif()
  execute_process(COMMAND ${launch} "${EXE}" ${data} ${ARGN} --progress 0
                  RESULT_VARIABLE r OUTPUT_VARIABLE o ERROR_VARIABLE e)
  set(rc "${r}" PARENT_SCOPE)
  set(out "${o}" PARENT_SCOPE)
  set(err "${e}" PARENT_SCOPE)
endfunction()

# Runs the example expecting a training run whose ranks end with the same parameters: sets
# `sum` to their checksum. Without the data set or a GPU the check ends as skipped (a macro:
# its return() leaves the script); any other failure is fatal, naming `what`.
macro(run_trained what)
  run_example(${ARGN})
  if(rc STREQUAL "77")
    message(STATUS "SKIPPED: Fashion-MNIST is not installed (${err})")
    return()
  endif()
  if(err MATCHES "no GPU is visible|built without CUDA")
    message(STATUS "SKIPPED: ${err}")
    return()
  endif()
  if(NOT rc STREQUAL "0" OR NOT out MATCHES "final: [^\n]*fnv1a (0x[0-9a-f]+) \\(identical on all ranks\\)")
    message(FATAL_ERROR "${what} failed (${rc}):\n${out}\n${err}")
  endif()
  set(sum "${CMAKE_MATCH_1}")
endmacro()

# Expects a failure with exit status `want_rc` and stderr matching `regex`.
function(expect_failure name want_rc regex)
  run_example(${ARGN})
  if(NOT rc STREQUAL want_rc)
    message(FATAL_ERROR "${name}: exit status ${rc}, expected ${want_rc}\nstdout:\n${out}\nstderr:\n${err}")
  endif()
  if(NOT err MATCHES "${regex}")
    message(FATAL_ERROR "${name}: stderr does not match '${regex}':\n${err}")
  endif()
  message(STATUS "${name}: ok (exit ${rc}): ${err}")
endfunction()

if(MODE STREQUAL "missing_data")
  set(dir "${WORK}/nowhere")
  expect_failure(missing_data 77
    "cannot find '[^']*nowhere/train-images-idx3-ubyte\\.gz'.*sudo apt-get install dataset-fashion-mnist.*--data DIR"
    --data "${dir}" --smoke --ranks 1)

elseif(MODE STREQUAL "corrupt_data")
  find_program(SH sh)
  if(NOT SH)
    message(STATUS "SKIPPED: no sh to write the corrupt files with")
    return()
  endif()
  find_program(GZIP gzip)
  if(GZIP)
    set(z "| \"${GZIP}\" -c")
  else()
    set(z "")
  endif()
  # IDX headers as printf octal escapes (big-endian u32s).
  set(img_magic "\\000\\000\\010\\003")
  set(lab_magic "\\000\\000\\010\\001")
  set(u32_2 "\\000\\000\\000\\002")
  set(u32_3 "\\000\\000\\000\\003")
  set(u32_27 "\\000\\000\\000\\033")
  set(u32_28 "\\000\\000\\000\\034")
  set(u32_60000 "\\000\\000\\352\\140")
  set(images_2 "( printf '${img_magic}${u32_2}${u32_28}${u32_28}' && head -c 1568 /dev/zero ) ${z} > train-images-idx3-ubyte.gz")

  # name @@ shell commands run in a fresh directory (no ';': list separator) @@ expected stderr
  set(cases
    "bad_magic@@printf 'this is not an IDX file' ${z} > train-images-idx3-ubyte.gz@@train-images-idx3-ubyte\\.gz' has bad magic 0x74686973: expected 0x00000803"
    "truncated@@( printf '${img_magic}${u32_60000}${u32_28}${u32_28}' && head -c 100 /dev/zero ) ${z} > train-images-idx3-ubyte.gz@@train-images-idx3-ubyte\\.gz' is truncated: its header announces 60000 images but the data ends after 0 of them"
    "header_cut@@printf '${img_magic}\\000\\000' ${z} > train-images-idx3-ubyte.gz@@train-images-idx3-ubyte\\.gz' is truncated: it ends inside its IDX header"
    "wrong_dims@@( printf '${img_magic}${u32_2}${u32_28}${u32_27}' && head -c 1512 /dev/zero ) ${z} > train-images-idx3-ubyte.gz@@train-images-idx3-ubyte\\.gz' holds 28x27 images. Fashion-MNIST images are 28x28"
    "count_mismatch@@${images_2} && printf '${lab_magic}${u32_3}\\001\\002\\003' ${z} > train-labels-idx1-ubyte.gz@@train-images-idx3-ubyte\\.gz' holds 2 images but '[^']*train-labels-idx1-ubyte\\.gz' holds 3 labels"
    "bad_label@@${images_2} && printf '${lab_magic}${u32_2}\\001\\014' ${z} > train-labels-idx1-ubyte.gz@@train-labels-idx1-ubyte\\.gz' is corrupt: label 12 at index 1 is out of range"
    "labels_as_images@@printf '${lab_magic}${u32_2}\\001\\002' ${z} > train-images-idx3-ubyte.gz@@train-images-idx3-ubyte\\.gz' has bad magic 0x00000801")
  set(real "/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz")
  if(EXISTS "${real}")  # a real gzip stream cut short: zlib's error or a short read
    list(APPEND cases
      "cut_gzip@@head -c 100000 '${real}' > train-images-idx3-ubyte.gz@@train-images-idx3-ubyte\\.gz' is (corrupt: zlib reports|truncated)")
  endif()
  foreach(c IN LISTS cases)
    string(REPLACE "@@" ";" parts "${c}")
    list(GET parts 0 name)
    list(GET parts 1 cmd)
    list(GET parts 2 regex)
    set(dir "${WORK}/${name}")
    file(MAKE_DIRECTORY "${dir}")
    file(WRITE "${dir}/make.sh" "set -e\ncd \"${dir}\"\n${cmd}\n")
    execute_process(COMMAND "${SH}" "${dir}/make.sh" RESULT_VARIABLE mk ERROR_VARIABLE mk_err)
    if(NOT mk EQUAL 0)
      message(FATAL_ERROR "${name}: writing the test file failed (${mk}): ${mk_err}")
    endif()
    expect_failure(${name} 1 "${regex}" --data "${dir}" --smoke --ranks 1)
  endforeach()

elseif(MODE STREQUAL "resume" OR MODE STREQUAL "gpu_resume")
  if(MODE STREQUAL "gpu_resume")
    set(common --smoke --device gpu --epochs 3)
    set(other --smoke --device cpu --ranks 1 --epochs 3)
  else()
    set(common --smoke --ranks 2 --epochs 3)
    set(other --smoke --ranks 1 --epochs 3)
  endif()
  run_trained("straight run" ${common} --checkpoint "${WORK}/straight.lsck")
  set(straight "${sum}")
  if(NOT out MATCHES "epoch 3/3 [^\n]*test accuracy ([0-9.]+%)")
    message(FATAL_ERROR "straight run printed no epoch 3 line:\n${out}")
  endif()
  set(straight_acc "${CMAKE_MATCH_1}")

  run_example(${common} --stop-after 1 --checkpoint "${WORK}/part.lsck")
  if(NOT rc STREQUAL "0" OR out MATCHES "epoch 2/3" OR NOT EXISTS "${WORK}/part.lsck")
    message(FATAL_ERROR "--stop-after 1 run failed (${rc}):\n${out}\n${err}")
  endif()

  run_example(${common} --resume "${WORK}/part.lsck")
  if(NOT rc STREQUAL "0" OR NOT out MATCHES "resumed from [^\n]*: 1 epoch done"
     OR out MATCHES "epoch 1/3" OR NOT out MATCHES "epoch 3/3 [^\n]*test accuracy ([0-9.]+%)")
    message(FATAL_ERROR "resumed run failed (${rc}):\n${out}\n${err}")
  endif()
  set(resumed_acc "${CMAKE_MATCH_1}")
  if(err MATCHES "warning")
    message(FATAL_ERROR "resuming with the same options warned:\n${err}")
  endif()
  if(NOT out MATCHES "final: [^\n]*fnv1a (0x[0-9a-f]+)")
    message(FATAL_ERROR "resumed run printed no final line:\n${out}")
  endif()
  if(NOT CMAKE_MATCH_1 STREQUAL straight OR NOT resumed_acc STREQUAL straight_acc)
    message(FATAL_ERROR "resume is not exact: straight run ${straight} (${straight_acc}), "
                        "resumed ${CMAKE_MATCH_1} (${resumed_acc})\n${out}")
  endif()
  message(STATUS "resume: ok, parameters ${straight}, accuracy ${straight_acc} both ways")

  # Resuming with other options (or on another device) still works, with a warning.
  run_example(${other} --resume "${WORK}/part.lsck")
  if(NOT rc STREQUAL "0" OR NOT err MATCHES "warning: the checkpoint was saved by a run with other options")
    message(FATAL_ERROR "resuming with ${other} failed or did not warn (${rc}):\n${out}\n${err}")
  endif()

  # A damaged checkpoint is refused with a clear message.
  find_program(SH sh)
  if(SH)
    execute_process(COMMAND "${SH}" -c "head -c 200 '${WORK}/part.lsck' > '${WORK}/cut.lsck'")
    expect_failure(cut_checkpoint 1 "checkpoint '[^']*cut\\.lsck' is truncated"
                   ${common} --resume "${WORK}/cut.lsck")
  endif()
  expect_failure(no_checkpoint 1 "cannot open checkpoint '[^']*absent\\.lsck'"
                 ${common} --resume "${WORK}/absent.lsck")
elseif(MODE STREQUAL "gpu_inputs")
  set(first "")
  foreach(input prefetch sync device graph)
    if(input STREQUAL "graph")  # --input device, each full step replayed as one CUDA graph
      run_trained("--input device --cuda-graph" --smoke --device gpu --input device --cuda-graph)
      set(input "device")
      set(graph_line "[^\n]*steps as one CUDA graph")
    else()
      run_trained("--input ${input}" --smoke --device gpu --input ${input})
      set(graph_line "")
    endif()
    if(NOT out MATCHES "input: ${input} [^\n]*ms per step${graph_line}")
      message(FATAL_ERROR "--input ${input} printed no 'input: ${input} ...' line:\n${out}")
    endif()
    if(first STREQUAL "")
      set(first "${sum}")
    elseif(NOT sum STREQUAL first)
      message(FATAL_ERROR "--input ${input} ended with parameters ${sum}, --input prefetch with ${first}:\n${out}")
    endif()
    string(REGEX MATCH "input: [^\n]*" line "${out}")
    message(STATUS "${line}")
  endforeach()
  message(STATUS "gpu_inputs: ok, parameters ${first} with every input mode")
elseif(MODE STREQUAL "deterministic" OR MODE STREQUAL "gpu_deterministic")
  # The same parameters however many ranks share the global batch of 96 (12 micro-batches of
  # 8), whatever the buckets; and the last run's checkpoint after epoch 1 resumed with the first
  # run's options equal to the straight runs, without the warning about other options.
  set(det --smoke --batch 96 --deterministic 8)
  if(MODE STREQUAL "gpu_deterministic")
    execute_process(COMMAND nvidia-smi -L OUTPUT_VARIABLE gpus_listed ERROR_QUIET)
    string(REGEX MATCHALL "GPU [0-9]+:" gpus_found "${gpus_listed}")
    list(LENGTH gpus_found n_gpus)
    set(runs "--device|gpu|--gpus|1" "--device|gpu|--gpus|1|--bucket-kib|16|--input|sync")
    foreach(g 2 3 4)
      if(NOT n_gpus LESS g)
        list(APPEND runs "--device|gpu|--gpus|${g}")
      endif()
    endforeach()
  else()
    set(runs "--ranks|1" "--ranks|2" "--ranks|3|--bucket-kib|16" "--ranks|4")  # one run's arguments, |-separated
  endif()
  set(first "")
  foreach(run IN LISTS runs)
    string(REPLACE "|" ";" run "${run}")
    run_trained("--deterministic with ${run}" ${det} ${run})
    if(first STREQUAL "")
      set(first "${sum}")
    elseif(NOT sum STREQUAL first)
      message(FATAL_ERROR "--deterministic with ${run} ended with parameters ${sum}, the first run with ${first}")
    endif()
    message(STATUS "${run}: parameters ${sum}")
  endforeach()
  list(GET runs 0 one)
  list(GET runs -1 other)
  string(REPLACE "|" ";" one "${one}")
  string(REPLACE "|" ";" other "${other}")
  run_example(${det} ${other} --stop-after 1 --checkpoint "${WORK}/part.lsck")
  if(NOT rc STREQUAL "0" OR NOT EXISTS "${WORK}/part.lsck")
    message(FATAL_ERROR "--stop-after 1 with ${other} failed (${rc}):\n${out}\n${err}")
  endif()
  run_example(${det} ${one} --resume "${WORK}/part.lsck")
  if(NOT rc STREQUAL "0" OR NOT out MATCHES "final: [^\n]*fnv1a (0x[0-9a-f]+)" OR err MATCHES "warning")
    message(FATAL_ERROR "resuming ${other}'s checkpoint with ${one} failed or warned (${rc}):\n${out}\n${err}")
  endif()
  string(REGEX MATCH "fnv1a (0x[0-9a-f]+)" resumed "${out}")
  if(NOT CMAKE_MATCH_1 STREQUAL first)
    message(FATAL_ERROR "resuming ${other}'s checkpoint with ${one} ended with ${CMAKE_MATCH_1}, straight runs with ${first}")
  endif()
  message(STATUS "${MODE}: ok, parameters ${first} with ${runs}, and resumed across rank counts")
elseif(MODE STREQUAL "gpu_symmetric")
  # NCCL's own log (NCCL_DEBUG=INFO, subsystem TUNING, one file per process): the gradient
  # buckets go to its symmetric kernels, and never to NVLink multicast (NVLS, or a symmetric
  # kernel's multimem "MC" variant) with NCCL_NVLS_ENABLE=0.
  set(ENV{NCCL_DEBUG} INFO)
  set(ENV{NCCL_DEBUG_SUBSYS} TUNING)
  set(ENV{NCCL_DEBUG_FILE} "${WORK}/nccl.%p.log")
  set(ENV{NCCL_NVLS_ENABLE} 0)
  # lockstep's peer kernel would take every bucket of this model (they are small): off, so
  # that NCCL's kernels, whose choice this checks, reduce them.
  set(ENV{LOCKSTEP_PEER_ALL_REDUCE_MIB} 0)
  if(NOT DEFINED LAUNCHER)
    message(FATAL_ERROR "check_cli.cmake: gpu_symmetric needs -DLAUNCHER=<lockstep-run> (one process per GPU)")
  endif()
  execute_process(COMMAND nvidia-smi -L OUTPUT_VARIABLE gpus_listed ERROR_QUIET)
  string(REGEX MATCHALL "GPU [0-9]+:" gpus_found "${gpus_listed}")
  list(LENGTH gpus_found n_gpus)
  if(n_gpus LESS 2)
    message(STATUS "SKIPPED: needs 2 GPUs, found ${n_gpus}")
    return()
  endif()
  set(launch "${LAUNCHER}" --nproc 2)
  run_example(--smoke --epochs 1 --symmetric)
  unset(launch)
  if(rc STREQUAL "77" OR err MATCHES "no GPU is visible|built without CUDA")
    message(STATUS "SKIPPED: ${err}")
    return()
  endif()
  if(NOT rc STREQUAL "0")
    message(FATAL_ERROR "the run failed (${rc}):\n${out}\n${err}")
  endif()
  if(NOT out MATCHES "sync \\(rank 0\\): [^\n]*symmetric window")
    message(FATAL_ERROR "the gradient arena is not a symmetric window:\n${out}")
  endif()
  file(GLOB logs "${WORK}/nccl.*.log")
  set(nccl "")
  foreach(f IN LISTS logs)
    file(READ "${f}" part)
    string(APPEND nccl "${part}")
  endforeach()
  if(NOT nccl MATCHES "AllReduce \\[Symmetric\\]: [0-9]+ Bytes -> Kernel AllReduce_[A-Za-z_]+")
    message(FATAL_ERROR "NCCL's log shows no all-reduce by a symmetric kernel:\n${nccl}")
  endif()
  string(REGEX MATCH "AllReduce \\[Symmetric\\]: [^\n]*" first "${nccl}")
  if(nccl MATCHES "Algo NVLS|Kernel [A-Za-z_]*MC")
    string(REGEX MATCH "[^\n]*(Algo NVLS|Kernel [A-Za-z_]*MC)[^\n]*" bad "${nccl}")
    message(FATAL_ERROR "NCCL chose NVLink multicast with NCCL_NVLS_ENABLE=0: ${bad}")
  endif()
  message(STATUS "gpu_symmetric: ok: ${first}; no NVLS algorithm or multimem kernel")
elseif(MODE STREQUAL "tensorboard")
  run_example(--device cpu --ranks 2 --smoke --logdir "${WORK}/logs")
  if(rc STREQUAL "77")
    message(STATUS "SKIPPED: the Fashion-MNIST data set is not installed")
    return()
  endif()
  if(NOT rc STREQUAL "0" OR NOT out MATCHES "test accuracy ([0-9.]+)%[^\n]*\n[^\n]*test accuracy ([0-9.]+)%")
    message(FATAL_ERROR "the run failed (${rc}):\n${out}\n${err}")
  endif()
  set(last_acc "${CMAKE_MATCH_2}")
  execute_process(COMMAND "${PYTHON}" "${READER}" "${WORK}/logs" "${WORK}/logs/scalars.csv" /dev/null
                  RESULT_VARIABLE r OUTPUT_VARIABLE o ERROR_VARIABLE e)
  if(NOT r STREQUAL "0")
    message(FATAL_ERROR "TensorBoard's reader failed (${r}):\n${o}\n${e}")
  endif()
  string(REGEX MATCHALL "tb\ttrain/loss\t" losses "${o}")
  string(REGEX MATCHALL "tb\ttrain/lr\t" lrs "${o}")
  string(REGEX MATCHALL "tb\ttest/accuracy\t[0-9]+\t([0-9.e-]+)" accs "${o}")
  list(LENGTH losses n_loss)
  list(LENGTH lrs n_lr)
  list(LENGTH accs n_acc)
  # --smoke: 4096 images, batch 128, 2 epochs = 64 steps
  if(NOT n_loss EQUAL 64 OR NOT n_lr EQUAL 64 OR NOT n_acc EQUAL 2)
    message(FATAL_ERROR "expected 64 train/loss, 64 train/lr and 2 test/accuracy values, read ${n_loss}, ${n_lr}, ${n_acc}:\n${o}")
  endif()
  list(GET accs 1 last)
  string(REGEX REPLACE ".*\t" "" last "${last}")
  execute_process(COMMAND "${PYTHON}" -c "import sys; sys.exit(0 if abs(float('${last}')*100 - float('${last_acc}')) < 0.006 else 1)"
                  RESULT_VARIABLE same)
  if(NOT same STREQUAL "0")
    message(FATAL_ERROR "TensorBoard holds test accuracy ${last}, the run printed ${last_acc}%")
  endif()
  message(STATUS "tensorboard: ok, 64 steps and 2 epochs read back, accuracy ${last_acc}%")
else()
  message(FATAL_ERROR "check_cli.cmake: unknown MODE '${MODE}'")
endif()
