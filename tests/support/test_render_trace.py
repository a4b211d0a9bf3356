#!/usr/bin/env python3
"""The ctest render_trace.cpu_ranks: scripts/render_trace.py on a real LOCKSTEP_TRACE run.

Runs render_trace_run (tests/support/render_trace_run.cpp: 4 CPU ranks, small buckets, a step
skipped for a NaN) with LOCKSTEP_TRACE set, renders a step and checks
 - the PNG: signature, IHDR (read with struct; its CRC with zlib) of the asked width and the
   height the script printed, IEND at the end, and the colours of forward + backward and of
   the bucket collectives in its pixels;
 - the summary: a row for every rank, with a step time and between 2 and the bucket count
   collectives; the skipped step marked on every rank for --step at that step;
 - the errors: a rank's file missing, a file cut short (invalid JSON), a step that does not
   exist, an empty directory — exit status 1, a message naming the rank or the file, no PNG;
 - --gpu-trace: a Kineto-like trace, plain and gzip'd, on another clock: kernels of its
   ProfilerStep counted per GPU, the rest left out.

Usage: test_render_trace.py RENDER_TRACE_RUN RENDER_TRACE_PY WORK_DIR
Exit status 77 (skipped) when matplotlib cannot be imported, 1 on a failed check.
"""
import gzip
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import zlib

RANKS, STEPS, BAD_STEP = 4, 12, 3
failures = []


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what)
    if not ok:
        failures.append(what)
    return ok


def run(cmd, env=None):
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)
    print(f"$ {' '.join(cmd)}  -> {p.returncode}")
    return p


def render(script, args):
    return run([sys.executable, script] + args)


def png_size(path):
    """(width, height) from the IHDR; checks the signature, the IHDR CRC and the IEND chunk."""
    data = open(path, "rb").read()
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError("no PNG signature")
    length, kind = struct.unpack(">I4s", data[8:16])
    if kind != b"IHDR" or length != 13:
        raise ValueError(f"first chunk is {kind!r} of {length} bytes, not IHDR")
    body = data[16:29]
    (crc,) = struct.unpack(">I", data[29:33])
    if zlib.crc32(kind + body) != crc:
        raise ValueError("IHDR CRC mismatch")
    if data[-12:] != b"\x00\x00\x00\x00IEND\xaeB`\x82":
        raise ValueError("does not end with IEND")
    w, h = struct.unpack(">II", body[:8])
    return w, h


def colour_pixels(path, hex_colour):
    import matplotlib.image
    import numpy

    img = matplotlib.image.imread(path)
    want = numpy.array([int(hex_colour[i:i + 2], 16) / 255 for i in (1, 3, 5)])
    return int(numpy.all(numpy.abs(img[..., :3] - want) < 0.01, axis=-1).sum())


def summary_rows(text):
    rows = {}
    for line in text.splitlines():
        m = re.match(r"rank (\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+(\d+)"
                     r"\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)(.*)$", line)
        if m:
            rows[int(m[1])] = {"step": float(m[2]), "model": float(m[3]), "collectives": int(m[6]),
                               "in_flight": float(m[7]), "overlapped": float(m[8]), "rest": m[10].strip()}
    return rows


