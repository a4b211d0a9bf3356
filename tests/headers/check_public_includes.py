#!/usr/bin/env python3
"""Users include lockstep's public headers only (docs/design.md, "Layout"): fails when a file
written as a user would write it -- examples/, bench/, the docs' code blocks (docs/*.md,
README.md), the docs' compiled snippets (tests/docs/) and the packaging consumer
(tests/packaging/) -- includes a header under a detail/ folder.

Usage: check_public_includes.py <source dir>. Exit status 1 with one line per offending include.
"""
import pathlib
import re
import sys

INCLUDE = re.compile(r'#\s*include\s*[<"](lockstep/(?:[^">]*/)?detail/[^">]+)[">]')
USER_DIRS = ["examples", "bench", "tests/docs", "tests/packaging"]
SOURCES = (".cpp", ".cu", ".hpp", ".cuh", ".h", ".md")


def main(root):
    root = pathlib.Path(root)
    files = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    for d in USER_DIRS:
        files += sorted(p for p in (root / d).rglob("*") if p.suffix in SOURCES)
    problems = []
    for f in files:
        for n, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
            for inc in INCLUDE.findall(line):
                problems.append(f"{f.relative_to(root)}:{n}: includes {inc}, an internal header; include the "
                                "public header that provides what it needs (lockstep.hpp, cuda.cuh, mpi.hpp, torch.hpp)")
    for p in problems:
        print(p)
    print(f"{len(files)} user-facing files, {len(problems)} internal include(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "."))
