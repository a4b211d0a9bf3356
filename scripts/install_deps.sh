#!/usr/bin/env bash
# Installs what building and testing lockstep needs on Debian 12, with apt-get, and only
# what is missing (a second run is a quick no-op). As root it installs; otherwise it prints
# the command to run and exits non-zero when something is missing.
set -euo pipefail

packages=(
  cmake g++ make ninja-build  # build
  doctest-dev                 # tests
  python3-minimal             # tests/docs/check_snippets.py: every code block in the docs is compiled
  zlib1g-dev                  # reads the gzip'd IDX files of the examples
  dataset-fashion-mnist       # examples/01_fashion_mnist
  libopenmpi-dev openmpi-bin  # lockstep::mpi and its tests
  clang libclang-rt-14-dev    # the libFuzzer target of the TCP store protocol
  libtorch-dev                # lockstep::torch and its tests (libtorch 1.13, CPU)
  fortunes                    # text for examples/03_gpt2_torch (its CPU test)
  lintian                     # checks the Debian packages (tests/packaging: packaging_deb)
  clang-format-19             # scripts/check_format.sh (ctest: format_check; 14 misreads requires-clauses)
)

missing=()
for p in "${packages[@]}"; do
  # dpkg -s also lists removed-but-configured packages; require "install ok installed".
  if [[ "$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true)" != "install ok installed" ]]; then
    missing+=("$p")
  fi
done

# Python packages the tests use, into the python3 on PATH: TensorBoard's own reader (tests whose
# name contains "tensorboard" read lockstep's event files with it), matplotlib
# (scripts/render_trace.py draws a trace with it; the test render_trace.cpu_ranks) and Conan 2
# (the test packaging_conan runs `conan create` on packaging/conan, offline).
python_deps() {
  if python3 -c 'import tensorboard, matplotlib' 2>/dev/null && command -v conan >/dev/null; then return 0; fi
  if [[ $(id -u) -ne 0 ]]; then
    echo "install_deps: missing the Python package tensorboard, matplotlib or conan: run  python3 -m pip install tensorboard matplotlib conan" >&2
    return 1
  fi
  echo "install_deps: installing the Python packages tensorboard, matplotlib and conan"
  if ! python3 -m pip --version >/dev/null 2>&1; then
    apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3-pip
  fi
  python3 -m pip install --quiet tensorboard matplotlib conan 2>/dev/null ||
    python3 -m pip install --quiet --break-system-packages tensorboard matplotlib conan  # Debian's own python3
  hash -r  # conan's entry point is new on PATH
}

if [[ ${#missing[@]} -eq 0 ]]; then
  echo "install_deps: all ${#packages[@]} packages present"
  python_deps
  exit 0
fi

cmd=(apt-get install -y --no-install-recommends "${missing[@]}")
if [[ $(id -u) -ne 0 ]]; then
  echo "install_deps: missing packages: ${missing[*]}" >&2
  echo "install_deps: run as root:  apt-get update && DEBIAN_FRONTEND=noninteractive ${cmd[*]}" >&2
  exit 1
fi

echo "install_deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update
"${cmd[@]}"
python_deps
