#!/usr/bin/env bash
# Checks that the C++/CUDA sources under include/ tools/ examples/ bench/ tests/ are formatted
# by .clang-format (clang-format 19, Debian 12's clang-format-19; scripts/install_deps.sh installs it:
# other versions lay some constructs out differently, so the check names its binary).
# Exit 0: formatted; 1: some file is not (the lines are listed, and the command that fixes
# them); 77: clang-format is missing (ctest reports the test format_check as skipped).
# Usage: scripts/check_format.sh [clang-format binary]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
cf=${1:-${CLANG_FORMAT:-clang-format-19}}
if ! command -v "$cf" >/dev/null 2>&1; then
  echo "check_format: $cf not found; skipped (scripts/install_deps.sh installs clang-format-19)"
  exit 77
fi
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  mapfile -t files < <(git ls-files -- include tools examples bench tests |
                       grep -E '\.(hpp|cuh|cpp|cu|h)$' || true)
else  # a source tree without git (a release tarball)
  mapfile -t files < <(find include tools examples bench tests -type f \
                       \( -name '*.hpp' -o -name '*.cuh' -o -name '*.cpp' -o -name '*.cu' -o -name '*.h' \) | sort)
fi
bad=()
log=$(mktemp)
trap 'rm -f "$log"' EXIT
for f in "${files[@]}"; do
  [[ -f $f ]] || continue  # deleted in the work tree, not yet in the index
  if ! "$cf" --dry-run --Werror "$f" 2>"$log"; then
    bad+=("$f")
    head -n 20 "$log"
  fi
done
if ((${#bad[@]})); then
  echo "check_format: ${#bad[@]} of ${#files[@]} files are not formatted ($("$cf" --version)). Fix them with:"
  echo "  cd $root && $cf -i ${bad[*]}"
  exit 1
fi
echo "check_format: ${#files[@]} files formatted"
