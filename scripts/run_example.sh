#!/usr/bin/env bash
# Builds and runs examples/01_fashion_mnist; arguments are passed to the program.
#   scripts/run_example.sh [args...]      (BUILD_DIR overrides ./build)
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)

bash scripts/install_deps.sh

build=${BUILD_DIR:-$root/build}
configure=(cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE="${CMAKE_BUILD_TYPE:-Release}")
if [[ ! -f "$build/CMakeCache.txt" ]] && command -v ninja >/dev/null; then
  configure+=(-G Ninja)
fi
# shellcheck disable=SC2206
configure+=(${CMAKE_ARGS:-})
"${configure[@]}"
cmake --build "$build" --target fashion_mnist -j "$(nproc)"
exec "$build/examples/01_fashion_mnist/fashion_mnist" "$@"
