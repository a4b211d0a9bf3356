#!/usr/bin/env python3
"""Draws one step of a LOCKSTEP_TRACE run as a PNG: one lane per rank and track.

Usage:
  render_trace.py DIR_OR_FILES... [--out step.png] [--step N] [--title TEXT]
                  [--gpu-trace KINETO.json[.gz]]... [--gpu-step K] [--width PX] [--dpi D]

Inputs: the lockstep_trace.rank<R>.pid<P>[.S].json files that LOCKSTEP_TRACE=<dir> makes
(include/lockstep/observe/detail/trace.hpp), given one by one or as the directory holding them. Every
rank from 0 to the highest one given must be there.

The step: `--step N` is the Nth "step" span of rank 0, counted from 0 in time order (every
micro-step of gradient accumulation is one), and the Nth of every other rank goes with it;
a negative N counts from the end (-1: the last step all ranks have). Without --step, the step
of median duration on rank 0 (the lower median), among the steps every rank has, leaving out
the first (it also times allocations and the first bucket layout) when there are 3 or more,
then micro-steps that only accumulate and then skipped steps, each while others remain. The
picture spans that step on all ranks: from the earliest start of its "step" spans to the
latest end; 0 ms is the earliest start (ranks of one host share the steady clock their traces
are written on).

Lanes, per rank: host (step, forward + backward, finish, and inside finish the waits for the
bucket collectives, unscale + inf/NaN check, clip by global norm; a skipped step is marked),
communication (each bucket collective from issue to the end of its wait, labelled with the
bucket number where the bar is wide enough; collectives in flight together share the lane in
rows), optimizer (the per-bucket callbacks). Each rank's step duration is written at the right
of its host lane.

--gpu-trace adds, per GPU of a PyTorch profiler (Kineto) Chrome trace, a lane of compute
kernels and one of NCCL kernels (names starting "ncclDevKernel" or "ncclKernel"). Its clock is
not lockstep's, so it is shifted: the start of its ProfilerStep#K (--gpu-step K; default the
last-but-one ProfilerStep, or the first kernel when there is none) is put at the start of the
step of the rank with the GPU's number (rank 0's when there is no such rank).

Prints a summary on stdout: per rank, the step, forward + backward, finish and its waits, the
collectives (how many, how long at least one was in flight, how much of that overlapped
forward + backward) and the optimizer's callbacks. Without --out it only prints the summary
(matplotlib is needed for the picture only).

Exit status: 0; 1 for a file that cannot be used (named in the message) or a missing rank or
step; 2 for bad arguments.
"""
import argparse
import bisect
import glob
import gzip
import json
import os
import re
import sys

HOST, COMM, OPTIMIZER = 1, 2, 3
TOLERANCE_US = 0.01  # lockstep writes microseconds with 3 decimals

# Kinds of span, their colours and names in the legend.
KINDS = {
    "step": ("#d9d9d9", "step"),
    "model": ("#4c78a8", "forward + backward"),
    "finish": ("#f58518", "finish"),
    "wait": ("#e45756", "wait (for a bucket)"),
    "unscale": ("#72b7b2", "unscale + inf/NaN check"),
    "clip": ("#b279a2", "clip by global norm"),
    "host_other": ("#9d9d9d", "other host span"),
    "collective": ("#54a24b", "bucket collective"),
    "callback": ("#eeca3b", "bucket callback (optimizer)"),
    "gpu_compute": ("#5d69b1", "GPU compute kernel"),
    "gpu_nccl": ("#2e8b57", "GPU NCCL kernel"),
}


class TraceError(Exception):
    """A problem with the inputs: printed as one line, exit status 1."""


def load_json(path):
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise TraceError(f"{path}: not valid JSON ({e}); was the file cut short? lockstep writes "
                         "it whole when the rank's DataParallel is destroyed")
    except (UnicodeDecodeError, EOFError, gzip.BadGzipFile) as e:
        raise TraceError(f"{path}: not a JSON text ({e})")
    except OSError as e:
        raise TraceError(f"{path}: cannot read it ({e.strerror or e})")


