#!/usr/bin/env python3
"""Every ctest test carries a label (cpu, gpu, multigpu, mpi, torch): the README's test command
and CI select tests by label, so an unlabelled test silently never runs there. The usual cause
is a doctest name with a comma, which doctest_discover_tests splits on, losing the TEST_SUITE's
label.

Usage: check_labels.py CTEST_COMMAND BUILD_DIR. Exit status 1 names each unlabelled test.
"""
import json
import subprocess
import sys


def main(ctest, build):
    out = subprocess.run([ctest, "--show-only=json-v1"], cwd=build, capture_output=True, text=True, check=True).stdout
    tests = json.loads(out).get("tests", [])
    bad = []
    for t in tests:
        labels = next((p["value"] for p in t.get("properties", []) if p["name"] == "LABELS"), [])
        if not labels:
            bad.append(t["name"])
    for name in bad:
        print(f"check_labels: the test '{name}' has no label, so `ctest -L ...` never runs it "
              "(a doctest name with a comma loses its suite's label: rename it; else set LABELS)")
    print(f"check_labels: {len(tests)} tests, {len(bad)} without a label")
    return 1 if bad else 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1], sys.argv[2]))