def kineto_trace(path, step_us, compressed):
    """A PyTorch-profiler-like trace on a clock far from lockstep's: ProfilerStep#0..3 10 s apart;
    in #2 (the default one, the last-but-one) GPU 0 runs 3 compute kernels and 1 NCCL kernel
    and GPU 1 2 and 2, all within step_us of the step's start; the other steps' kernels are
    far outside the picture's window."""
    base = 1.7e15
    events = [{"ph": "M", "name": "process_name", "pid": 4242, "args": {"name": "python"}}]
    plan = {0: [("ampere_sgemm_128x64_tn", 0.05, 0.30), ("elementwise_kernel", 0.32, 0.40),
                ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 0.35, 0.70), ("vectorized_kernel", 0.72, 0.80)],
            1: [("sm90_xmma_gemm", 0.10, 0.50), ("ncclKernel_AllReduce_RING_LL_Sum_float", 0.40, 0.60),
                ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 0.62, 0.75), ("reduce_kernel", 0.76, 0.85)]}
    for k in range(4):
        t = base + k * 10e6
        events.append({"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{k}", "pid": 4242, "tid": 4242,
                       "ts": t, "dur": step_us})
        events.append({"ph": "X", "cat": "gpu_user_annotation", "name": f"ProfilerStep#{k}", "pid": 0, "tid": 7,
                       "ts": t + 3e6, "dur": step_us})  # ignored: the GPU's copy of the annotation
        for dev, kernels in plan.items():
            for name, a, b in kernels:
                events.append({"ph": "X", "cat": "kernel", "name": name, "pid": dev, "tid": 7,
                               "ts": t + a * step_us, "dur": (b - a) * step_us,
                               "args": {"device": dev, "stream": 7 if "nccl" not in name else 13}})
    doc = {"schemaVersion": 1, "traceEvents": events}
    if compressed:
        with gzip.open(path, "wt", encoding="utf-8") as f:
            json.dump(doc, f)
    else:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(doc, f)