def events_of(path, doc):
    events = doc.get("traceEvents") if isinstance(doc, dict) else doc
    if not isinstance(events, list):
        raise TraceError(f"{path}: no list of trace events (a Chrome trace is "
                         "{{\"traceEvents\": [...]}} or a list of events)")
    return events


def number(path, k, e, key):
    v = e.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TraceError(f"{path}: event {k} ({e.get('name')!r}) has no numeric '{key}'")
    return float(v)


class Span:
    __slots__ = ("name", "tid", "ts", "end", "detail")

    def __init__(self, name, tid, ts, end, detail=""):
        self.name, self.tid, self.ts, self.end, self.detail = name, tid, ts, end, detail

    @property
    def dur(self):
        return self.end - self.ts


class RankTrace:
    """One lockstep trace file: one rank's spans and instants."""

    def __init__(self, path):
        self.path = path
        events = events_of(path, load_json(path))
        self.spans, self.instants, pids = [], [], set()
        for k, e in enumerate(events):
            if not isinstance(e, dict):
                raise TraceError(f"{path}: event {k} is not an object")
            ph = e.get("ph")
            if ph not in ("X", "i", "I", "M"):
                continue
            pid = e.get("pid")
            if not isinstance(pid, int) or isinstance(pid, bool):
                raise TraceError(f"{path}: event {k} ({e.get('name')!r}) has no integer pid "
                                 "(lockstep's pid is the rank)")
            pids.add(pid)
            if ph == "M":
                continue
            name = e.get("name")
            if not isinstance(name, str):
                raise TraceError(f"{path}: event {k} has no name")
            tid = e.get("tid")
            ts = number(path, k, e, "ts")
            detail = e.get("args", {}).get("detail", "") if isinstance(e.get("args"), dict) else ""
            if ph == "X":
                self.spans.append(Span(name, tid, ts, ts + number(path, k, e, "dur"), detail))
            else:
                self.instants.append(Span(name, tid, ts, ts, detail))
        if len(pids) != 1:
            raise TraceError(f"{path}: " + ("no events" if not pids else
                             f"events of several processes (pids {sorted(pids)})") +
                             ": not one rank's lockstep trace (lockstep_trace.rank<R>.pid<P>.json)")
        self.rank = pids.pop()
        m = re.search(r"lockstep_trace\.rank(\d+)\.pid(\d+)(?:\.(\d+))?\.json", os.path.basename(path))
        if m and int(m[1]) != self.rank:
            raise TraceError(f"{path}: its name says rank {m[1]} but its events are rank {self.rank}'s")
        self.pid = m[2] if m else None
        self.serial = m[3] if m else None
        self.spans.sort(key=lambda s: s.ts)
        self.instants.sort(key=lambda s: s.ts)
        self.span_starts = [s.ts for s in self.spans]
        self.instant_times = [s.ts for s in self.instants]
        self.steps = [s for s in self.spans if s.name == "step" and s.tid == HOST]
        if not self.steps:
            raise TraceError(f"{path}: rank {self.rank} recorded no step (no 'step' span on its host track); "
                             "was DataParallel::step() called with LOCKSTEP_TRACE set?")
        self.label = f"rank {self.rank}"

    def in_step(self, n):
        """The spans and instants of this rank's step n (inside its "step" span), less the step."""
        s = self.steps[n]
        lo, hi = s.ts - TOLERANCE_US, s.end + TOLERANCE_US
        a, b = bisect.bisect_left(self.span_starts, lo), bisect.bisect_right(self.span_starts, hi)
        spans = [e for e in self.spans[a:b] if e.end <= hi and not (e.name == "step" and e.tid == HOST)]
        a, b = bisect.bisect_left(self.instant_times, lo), bisect.bisect_right(self.instant_times, hi)
        return s, spans, self.instants[a:b]


