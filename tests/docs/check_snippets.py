#!/usr/bin/env python3
"""Every code block a user reads is code a test compiles.

Blocks: the ```cpp blocks of README.md and docs/*.md (numbered from 1 in each file; a block
right after a line `<!-- synopsis ... -->` is a declaration listing and is not checked) and
the \\code ... \\endcode blocks of the comments in include/lockstep (numbered likewise).
Regions: the lines between `// [snippet <file>#<n>]` and `// [end snippet]` in tests/ and
examples/. A block matches when one region, or the regions of one file for it taken in
order, hold its code (compared as the compiler reads it, as far as clang-format may change
it: whitespace dropped — alignment, line breaks —, but a // comment still ends its line;
blank lines ignored). A block's #include lines must appear in that file instead (a region
may sit inside a function).

Usage: check_snippets.py <repository root>. Exit status 1 lists every block without a
matching region and every region whose block does not exist.
"""
import pathlib
import re
import sys

MARK = re.compile(r"^\s*//\s*\[snippet\s+(\S+)#(\d+)\]\s*$")
END = re.compile(r"^\s*//\s*\[end snippet\]\s*$")
SOURCE_SUFFIXES = {".cpp", ".hpp", ".cu", ".cuh", ".h"}


def normal(lines):
    return [l.strip() for l in lines if l.strip()]


def canon(lines):
    """The code of `lines` with the whitespace a formatter may move dropped; a line holding a
    // comment keeps its end (what follows it is code again)."""
    out = []
    for line in lines:
        s = "".join(line.split())
        if s:
            out.append(s + ("\n" if "//" in s else ""))
    return "".join(out)


def first_difference(got, want):
    """Where two canonical texts part, with some context of each."""
    k = next((i for i in range(min(len(got), len(want))) if got[i] != want[i]), min(len(got), len(want)))
    def around(t):
        return t[max(0, k - 30) : k + 30].replace("\n", "⏎") or "(end)"
    return k, around(got), around(want)


def is_include(line):
    return line.startswith("#include")


def include_target(line):
    """`#include <x>  // why` -> `#include <x>`."""
    m = re.match(r'#include\s*([<"][^>"]+[>"])', line)
    return f"#include {m[1]}" if m else line


def file_includes(path):
    return {include_target(l.strip()) for l in path.read_text(encoding="utf-8").splitlines() if is_include(l.strip())}


def markdown_blocks(path, text):
    blocks, lines = [], text.splitlines()
    i, n, prev = 0, 0, ""
    while i < len(lines):
        if lines[i].strip() == "```cpp":
            n += 1
            j = i + 1
            while j < len(lines) and lines[j].strip() != "```":
                j += 1
            if not prev.startswith("<!-- synopsis"):
                blocks.append((n, i + 1, lines[i + 1 : j]))
            i = j
        if lines[i].strip():
            prev = lines[i].strip()
        i += 1
    return blocks


def header_blocks(path, text):
    blocks, body, n, start = [], None, 0, 0
    for k, line in enumerate(text.splitlines(), 1):
        s = line.strip()
        if not s.startswith("//!"):
            continue
        s = s[3:]
        if s.strip() == "\\code":
            body, start = [], k
        elif s.strip() == "\\endcode" and body is not None:
            n += 1
            blocks.append((n, start, body))
            body = None
        elif body is not None:
            body.append(s)
    return blocks


def regions(root):
    found = {}  # (doc, n) -> {file: [region lines, ...]}
    errors = []
    for top in ("tests", "examples"):
        for f in sorted((root / top).rglob("*")):
            if f.suffix not in SOURCE_SUFFIXES or not f.is_file():
                continue
            lines = f.read_text(encoding="utf-8").splitlines()
            k = 0
            while k < len(lines):
                m = MARK.match(lines[k])
                if m:
                    end = k + 1
                    while end < len(lines) and not END.match(lines[end]) and not MARK.match(lines[end]):
                        end += 1
                    if end == len(lines) or MARK.match(lines[end]):
                        errors.append(f"{f.relative_to(root)}:{k + 1}: [snippet {m[1]}#{m[2]}] has no [end snippet]")
                    found.setdefault((m[1], int(m[2])), {}).setdefault(f, []).append(lines[k + 1 : end])
                    k = end
                k += 1
    return found, errors


def main():
    root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else ".").resolve()
    docs = [root / "README.md"] + sorted((root / "docs").glob("*.md"))
    headers = sorted(p for p in (root / "include" / "lockstep").rglob("*") if p.suffix in {".hpp", ".cuh"})
    blocks = {}
    for p in docs:
        for n, line, body in markdown_blocks(p, p.read_text(encoding="utf-8")):
            blocks[(str(p.relative_to(root)), n)] = (line, body)
    for p in headers:
        for n, line, body in header_blocks(p, p.read_text(encoding="utf-8")):
            blocks[(str(p.relative_to(root)), n)] = (line, body)

    found, errors = regions(root)
    for key in sorted(found):
        if key not in blocks:
            where = ", ".join(str(f.relative_to(root)) for f in found[key])
            errors.append(f"{where}: [snippet {key[0]}#{key[1]}] names no code block (blocks there: "
                          f"{sorted(n for d, n in blocks if d == key[0]) or 'none'})")
    for key, (line, body) in sorted(blocks.items()):
        want = canon(l for l in normal(body) if not is_include(l))
        includes = [include_target(l) for l in normal(body) if is_include(l)]
        files = found.get(key, {})
        ok = False
        for f, regs in files.items():
            text_lines = file_includes(f)
            cands = [normal(r) for r in regs] + [normal(sum(regs, []))]
            if any(canon(l for l in c if not is_include(l)) == want for c in cands) and all(
                i in text_lines for i in includes
            ):
                ok = True
                break
        if ok:
            continue
        if not files:
            errors.append(f"{key[0]}:{line}: code block #{key[1]} is compiled by no test: put it between "
                          f"`// [snippet {key[0]}#{key[1]}]` and `// [end snippet]` in a test "
                          f"(tests/docs/), or, for a declaration listing in a .md, precede it with "
                          f"`<!-- synopsis -->`")
            continue
        for f, regs in files.items():
            got = canon(l for l in normal(sum(regs, [])) if not is_include(l))
            at, g, w = first_difference(got, want)
            missing = [i for i in includes if i not in file_includes(f)]
            errors.append(f"{key[0]}:{line}: code block #{key[1]} differs from its copy in "
                          f"{f.relative_to(root)}: at character {at} of the code without whitespace "
                          f"(⏎: a comment's end) the doc has `{w}`, the test `{g}`"
                          + (f"; the test lacks {missing}" if missing else "") +
                          " — change both together")
    for e in errors:
        print(e)
    print(f"check_snippets: {len(blocks)} code blocks, {len(errors)} problem(s)")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
