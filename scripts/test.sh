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
# shellcheck disable=SC2206  # CMAKE_ARGS is a list of words on purpose
configure+=(${CMAKE_ARGS:-})
"${configure[@]}"
cmake --build "$build" -j "$jobs"

# Test labels to run (ctest -L takes a regular expression).
labels=(cpu)
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