def trace_files(inputs):
    files = []
    for p in inputs:
        if os.path.isdir(p):
            found = sorted(glob.glob(os.path.join(glob.escape(p), "lockstep_trace.rank*.json")))
            if not found:
                raise TraceError(f"{p}: no lockstep_trace.rank*.json in this directory (was LOCKSTEP_TRACE "
                                 "set to it, and did the program's DataParallel objects get destroyed?)")
            files += found
        elif os.path.exists(p):
            files.append(p)
        else:
            raise TraceError(f"{p}: no such file or directory")
    seen, out = set(), []
    for f in files:
        key = os.path.realpath(f)
        if key not in seen:
            seen.add(key)
            out.append(f)
    return out


def read_ranks(inputs):
    traces = [RankTrace(f) for f in trace_files(inputs)]
    traces.sort(key=lambda t: (t.rank, t.pid or "", int(t.serial or 1), t.path))
    ranks = sorted({t.rank for t in traces})
    missing = [r for r in range(ranks[-1] + 1) if r not in ranks]
    if missing:
        where = sorted({os.path.dirname(t.path) or "." for t in traces})
        names = ", ".join(f"lockstep_trace.rank{r}.*.json" for r in missing)
        raise TraceError(f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} missing: no {names} "
                         f"among the inputs (in {', '.join(where)}; found ranks {', '.join(map(str, ranks))}). "
                         "Each rank writes its file when its DataParallel is destroyed: did that rank end early?")
    by_rank = {}
    for t in traces:
        by_rank.setdefault(t.rank, []).append(t)
    for r, ts in by_rank.items():
        if len(ts) > 1:
            for t in ts:
                if t.pid:
                    t.label = f"rank {r} pid {t.pid}" + (f".{t.serial}" if t.serial else "")
                else:
                    t.label = f"rank {r} {os.path.basename(t.path)}"
            pids = sorted({t.pid for t in ts if t.pid})
            if len(pids) > 1:
                print(f"render_trace: note: {len(ts)} files for rank {r} (processes {', '.join(pids)}): if they are "
                      "from different runs, give the files of one run", file=sys.stderr)
    return traces


def model_kind(name):
    return name.startswith("forward + backward")


def host_kind(name):
    if name == "step":
        return "step"
    if model_kind(name):
        return "model"
    if name == "finish":
        return "finish"
    if name == "wait":
        return "wait"
    if name.startswith("unscale"):
        return "unscale"
    if name.startswith("clip"):
        return "clip"
    return "host_other"


