#!/usr/bin/env bash
# THE test command: installs dependencies, configures, builds and runs the tests.
#   scripts/test.sh                 build in ./build, run the cpu tests
#   BUILD_DIR=/tmp/b scripts/test.sh
#   CMAKE_ARGS="-DLOCKSTEP_ENABLE_CUDA=OFF" scripts/test.sh
# Exits with ctest's exit code.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)

bash scripts/install_deps.sh

build=${BUILD_DIR:-$root/build}
jobs=$(nproc)

configure=(cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE="${CMAKE_BUILD_TYPE:-Release}")
# Ninja when available, for a fresh build dir only (a configured one keeps its generator).
if [[ ! -f "$build/CMakeCache.txt" ]] && command -v ninja >/dev/null; then
  configure+=(-G Ninja)
fi
# No GPU to run them on: the GPU tests and CUDA benchmarks are only compiled (as unoptimised
# PTX); with one, built for real (also in a build folder configured without one before).
if nvidia-smi -L >/dev/null 2>&1; then
  configure+=(-DLOCKSTEP_CUDA_COMPILE_ONLY=OFF)
else
  configure+=(-DLOCKSTEP_CUDA_COMPILE_ONLY=ON)
fi
# shellcheck disable=SC2206  # CMAKE_ARGS is a list of words on purpose
configure+=(${CMAKE_ARGS:-})
"${configure[@]}"
cmake --build "$build" -j "$jobs"

# Every test carries a label, or `ctest -L` would pass it over without a word (doctest
# names with a comma lose theirs: doctest_discover_tests splits the label list there).
all_tests=$(cd "$build" && ctest -N | grep -c "Test *#" || true)
labelled=$(cd "$build" && ctest -N -L "^(cpu|mpi|torch|gpu|multigpu)\$" | grep -c "Test *#" || true)
if [[ "$all_tests" != "$labelled" ]]; then
  echo "test.sh: $((all_tests - labelled)) test(s) carry no cpu/mpi/torch/gpu/multigpu label, so no run would include them:" >&2
  (cd "$build" && comm -23 <(ctest -N | grep "Test *#" | sed 's/.*: //' | sort) \
                          <(ctest -N -L "^(cpu|mpi|torch|gpu|multigpu)\$" | grep "Test *#" | sed 's/.*: //' | sort)) >&2
  echo "test.sh: give each a TEST_SUITE (cpu, gpu, multigpu, mpi, torch) or LABELS, and no comma in a doctest name" >&2
  exit 1
fi

# Test labels to run (ctest -L takes a regular expression).
labels=(cpu torch)  # torch: the libtorch adapter's tests (reported skipped without libtorch)
# --- other labels go here once their suites exist, e.g. (each decides if it can run):
#   command -v nvidia-smi >/dev/null && labels+=(gpu)
#   [[ $(nvidia-smi -L 2>/dev/null | wc -l) -ge 2 ]] && labels+=(multigpu)
# MPI tests: when an MPI launcher is on PATH and lockstep::mpi was built (tests/mpi added tests).
if command -v mpirun >/dev/null && grep -qs add_test "$build/tests/mpi/CTestTestfile.cmake"; then
  labels+=(mpi)
  # Open MPI refuses to start as root (containers, CI) unless both are set.
  if [[ $(id -u) -eq 0 ]]; then
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  fi
fi
label_regex=$(IFS='|'; echo "^(${labels[*]})\$")

set +e
(cd "$build" && ctest -L "$label_regex" --no-tests=error --output-on-failure -j "$jobs")
rc=$?
set -e
echo "test.sh: ctest -L '$label_regex' exited with $rc"
exit $rc
