#!/usr/bin/env python3
"""lockstep-info --estimate as a user runs it: the table from a saved probe (benchmark c of
bench/RESULTS.md, run 3: the numbers of docs/observe.md), communication only, a measurement on
CPU ranks written with --save-probe and read back, and bad arguments (exit code 2, the flag named).

Usage: check_estimate.py <lockstep-info> <repository root>. Exit status 1 with what failed.
"""
import os
import subprocess
import sys
import tempfile

info, root = sys.argv[1], sys.argv[2]
probe = os.path.join(root, "bench", "probe_h200x4_run3.txt")
failures = []


def run(*args):
    env = dict(os.environ, LOCKSTEP_CPU_RANKS="2")  # measure CPU ranks even where GPUs are visible
    p = subprocess.run([info, *args], capture_output=True, text=True, env=env, timeout=120)
    return p.returncode, p.stdout, p.stderr


def expect(ok, what, out=""):
    if not ok:
        failures.append(what + ("\n--- output ---\n" + out if out else ""))


def table(out):
    """{gpus: [no-overlap ms, speed-up, eff %, overlap ms, ..., sharded eff %]} from the rows."""
    rows = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.split("|")]
        if len(cells) == 4 and cells[0].isdigit():
            rows[int(cells[0])] = [float(x) for c in cells[1:] for x in c.replace("%", "").split()]
    return rows


with tempfile.TemporaryDirectory() as tmp:
    mlp = os.path.join(tmp, "mlp.txt")
    with open(mlp, "w") as f:
        for layer in range(8):
            f.write(f"l{layer}.weight 4096 4096\nl{layer}.bias 4096\n")
    # c, fp32, 4 GPUs, 25 MiB buckets: docs/observe.md gives 4.711 ms (parameter count) and
    # 4.558 ms (shapes) against 4.122 measured.
    common = ["--dtype", "f32", "--step-ms", "2.726", "--backward-fraction", "0.410858", "--optimizer-ms", "0.3963",
              "--bucket-mib", "25", "--gpus", "4", "--probe", probe]
    for label, args, overlap in (("params", ["--params", "134250496"], 4.711), ("shapes", ["--shapes", mlp], 4.558)):
        rc, out, err = run("--estimate", *args, *common)
        rows = table(out)
        expect(rc == 0 and sorted(rows) == [1, 2, 3, 4], f"{label}: exit 0 and rows for 1..4 GPUs", out + err)
        if rows.get(1) and rows.get(4):
            expect(rows[1] == [2.726, 1.0, 100.0] * 3, f"{label}: 1 GPU is the step itself", out)
            expect(abs(rows[4][3] - overlap) < 0.005, f"{label}: overlap on 4 GPUs {rows[4][3]} ms, want {overlap}", out)
            expect(abs(rows[4][4] - 4 * 2.726 / rows[4][3]) < 0.01, f"{label}: speed-up = G·T/step", out)
        expect("smaller than the smallest size probed on 2 ranks (249 MB)" in out and "note: 3 GPUs not probed" in out,
               f"{label}: extrapolation below the probe is named", out)

    rc, out, err = run("--estimate", "--params", "134250496", "--probe", probe)
    expect(rc == 0 and "give --step-ms T" in out and "bucket by bucket ms" in out, "communication only", out + err)

    saved = os.path.join(tmp, "cpu.probe")
    rc, out, err = run("--estimate", "--params", "1000000", "--step-ms", "10", "--gpus", "2", "--save-probe", saved)
    expect(rc == 0 and "measuring the all-reduce on 2 CPU ranks" in out, "measure on CPU ranks", out + err)
    if os.path.exists(saved):
        lines = open(saved).read().splitlines()
        points = [l for l in lines if l.startswith("all_reduce ranks=2 bytes=")]
        expect(lines[0] == "lockstep-probe 1" and len(points) == 5, "the saved probe: header and 5 points", "\n".join(lines))
        rc, out, err = run("--estimate", "--params", "1000000", "--step-ms", "10", "--probe", saved)
        expect(rc == 0 and sorted(table(out)) == [1, 2], "the saved probe reads back", out + err)
    else:
        expect(False, "--save-probe wrote no file", out + err)

    bad_probe = os.path.join(tmp, "bad.probe")
    with open(bad_probe, "w") as f:
        f.write("lockstep-probe 1\nbroadcast ranks=2 bytes=10 ms=1\n")
    bad = [
        (["--params", "10"], "lockstep-info takes no arguments (the setup check), or --estimate"),
        (["--estimate"], "--estimate needs --params N"),
        (["--estimate", "--params", "abc"], "--params needs a positive whole number of gradient elements"),
        (["--estimate", "--params", "1.5"], "--params needs a whole number"),
        (["--estimate", "--params", "10", "--dtype", "fp8"], "--dtype needs f32, bf16 or f16"),
        (["--estimate", "--params", "10", "--step-ms"], "--step-ms needs a value"),
        (["--estimate", "--params", "10", "--step-ms", "-3"], "--step-ms needs the 1-GPU step time"),
        (["--estimate", "--params", "10", "--gpus", "0"], "--gpus needs a whole number of GPUs"),
        (["--estimate", "--params", "10", "--backward-fraction", "2"], "--backward-fraction needs a share in (0, 1]"),
        (["--estimate", "--params", "10", "--step-ms", "10", "--optimizer-ms", "9"], "exceed --step-ms"),
        (["--estimate", "--params", "10", "--frobnicate", "1"], "unknown flag --frobnicate"),
        (["--estimate", "--params", "10", "--probe", "/nonexistent.probe"], "--probe: cannot open probe file /nonexistent.probe"),
        (["--estimate", "--params", "10", "--probe", bad_probe], "--probe: " + bad_probe + ":2: unknown kind 'broadcast'"),
        (["--estimate", "--params", "10", "--probe", probe, "--save-probe", saved], "--save-probe writes a measurement"),
        (["--estimate", "--params", "10", "--late", "wte"], "--late names tensors of --shapes FILE"),
        (["--estimate", "--shapes", mlp, "--late", "wte"], "--late wte: no tensor of that name"),
        (["--estimate", "--shapes", mlp, "--params", "5"], "--params 5 disagrees with --shapes"),
        (["--estimate", "--shapes", bad_probe], "--shapes: " + bad_probe + ":2: 'ranks=2' is not a positive dimension"),
    ]
    for args, message in bad:
        rc, out, err = run(*args)
        expect(rc == 2 and message in err, f"{' '.join(args)}: exit 2 with '{message}' (got {rc})", out + err)

    rc, out, err = run("--estimate", "--help")
    expect(rc == 0 and "--save-probe FILE" in out, "--help: the usage, exit 0", out + err)

if failures:
    print("\n\n".join(failures))
    sys.exit(1)
print("lockstep-info --estimate: all checks passed")