def choose_step(traces, requested):
    rank0 = traces[0]
    common = min(len(t.steps) for t in traces)
    if requested is not None:
        n = requested if requested >= 0 else common + requested
        if n < 0 or n >= len(rank0.steps):
            raise TraceError(f"--step {requested}: {rank0.path} has {len(rank0.steps)} steps "
                             f"(0 to {len(rank0.steps) - 1}; a negative one counts from the end of the {common} "
                             "all ranks have)")
        for t in traces:
            if n >= len(t.steps):
                raise TraceError(f"{t.path}: {t.label} has only {len(t.steps)} steps, so no step {n} "
                                 "to go with rank 0's")
        return n, f"step {n} (--step {requested})"
    candidates = list(range(1, common)) if common >= 3 else list(range(common))
    steps = {n: rank0.in_step(n) for n in candidates}
    syncing = [n for n in candidates if not any(s.name == "forward + backward (accumulating)" for s in steps[n][1])]
    if syncing:
        candidates = syncing
    applied = [n for n in candidates if not any(i.name.startswith("step skipped") for i in steps[n][2])]
    if applied:
        candidates = applied
    by_duration = sorted(candidates, key=lambda n: (rank0.steps[n].dur, n))
    n = by_duration[(len(by_duration) - 1) // 2]
    return n, f"step {n} of 0..{common - 1} (rank 0's median-duration step; --step N picks another)"


def union(intervals):
    out = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def length(intervals):
    return sum(b - a for a, b in intervals)


def intersection(xs, ys):
    out, i, j = [], 0, 0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        if a < b:
            out.append([a, b])
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return out


class RankStep:
    """One rank's part of the chosen step, with its numbers (microseconds)."""

    def __init__(self, trace, n):
        self.trace = trace
        self.step, self.spans, self.instants = trace.in_step(n)
        host = [s for s in self.spans if s.tid == HOST]
        self.collectives = sorted((s for s in self.spans if s.tid == COMM), key=lambda s: s.ts)
        self.callbacks = sorted((s for s in self.spans if s.tid == OPTIMIZER), key=lambda s: s.ts)
        self.host = sorted(host, key=lambda s: s.ts)
        model = union([(s.ts, s.end) for s in host if model_kind(s.name)])
        self.model_us = length(model)
        self.finish_us = sum(s.dur for s in host if s.name == "finish")
        self.wait_us = sum(s.dur for s in host if s.name == "wait")
        in_flight = union([(s.ts, s.end) for s in self.collectives])
        self.in_flight_us = length(in_flight)
        self.overlapped_us = length(intersection(in_flight, model))
        self.callback_us = sum(s.dur for s in self.callbacks)
        self.skipped = any(i.name.startswith("step skipped") for i in self.instants)


def summary(rank_steps, what, t0, t1, gpus):
    lines = [f"render_trace: {what}, {len(rank_steps)} ranks, window {(t1 - t0) / 1e3:.3f} ms "
             "(first rank's step start to last rank's step end)"]
    head = ("", "step ms", "fwd+bwd ms", "finish ms", "wait ms", "collectives", "in flight ms",
            "overlapped ms", "optimizer ms", "")
    rows = [head]
    for rs in rank_steps:
        rows.append((rs.trace.label, f"{rs.step.dur / 1e3:.3f}", f"{rs.model_us / 1e3:.3f}",
                     f"{rs.finish_us / 1e3:.3f}",
                     f"{rs.wait_us / 1e3:.3f}", str(len(rs.collectives)), f"{rs.in_flight_us / 1e3:.3f}",
                     f"{rs.overlapped_us / 1e3:.3f}", f"{rs.callback_us / 1e3:.3f}",
                     "skipped (inf/NaN)" if rs.skipped else ""))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    for r in rows:
        cells = [r[0].ljust(widths[0])] + [r[i].rjust(widths[i]) for i in range(1, len(head) - 1)] + [r[-1]]
        lines.append("  ".join(cells).rstrip())
    lines.append("in flight: time with at least one bucket collective issued and not yet waited for; "
                 "overlapped: the part of it during forward + backward")
    for g in gpus:
        lines.append(f"{g.label}: {len(g.compute)} compute kernels busy {g.compute_busy / 1e3:.3f} ms, "
                     f"{len(g.nccl)} NCCL kernels busy {g.nccl_busy / 1e3:.3f} ms, both at once "
                     f"{g.both / 1e3:.3f} ms ({g.aligned})")
    return "\n".join(lines)


# --- GPU lanes from a PyTorch profiler (Kineto) trace --------------------------------------


class GpuLane:
    def __init__(self, label, how, rank_label, own_rank, compute, nccl):
        self.label, self.how, self.own_rank, self.compute, self.nccl = label, how, own_rank, compute, nccl
        self.aligned = f"{how} at {rank_label}'s step start"
        cu, nu = union(compute), union(nccl)
        self.compute_busy, self.nccl_busy = length(cu), length(nu)
        self.both = length(intersection(cu, nu))


def is_nccl(name):
    return name.startswith("ncclDevKernel") or name.startswith("ncclKernel")


def device_of(e):
    args = e.get("args") if isinstance(e.get("args"), dict) else {}
    for v in (args.get("device"), e.get("pid")):
        if isinstance(v, int) and not isinstance(v, bool):
            return v
        if isinstance(v, str):
            m = re.search(r"(\d+)", v)
            if m:
                return int(m[1])
    return 0


def gpu_lanes(path, gpu_step, rank_steps, window, name_file):
    events = events_of(path, load_json(path))
    kernels, profiler_steps = [], {}
    for k, e in enumerate(events):
        if not isinstance(e, dict) or e.get("ph") != "X":
            continue
        name, cat = e.get("name"), str(e.get("cat", "")).lower()
        if not isinstance(name, str):
            continue
        if cat == "kernel":
            ts = number(path, k, e, "ts")
            kernels.append((device_of(e), name, ts, ts + number(path, k, e, "dur")))
        m = re.fullmatch(r"ProfilerStep#(\d+)", name)
        if m and cat != "gpu_user_annotation":  # the host's step: what lockstep's step start goes with
            profiler_steps[int(m[1])] = number(path, k, e, "ts")
    if not kernels:
        raise TraceError(f"{path}: no GPU kernels (events with cat 'kernel'): "
                         "not a PyTorch profiler trace of a GPU run?")
    if gpu_step is not None:
        if gpu_step not in profiler_steps:
            have = ", ".join(map(str, sorted(profiler_steps))) or "none"
            raise TraceError(f"{path}: no ProfilerStep#{gpu_step} (it has {have})")
        anchor, how = profiler_steps[gpu_step], f"ProfilerStep#{gpu_step}"
    elif profiler_steps:
        ids = sorted(profiler_steps)
        k = ids[-2] if len(ids) >= 2 else ids[0]
        anchor, how = profiler_steps[k], f"ProfilerStep#{k}"
    else:
        anchor, how = min(k[2] for k in kernels), "first kernel"
    t0, t1 = window
    by_rank = {rs.trace.rank: rs for rs in rank_steps if rs.trace.rank is not None}
    lanes = []
    for d in sorted({k[0] for k in kernels}):
        rs = by_rank.get(d, rank_steps[0])
        shift = rs.step.ts - anchor
        compute, nccl = [], []
        for dev, name, a, b in kernels:
            if dev != d:
                continue
            a, b = a + shift, b + shift
            if b <= t0 or a >= t1:
                continue
            (nccl if is_nccl(name) else compute).append((max(a, t0), min(b, t1)))
        label = f"GPU {d} ({os.path.basename(path)})" if name_file else f"GPU {d}"
        lanes.append(GpuLane(label, how, rs.trace.label, d in by_rank, compute, nccl))
    return lanes


# --- the picture ---------------------------------------------------------------------------


def pack_rows(spans):
    """Rows for spans that overlap in time: each span goes in the first row free at its start."""
    ends, rows = [], []
    for s in spans:
        for i, e in enumerate(ends):
            if s.ts >= e - TOLERANCE_US:
                ends[i] = s.end
                rows.append(i)
                break
        else:
            ends.append(s.end)
            rows.append(len(ends) - 1)
    return rows, max(1, len(ends))


def draw(rank_steps, gpus, t0, t1, out, title, subtitles, width_px, dpi):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    from matplotlib.transforms import blended_transform_factory

    # Lanes from the top: (label, height in lane units, what to draw).
    lanes = []
    for rs in rank_steps:
        rows, nrows = pack_rows(rs.collectives)
        lanes.append((f"{rs.trace.label}  host", 1.3, ("host", rs)))
        lanes.append(("communication", min(3.0, max(1.0, 0.55 * nrows)), ("comm", rs, rows, nrows)))
        lanes.append(("optimizer", 0.8, ("opt", rs)))
    for g in gpus:
        lanes.append((f"{g.label}  compute", 0.8, ("gpu", g.compute, "gpu_compute")))
        lanes.append((f"{g.label}  NCCL", 0.8, ("gpu", g.nccl, "gpu_nccl")))
    unit_in, top_in, bottom_in, left_in, right_in = 0.34, 1.05 + 0.2 * len(subtitles), 0.55, 1.75, 0.95
    units = sum(h for _, h, _ in lanes)
    height_px = round((top_in + bottom_in + units * unit_in) * dpi)
    fig = plt.figure(figsize=(width_px / dpi, height_px / dpi), dpi=dpi)
    W, H = width_px / dpi, height_px / dpi
    ax = fig.add_axes([left_in / W, bottom_in / H, 1 - (left_in + right_in) / W, 1 - (top_in + bottom_in) / H])
    span_ms = (t1 - t0) / 1e3
    ax.set_xlim(-0.005 * span_ms, span_ms * 1.005)
    ax.set_ylim(units, 0)
    ax_px = (1 - (left_in + right_in) / W) * width_px
    px_per_ms = ax_px / (span_ms * 1.01)
    used = set()

    def ms(t):
        return (t - t0) / 1e3

    def bars(spans, y, h, kind, edge=None, labels=None):
        if not spans:
            return
        used.add(kind)
        ax.broken_barh([(ms(a), (b - a) / 1e3) for a, b in spans], (y, h), facecolors=KINDS[kind][0],
                       edgecolors=edge or "none", linewidth=0.5 if edge else 0)
        if h * unit_in * 72 < 7.5:  # points: too low for a 6.5-point label
            return
        for (a, b), text in zip(spans, labels or []):
            if text and (b - a) / 1e3 * px_per_ms > 5.5 * len(text) * dpi / 100 + 4:
                ax.text(ms((a + b) / 2), y + h / 2, text, ha="center", va="center", fontsize=6.5, clip_on=True,
                        zorder=4)

    trans = blended_transform_factory(ax.transAxes, ax.transData)
    y, ticks, names = 0.0, [], []
    for label, h, what in lanes:
        ticks.append(y + h / 2)
        names.append(label)
        kind = what[0]
        if kind == "host":
            rs = what[1]
            if y > 0:
                ax.axhline(y, color="#555555", linewidth=0.8)
            bars([(rs.step.ts, rs.step.end)], y + 0.06 * h, 0.88 * h, "step", edge="#8c8c8c")
            by = {}
            for s in rs.host:
                by.setdefault(host_kind(s.name), []).append(s)
            for k in ("model", "finish", "host_other"):
                ss = by.get(k, [])
                bars([(s.ts, s.end) for s in ss], y + 0.18 * h, 0.64 * h, k,
                     labels=["forward + backward" if k == "model" else s.name for s in ss])
            for k in ("wait", "unscale", "clip"):
                bars([(s.ts, s.end) for s in by.get(k, [])], y + 0.32 * h, 0.36 * h, k)
            for i in rs.instants:
                used.add("skipped")
                ax.plot([ms(i.ts)], [y + 0.5 * h], marker="X", color="#c00000", markersize=8, zorder=5)
            ax.text(1.01, y + h / 2, f"{rs.step.dur / 1e3:.2f} ms" + ("\nskipped" if rs.skipped else ""),
                    transform=trans, ha="left", va="center", fontsize=8)
        elif kind == "comm":
            rs, rows, nrows = what[1], what[2], what[3]
            rh = h / nrows
            for r in range(nrows):
                ss = [s for s, row in zip(rs.collectives, rows) if row == r]
                bars([(s.ts, s.end) for s in ss], y + r * rh + 0.1 * rh, 0.8 * rh, "collective", edge="#2f6b2a",
                     labels=[s.name.replace("reduce from bucket ", "b") for s in ss])
        elif kind == "opt":
            rs = what[1]
            bars([(s.ts, s.end) for s in rs.callbacks], y + 0.1 * h, 0.8 * h, "callback", edge="#a08420",
                 labels=[re.sub(r"bucket (\d+) callback", r"b\1", s.name) for s in rs.callbacks])
        else:
            if kind == "gpu" and label.endswith("compute"):
                ax.axhline(y, color="#555555", linewidth=0.8)
            bars(what[1], y + 0.1 * h, 0.8 * h, what[2])
        y += h
    ax.set_yticks(ticks)
    ax.set_yticklabels(names, fontsize=8)
    ax.tick_params(axis="y", length=0)
    ax.set_xlabel("ms from the step's start (earliest rank)", fontsize=9)
    ax.tick_params(axis="x", labelsize=8)
    ax.grid(axis="x", color="#eeeeee", linewidth=0.6)
    ax.set_axisbelow(True)
    handles = [Patch(facecolor=KINDS[k][0], edgecolor="#8c8c8c" if k == "step" else "none", label=KINDS[k][1])
               for k in KINDS if k in used]
    if "skipped" in used:
        handles.append(Line2D([], [], marker="X", color="#c00000", linestyle="none", label="step skipped: inf/NaN"))
    fig.text(0.5, 1 - 0.12 / H, title, ha="center", va="top", fontsize=12, weight="bold")
    for i, line in enumerate(subtitles):
        fig.text(0.5, 1 - (0.42 + 0.2 * i) / H, line, ha="center", va="top", fontsize=8.5, color="#444444")
    fig.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 1 - (0.42 + 0.2 * len(subtitles)) / H),
               ncol=min(6, len(handles)),
               fontsize=8, frameon=False, handlelength=1.4, columnspacing=1.2)
    try:
        fig.savefig(out, dpi=dpi, format="png")
    except OSError as e:
        raise TraceError(f"{out}: cannot write the picture ({e.strerror or e})")
    finally:
        plt.close(fig)
    return width_px, height_px


