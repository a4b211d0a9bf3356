#!/usr/bin/env bash
# GPU check for a machine with NVIDIA GPUs: builds lockstep with CUDA (sm_90 by default),
# runs lockstep-info, the gpu and multigpu tests and the benchmarks, and leaves logs in
# $OUT (default ./gpu-out). Usage: scripts/gpu_check.sh [bench-iterations]
#   DOCTEST_PREFIX=dir   where doctest's headers and CMake package are, if not installed
#   SHAPES=file          GPT-2 shapes (default: ../shared/data/gpt2_124m_shapes.txt)
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
BUILD=${BUILD_DIR:-build-gpu}
ITERS=${1:-30}
SHAPES=${SHAPES:-../shared/data/gpt2_124m_shapes.txt}
ARCH=${CUDA_ARCH:-90}
prefix_args=()
[ -n "${DOCTEST_PREFIX:-}" ] && prefix_args=(-DCMAKE_PREFIX_PATH="$DOCTEST_PREFIX")

{ date -u; git rev-parse HEAD 2>/dev/null; nvidia-smi -L; nvidia-smi topo -m; } 2>&1 | tee "$OUT/machine.txt"
cmake -S . -B "$BUILD" -DLOCKSTEP_ENABLE_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="$ARCH" \
  -DLOCKSTEP_BUILD_EXAMPLES="${BUILD_EXAMPLES:-OFF}" "${prefix_args[@]}" >"$OUT/configure.log" 2>&1 \
  || { tail -40 "$OUT/configure.log"; exit 1; }
# Keep going past a broken target so the rest still gets tested; report what failed.
if ! cmake --build "$BUILD" -j"$(nproc)" -- -k >"$OUT/build.log" 2>&1; then
  echo "BUILD FAILED for some targets:"; grep -E "error" -A5 "$OUT/build.log" | head -60
fi
echo "== lockstep-info"; "$BUILD/tools/lockstep-info" 2>&1 | tee "$OUT/info.txt"
echo "== tests (gpu, multigpu)"
(cd "$BUILD" && ctest -L 'gpu|multigpu' --output-on-failure --timeout 240) >"$OUT/ctest_gpu.txt" 2>&1
rc=$?
grep -E "Passed|Failed|Skipped|Not Run|tests passed|tests failed|SKIPPED|\*\*\*" "$OUT/ctest_gpu.txt" | tail -60
echo "== bench_kernels"; timeout 200 "$BUILD/bench/bench_kernels" "$SHAPES" 2>&1 | tee "$OUT/bench_kernels.txt"
echo "== bench_sync"; timeout 240 "$BUILD/bench/bench_sync" --shapes "$SHAPES" --iters "$ITERS" 2>&1 | tee "$OUT/bench_sync.txt"
exit $rc
