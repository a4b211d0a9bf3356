#!/usr/bin/env bash
# Runs the benchmarks of an earlier lockstep and of this tree in one call on one machine, so
# that a change's effect is measured against the same GPUs (bench/RESULTS.md's before/after
# tables). bench_kernels is this tree's source built against both trees' headers (it uses
# lockstep's public API only); bench_sync is each tree's own.
#
#   scripts/bench_before_after.sh OLD_SOURCE_DIR [abcd] [iterations]
#     OLD_SOURCE_DIR  an unpacked earlier lockstep, e.g. `git archive 8dd442e | tar -x -C old`
#     abcd            which benchmarks (default: all; d = bench_kernels, a-c = bench_sync)
#   SHAPES=file  GPT-2 shapes (default ../shared/data/gpt2_124m_shapes.txt); OUT=dir (logs);
#   BUILD_NEW / BUILD_OLD: build folders (default build-bench, build-bench-old); CUDA_ARCH (90)
set -euo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
old_src=$(cd "${1:?usage: scripts/bench_before_after.sh OLD_SOURCE_DIR [abcd] [iterations]}" && pwd)
which=${2:-abcd}
iters=${3:-20}
SHAPES=${SHAPES:-../shared/data/gpt2_124m_shapes.txt}
OUT=${OUT:-gpu-out}
BUILD_NEW=${BUILD_NEW:-build-bench}
BUILD_OLD=${BUILD_OLD:-build-bench-old}
ARCH=${CUDA_ARCH:-90}
mkdir -p "$OUT"

cp bench/bench_kernels.cu "$old_src/bench/bench_kernels.cu"
configure=(-G Ninja -DCMAKE_BUILD_TYPE=Release -DLOCKSTEP_ENABLE_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="$ARCH"
           -DLOCKSTEP_ENABLE_MPI=OFF -DLOCKSTEP_BUILD_TESTS=OFF -DLOCKSTEP_BUILD_EXAMPLES=OFF
           -DLOCKSTEP_BUILD_TOOLS=OFF -DLOCKSTEP_BUILD_BENCH=ON)
cmake -S "$old_src" -B "$BUILD_OLD" "${configure[@]}" >"$OUT/configure_old.log"
cmake -S . -B "$BUILD_NEW" "${configure[@]}" >"$OUT/configure_new.log"
cmake --build "$BUILD_OLD" -j --target bench_kernels bench_sync >"$OUT/build_old.log" 2>&1 &
old_pid=$!
cmake --build "$BUILD_NEW" -j --target bench_kernels bench_sync >"$OUT/build_new.log" 2>&1
wait "$old_pid"

# Old, new, old, new...: drift of the machine shows up as a difference between the two old runs.
for tree in old new; do
  build=$BUILD_NEW
  [[ $tree == old ]] && build=$BUILD_OLD
  if [[ $which == *d* ]]; then
    echo "== bench_kernels ($tree)"
    "$build/bench/bench_kernels" "$SHAPES" | tee "$OUT/bench_kernels_$tree.txt"
  fi
  only=${which//d/}
  if [[ -n $only ]]; then
    echo "== bench_sync --only $only ($tree)"
    "$build/bench/bench_sync" --shapes "$SHAPES" --iters "$iters" --only "$only" | tee "$OUT/bench_sync_$tree.txt"
  fi
done