def main(argv):
    p = argparse.ArgumentParser(prog="render_trace.py",
                                description="Draws one step of LOCKSTEP_TRACE's files as a PNG.",
                                epilog="See the top of this file (or docs/observe.md) for what is drawn.")
    p.add_argument("inputs", nargs="+", metavar="DIR_OR_FILE",
                   help="lockstep_trace.rank*.json files, or their directory")
    p.add_argument("--out", help="the PNG to write (without it only the summary is printed)")
    p.add_argument("--step", type=int, help="the Nth step span of rank 0, from 0; negative counts from the end "
                   "(default: rank 0's median-duration step, the first left out)")
    p.add_argument("--title", help="the picture's title")
    p.add_argument("--gpu-trace", action="append", default=[], metavar="FILE",
                   help="a PyTorch profiler (Kineto) Chrome trace, .json or .json.gz: adds GPU lanes (repeatable)")
    p.add_argument("--gpu-step", type=int, metavar="K",
                   help="the ProfilerStep#K of --gpu-trace that goes with the step")
    p.add_argument("--width", type=int, default=1600, metavar="PX", help="the picture's width in pixels (1600)")
    p.add_argument("--dpi", type=int, default=110, help="dots per inch: the text's size against the width (110)")
    a = p.parse_args(argv)
    if a.width < 400 or a.dpi < 20:
        p.error("--width must be at least 400 pixels and --dpi at least 20")
    plt_missing = None
    if a.out:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            plt_missing = "render_trace: drawing needs matplotlib: python3 -m pip install matplotlib"
    if a.out and not os.path.isdir(os.path.dirname(os.path.abspath(a.out))):
        print(f"render_trace: --out {a.out}: no directory {os.path.dirname(os.path.abspath(a.out))} to write it in",
              file=sys.stderr)
        return 1
    if plt_missing:
        print(plt_missing, file=sys.stderr)
        return 1
    try:
        traces = read_ranks(a.inputs)
        n, what = choose_step(traces, a.step)
        rank_steps = [RankStep(t, n) for t in traces]
        t0 = min(rs.step.ts for rs in rank_steps)
        t1 = max(rs.step.end for rs in rank_steps)
        gpus = []
        for g in a.gpu_trace:
            gpus += gpu_lanes(g, a.gpu_step, rank_steps, (t0, t1), len(a.gpu_trace) > 1)
    except TraceError as e:
        print(f"render_trace: {e}", file=sys.stderr)
        return 1
    print(summary(rank_steps, what, t0, t1, gpus))
    if a.out:
        title = a.title or f"lockstep: step {n} on {len(rank_steps)} ranks"
        subtitles = [f"{len(rank_steps)} ranks, host steady clock; 0 ms = the earliest rank's step start; "
                     "each rank's step duration at the right"]
        if gpus:
            hows = {g.how for g in gpus}
            if len(hows) == 1 and all(g.own_rank for g in gpus):
                subtitles.append(f"GPU lanes aligned at step start: each GPU's {hows.pop()} start put at the step "
                                 "start of the rank with the GPU's number")
            else:
                subtitles.append("GPU lanes aligned at step start: " +
                                 "; ".join(f"{g.label}'s {g.aligned}" for g in gpus))
        try:
            w, h = draw(rank_steps, gpus, t0, t1, a.out, title, subtitles, a.width, a.dpi)
        except TraceError as e:
            print(f"render_trace: {e}", file=sys.stderr)
            return 1
        print(f"render_trace: wrote {a.out} ({w} x {h} pixels)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
