#!/usr/bin/env python3
"""Checks the layout rules of include/lockstep (docs/design.md, "Layout"):

  1. every header belongs to a layer; an include goes to a strictly lower layer or stays in
     its own folder (a folder's detail/ counts as the folder);
  2. no include cycle among lockstep's headers;
  3. lockstep/detail/ holds leaf utilities: they include nothing of lockstep but detail/;
  4. at most 10 headers directly in include/lockstep/, none over 450 lines.

Usage: check_layers.py <include dir>. Exit status 1 with one line per violation.
"""
import os
import re
import sys

# Lowest first. A folder may include its own files and any folder of a lower layer.
LAYERS = {
    "detail": 0, "version.hpp": 0,
    "core": 1,
    "comm": 2, "data": 2,
    "scaling": 3, "optim": 3, "store": 3, "observe": 3,
    "parallel": 4, "checkpoint": 4, "launch": 4,
    "elastic": 5,                          # composes DataParallel, checkpoints and the sampler
    "cuda": 5, "mpi": 5, "torch": 5,
    "run.hpp": 6,                          # run(Auto): every compiled-in mode
    "lockstep.hpp": 7,                     # umbrella of the CPU part
    "cuda.cuh": 8, "mpi.hpp": 8, "torch.hpp": 8,  # umbrellas of the optional parts
}
MAX_TOP_LEVEL = 10
MAX_LINES = 450
INCLUDE = re.compile(r'^\s*#\s*include\s*[<"](lockstep/[^">]+)[">]', re.M)


def unit(rel):
    """The folder (or top-level file) a header path 'lockstep/x/y.hpp' belongs to."""
    parts = rel.split("/")
    return parts[1]


def main(root):
    headers = {}
    for dirpath, _, files in os.walk(os.path.join(root, "lockstep")):
        for f in files:
            if f.endswith((".hpp", ".cuh")):
                path = os.path.join(dirpath, f)
                headers[os.path.relpath(path, root).replace(os.sep, "/")] = path
    problems = []
    graph = {}
    for rel, path in sorted(headers.items()):
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
        lines = text.count("\n")
        if lines > MAX_LINES:
            problems.append(f"{rel}: {lines} lines (at most {MAX_LINES}; split it at a seam)")
        u = unit(rel)
        if u not in LAYERS:
            problems.append(f"{rel}: folder or file '{u}' has no layer in check_layers.py (add it)")
            continue
        graph[rel] = []
        for inc in INCLUDE.findall(text):
            if inc not in headers:
                problems.append(f"{rel}: includes {inc}, which does not exist")
                continue
            graph[rel].append(inc)
            v = unit(inc)
            if v == u:
                continue
            if u == "detail":
                problems.append(f"{rel}: detail/ holds leaf utilities, but it includes {inc}")
            elif LAYERS.get(v, 99) >= LAYERS[u]:
                problems.append(f"{rel} (layer {LAYERS[u]}, {u}/) includes {inc} (layer {LAYERS.get(v)}, {v}/): "
                                f"an arrow to the same or a higher layer")
    top = [r for r in headers if r.count("/") == 1]
    if len(top) > MAX_TOP_LEVEL:
        problems.append(f"{len(top)} headers directly in include/lockstep/ (at most {MAX_TOP_LEVEL}): {sorted(top)}")
    # cycles: depth-first search with colours
    colour = {h: 0 for h in graph}
    stack = []

    def visit(h):
        colour[h] = 1
        stack.append(h)
        for n in graph.get(h, []):
            if colour.get(n) == 1:
                problems.append("include cycle: " + " -> ".join(stack[stack.index(n):] + [n]))
            elif colour.get(n) == 0:
                visit(n)
        stack.pop()
        colour[h] = 2

    for h in sorted(graph):
        if colour[h] == 0:
            visit(h)
    for p in problems:
        print(p)
    print(f"{len(headers)} headers, {len(top)} at top level, {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