def main(program, script, work):
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("SKIPPED: the python3 running this test has no matplotlib (python3 -m pip install matplotlib; "
              "scripts/install_deps.sh does it)")
        return 77
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    trace = os.path.join(work, "trace")
    env = dict(os.environ, LOCKSTEP_TRACE=trace, LOCKSTEP_TIMEOUT="60")
    p = run([program, str(RANKS), str(STEPS), str(BAD_STEP)], env)
    print(p.stdout + p.stderr)
    if not check(p.returncode == 0, "the traced program ran"):
        return 1
    buckets = int(re.search(r"buckets (\d+)", p.stdout)[1])
    files = sorted(os.listdir(trace))
    check(len(files) == RANKS and all(re.fullmatch(r"lockstep_trace\.rank\d\.pid\d+\.json", f) for f in files),
          f"one trace file per rank: {files}")

    # The default step, rendered.
    out = os.path.join(work, "step.png")
    p = render(script, [trace, "--out", out, "--title", "render_trace test", "--width", "1200", "--dpi", "100"])
    print(p.stdout + p.stderr)
    if not check(p.returncode == 0, "render_trace.py rendered the default step"):
        return 1
    m = re.search(r"wrote .* \((\d+) x (\d+) pixels\)", p.stdout)
    check(m is not None, "it says the picture's size")
    try:
        w, h = png_size(out)
        check(True, f"{out} is a PNG of {w} x {h}")
        check(w == 1200, "the PNG is as wide as --width")
        check(m is not None and (w, h) == (int(m[1]), int(m[2])), "the PNG's size is the one printed")
        check(RANKS * 3 * 25 < h < 3000, "its height fits 3 lanes per rank")
        check(colour_pixels(out, "#4c78a8") > 1000, "forward + backward is drawn (its colour in the pixels)")
        check(colour_pixels(out, "#54a24b") > 100, "the bucket collectives are drawn (their colour in the pixels)")
    except (OSError, ValueError) as e:
        check(False, f"{out} is a PNG: {e}")
    rows = summary_rows(p.stdout)
    check(sorted(rows) == list(range(RANKS)), f"the summary has a row for every rank: {sorted(rows)}")
    chosen = re.search(r"step (\d+) of 0\.\.(\d+) \(rank 0's median-duration step", p.stdout)
    check(chosen is not None and chosen[2] == str(STEPS - 1) and chosen[1] != "0",
          "the default step is rank 0's median one, not the first")
    for r, row in rows.items():
        check(2 <= row["collectives"] <= buckets,
              f"rank {r}: {row['collectives']} collectives (2 to {buckets} buckets)")
        check(row["step"] > 0 and 0 < row["model"] <= row["step"] + 1e-3, f"rank {r}: step {row['step']} ms, "
              f"forward + backward {row['model']} ms")
        check(row["overlapped"] <= row["in_flight"] + 1e-3, f"rank {r}: overlapped within in flight")

    # The skipped step, summary only (no --out: no matplotlib needed), named from the end too.
    p = render(script, [os.path.join(trace, f) for f in files] + ["--step", str(BAD_STEP)])
    rows = summary_rows(p.stdout)
    check(p.returncode == 0 and sorted(rows) == list(range(RANKS)) and
          all(r["rest"] == "skipped (inf/NaN)" for r in rows.values()), "--step at the skipped step marks every rank")
    p = render(script, [trace, "--step", str(BAD_STEP - STEPS)])
    check(p.returncode == 0 and all(r["rest"] == "skipped (inf/NaN)" for r in summary_rows(p.stdout).values()),
          "a negative --step counts from the end")

    # Errors: exit 1, a message naming what is wrong, no picture.
    def fails(args, pattern, what):
        bad_out = os.path.join(work, "bad.png")
        if os.path.exists(bad_out):
            os.remove(bad_out)
        p = render(script, args + ["--out", bad_out])
        print(p.stderr.strip())
        check(p.returncode == 1 and re.search(pattern, p.stderr) is not None and not os.path.exists(bad_out),
              f"{what}: exit 1, a message matching {pattern!r}, no PNG")

    missing = os.path.join(work, "missing_rank")
    os.makedirs(missing)
    for f in files:
        if ".rank2." not in f:
            shutil.copy(os.path.join(trace, f), missing)
    fails([missing], r"rank 2 missing: no lockstep_trace\.rank2\.\*\.json", "a rank's file missing")
    cut = os.path.join(work, "cut_short")
    shutil.copytree(trace, cut)
    victim = os.path.join(cut, [f for f in files if ".rank1." in f][0])
    text = open(victim).read()
    open(victim, "w").write(text[: len(text) // 2])
    fails([cut], re.escape(victim) + r": not valid JSON", "a file cut short")
    fails([trace, "--step", "99"], r"--step 99: .*rank0.* has 12 steps", "a step that does not exist")
    empty = os.path.join(work, "empty")
    os.makedirs(empty)
    fails([empty], re.escape(empty) + r": no lockstep_trace\.rank\*\.json", "an empty directory")

    # --gpu-trace: lanes per GPU, aligned at the step's start.
    step_us = min(r["step"] for r in rows.values()) * 1e3 if rows else 1000.0
    for name, compressed in (("kineto.json", False), ("kineto.json.gz", True)):
        kin = os.path.join(work, name)
        kineto_trace(kin, step_us, compressed)
        gout = os.path.join(work, "gpu.png")
        p = render(script, [trace, "--step", str(BAD_STEP), "--gpu-trace", kin, "--out", gout, "--width", "1200",
                            "--dpi", "100"])
        print(p.stdout + p.stderr)
        check(p.returncode == 0, f"--gpu-trace {name} rendered")
        gpu = {d: re.search(rf"GPU {d}: (\d+) compute kernels .*, (\d+) NCCL kernels .*"
                            rf"\(ProfilerStep#2 at rank {d}'s step start\)", p.stdout) for d in (0, 1)}
        g0, g1 = gpu[0], gpu[1]
        check(g0 is not None and (g0[1], g0[2]) == ("3", "1"), "GPU 0: ProfilerStep#2's 3 compute and 1 NCCL kernels")
        check(g1 is not None and (g1[1], g1[2]) == ("2", "2"), "GPU 1: ProfilerStep#2's 2 compute and 2 NCCL kernels")
        try:
            gw, gh = png_size(gout)
            check(gw == 1200 and gh > h, "the picture with GPU lanes is taller")
            check(colour_pixels(gout, "#2e8b57") > 50, "NCCL kernels are drawn")
        except (OSError, ValueError) as e:
            check(False, f"{gout} is a PNG: {e}")
    fails([trace, "--gpu-trace", os.path.join(work, "kineto.json"), "--gpu-step", "7"],
          r"kineto\.json: no ProfilerStep#7 \(it has 0, 1, 2, 3\)", "a --gpu-step that does not exist")

    print(f"{len(failures)} failed" if failures else "all passed")
    return 1 if failures else 0


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    sys.exit(main(*sys.argv[1:]))
