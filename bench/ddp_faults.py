#!/usr/bin/env python3
"""PyTorch DDP under the faults of docs/reliability.md, measured: what PyTorch prints, how long
from the fault until the job has ended, and the exit code. It fills the column "PyTorch DDP with
its defaults" of that table with measurements instead of what the documentation says.

Each scenario runs as its own job,

  torchrun --standalone --nproc-per-node N bench/ddp_faults.py --worker SCENARIO --timeout-s T

(this same file in worker mode): a small MLP (4 Linear layers of 1024, DDP with
bucket_cap_mb=1, so several buckets), random data, SGD, a few warm-up steps so that NCCL is
connected, then one rank injects the fault. The faulty rank prints "FAULT t=<time.time()>" just
before it does; the time reported is from the earliest FAULT line to torchrun's exit (same host,
same clock).

Run (on a machine with >= 2 GPUs, PyTorch with CUDA, torchrun on PATH):

  python3 bench/ddp_faults.py --out results.md                   # every scenario, T = 20 s
  python3 bench/ddp_faults.py --out results.md --timeout-s 20 --nproc 2 --only skip,kill

It writes a markdown table (scenario, what PyTorch printed, seconds from the fault to the exit,
exit code, note) and a details section (the lines that name a rank, a sequence number or a
timeout, and the last lines of output) to --out, prints the table, and keeps each job's whole
output under --log-dir (default: next to --out, "<out>.logs/").

THE NCCL TIMEOUT IS SHORTENED ON PURPOSE: init_process_group("nccl", timeout=T) with T = 20 s by
default, standing in for PyTorch's default of 600 s (10 min), so that the scenarios that end only
by the NCCL watchdog finish in minutes. With the default, such a scenario takes about 600 - T s
longer; the table says so where the watchdog fired. Everything else is left at PyTorch's and
torchrun's defaults (TORCH_NCCL_ASYNC_ERROR_HANDLING, the flight recorder's dump on timeout,
torchrun's max-restarts 0, ...), except NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1,
NVSHMEM_DISABLE_NVLS=1 (NVLink multicast off) and PYTHONUNBUFFERED=1, always set. Variables
inherited from the caller's environment that change the behaviour (TORCH_NCCL_*, NCCL_*,
TORCH_DISTRIBUTED_DEBUG, ...) are listed in the output.

Nothing can hang forever: each job has a wall limit (--wall-s, default 3*T + 60 s) after which
torchrun's process group and every process carrying this run's marker variable (the workers:
torchrun starts each in a session of its own) are killed; each worker also arms SIGALRM (default
action: terminate) a little after that limit. With T = 20 s on 2 GPUs, all scenarios take a few
minutes.

Scenarios (numbers as in docs/reliability.md; rank 1 is the faulty rank unless said):
  skip         1  rank 1 raises inside forward at step 5, catches it and goes on (skips one
                  backward's all-reduces); the others go on normally
  shapes       2  rank 1 builds its model 64 wider in the hidden layers (checked by DDP's
                  constructor)
  shapes_late  2  after construction and warm-up, rank 1 replaces the last layer's bias data with
                  a tensor of shape [1] (broadcasts, so forward runs) and steps
  extra        3  at step 5 rank 0 all-reduces a 2-element metric the others do not
  uneven       4  rank 1 runs 3 steps fewer than rank 0, no Join, then exits cleanly
  uneven_join  4  the same inside model.join(): must complete
  kill         5  at step 5 rank 1 SIGKILLs itself
  oom          7  at step 1 rank 1 calls torch.empty(1 << 50) on its GPU (uncaught OOM)
  nonfinite    8  fp16 autocast + GradScaler, rank 1's loss times NaN from step 3, 200 steps
  slow        10  rank 1 sleeps 10x its normal step time before each of 10 steps
"""
import argparse
import collections
import datetime
import json
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid

# --------------------------------------------------------------------------------------------
# Shared constants

SCENARIOS = [  # (name, number in docs/reliability.md, short description)
    ("skip", "1", "rank 1 raises in forward at step 5, catches it, goes on"),
    ("shapes", "2", "rank 1's model 64 wider, at DDP construction"),
    ("shapes_late", "2", "rank 1 swaps a param's data for another shape after warm-up"),
    ("extra", "3", "rank 0 does an extra 2-element all_reduce at step 5"),
    ("uneven", "4", "rank 1 runs 3 steps fewer, no Join, exits cleanly"),
    ("uneven_join", "4", "rank 1 runs 3 steps fewer, inside model.join()"),
    ("kill", "5", "rank 1 SIGKILLs itself at step 5"),
    ("oom", "7", "rank 1: torch.empty(1<<50) at step 1, uncaught"),
    ("nonfinite", "8", "fp16 + GradScaler, rank 1's loss NaN from step 3, 200 steps"),
    ("slow", "10", "rank 1 sleeps 10x its step time, 10 steps"),
]
NAMES = [s[0] for s in SCENARIOS]

FORCED_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
    "PYTHONUNBUFFERED": "1",
}
MARK_VAR = "DDP_FAULTS_RUN_TOKEN"  # every process of one job carries it; the parent kills by it
DEFAULT_T_S = 600  # PyTorch's default NCCL timeout
OWN = "[ddp_faults r"  # prefix of every line a worker prints itself

FAULTY = 1  # the faulty rank
WIDTH = 1024
DEPTH = 4
BATCH = 64
WARMUP = 5  # steps 0..4 are normal everywhere; the faults come at step 5
STEPS = 12  # steps of the plain scenarios
UNEVEN_FEWER = 3
NONFINITE_STEPS = 200
NONFINITE_FROM = 3
SLOW_WARMUP = 10
SLOW_STEPS = 10
SLOW_FACTOR = 10


# --------------------------------------------------------------------------------------------
# Worker mode (one process per GPU, started by torchrun)

def worker_main(a):
    sc = a.worker
    T = float(a.timeout_s)
    # Last resort: SIGALRM's default action ends the process even if the main thread is stuck
    # in a CUDA call holding the GIL. The parent's wall limit normally comes first.
    guard = a.guard_s if a.guard_s else 3 * T + 90
    signal.alarm(max(1, int(guard)))

    import contextlib
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    prefix = f"{OWN}{rank}]"
    faulty = rank == FAULTY

    def say(*msg):
        print(prefix, *msg, flush=True)

    def fault(desc):
        say(f"FAULT t={time.time():.6f} {sc}: {desc}")

    def result(**kv):
        say("RESULT " + json.dumps(kv, sort_keys=True))

    class MLP(nn.Module):
        def __init__(self, width, hidden, depth):
            super().__init__()
            dims = [width] + [hidden] * (depth - 1) + [width]
            self.layers = nn.ModuleList(nn.Linear(i, o) for i, o in zip(dims[:-1], dims[1:]))
            self.fail_next = False

        def forward(self, x):
            if self.fail_next:
                self.fail_next = False
                raise RuntimeError("injected fault: this batch cannot be processed")
            for i, layer in enumerate(self.layers):
                x = layer(x)
                if i + 1 < len(self.layers):
                    x = torch.relu(x)
            return x

    torch.cuda.set_device(local_rank)
    dev = torch.device("cuda", local_rank)
    dist.init_process_group("nccl", device_id=dev, timeout=timedelta(seconds=T))
    if rank == 0:
        try:
            v = torch.cuda.nccl.version()
            nccl = ".".join(str(i) for i in v) if isinstance(v, (tuple, list)) else str(v)
        except Exception as e:  # noqa: BLE001
            nccl = f"? ({e})"
        say("INFO " + json.dumps({
            "torch": torch.__version__, "cuda": torch.version.cuda, "nccl": nccl,
            "gpu": torch.cuda.get_device_name(dev), "world": world, "timeout_s": T,
            "python": sys.version.split()[0],
        }, sort_keys=True))

    torch.manual_seed(0)  # same initial model everywhere (DDP broadcasts rank 0's anyway)
    hidden = WIDTH + 64 if (sc == "shapes" and faulty) else WIDTH
    net = MLP(WIDTH, hidden, DEPTH).to(dev)
    if sc == "shapes" and faulty:
        fault(f"constructing DDP with hidden width {hidden} (the others: {WIDTH})")
    model = DDP(net, device_ids=[local_rank], bucket_cap_mb=1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    gen = torch.Generator(device=dev)
    gen.manual_seed(1000 + rank)
    x = torch.randn(BATCH, WIDTH, device=dev, generator=gen)
    y = torch.randn(BATCH, WIDTH, device=dev, generator=gen)

    def train_step():
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss.item()  # a host sync, as logging the loss does: a hung collective blocks here

    def checksum():
        with torch.no_grad():
            return torch.stack([p.detach().double().sum() for p in model.parameters()]).sum().item()

    def finish():
        say(f"DONE t={time.time():.6f}")
        dist.destroy_process_group()
        say(f"EXIT t={time.time():.6f}")

    if sc == "nonfinite":
        scaler = torch.amp.GradScaler("cuda")
        skipped = skipped_before = 0
        first_skip = None
        ck_fault = None
        loss_v = float("nan")
        for step in range(NONFINITE_STEPS):
            if step == NONFINITE_FROM:
                ck_fault = checksum()
                if faulty:
                    fault(f"multiplying rank {rank}'s loss by NaN from step {step} on")
            s_before = scaler.get_scale()
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.float16):
                out = model(x)
            loss = F.mse_loss(out.float(), y)
            if faulty and step >= NONFINITE_FROM:
                loss = loss * float("nan")
            scaler.scale(loss).backward()
            scaler.step(opt)
            try:  # private, but the only direct record of this step's skip; read before update()
                found = any(float(v.item()) != 0.0
                            for v in scaler._found_inf_per_device(opt).values())
            except Exception:  # noqa: BLE001
                found = None
            scaler.update()
            s_after = scaler.get_scale()
            if found is None:
                found = s_after < s_before
            loss_v = loss.item()
            if found:
                skipped += 1
                if step < NONFINITE_FROM:
                    skipped_before += 1
                if first_skip is None:
                    first_skip = step
            if rank == 0 and step in (0, NONFINITE_FROM, NONFINITE_STEPS - 1):
                say(f"step {step} loss {loss_v:.4g} scale {s_after:.6g} skipped so far {skipped}")
        result(steps=NONFINITE_STEPS, skipped=skipped, skipped_before_fault=skipped_before,
               first_skip_step=first_skip, final_scale=scaler.get_scale(),
               params_unchanged_since_fault=(checksum() == ck_fault), last_loss=loss_v)
        finish()
        return 0

    if sc == "slow":
        times = []
        for step in range(SLOW_WARMUP):
            t0 = time.perf_counter()
            train_step()
            times.append(time.perf_counter() - t0)
        normal = statistics.median(times[SLOW_WARMUP // 2:])
        sleep_s = SLOW_FACTOR * normal if faulty else 0.0
        if faulty:
            fault(f"sleeping {sleep_s * 1e3:.2f} ms ({SLOW_FACTOR}x its normal step of "
                  f"{normal * 1e3:.3f} ms) before each of the next {SLOW_STEPS} steps")
        t0 = time.perf_counter()
        for step in range(SLOW_STEPS):
            if sleep_s:
                time.sleep(sleep_s)
            train_step()
        total = time.perf_counter() - t0
        result(normal_step_ms=normal * 1e3, slow_steps=SLOW_STEPS, slow_total_s=total,
               slow_step_ms=total / SLOW_STEPS * 1e3, sleep_ms=sleep_s * 1e3)
        finish()
        return 0

    # The plain scenarios: STEPS steps, one fault.
    n_steps = STEPS - UNEVEN_FEWER if (sc in ("uneven", "uneven_join") and faulty) else STEPS
    track = sc in ("skip", "extra", "shapes_late")
    ctx = model.join() if sc == "uneven_join" else contextlib.nullcontext()
    updates = 0
    with ctx:
        for step in range(n_steps):
            if faulty and step == 1 and sc == "oom":
                fault("torch.empty(1 << 50) floats on the GPU")
                torch.empty(1 << 50, device=dev)  # raises torch.OutOfMemoryError, uncaught
            if faulty and step == WARMUP:
                if sc == "kill":
                    fault("os.kill(own pid, SIGKILL)")
                    os.kill(os.getpid(), signal.SIGKILL)
                    time.sleep(60)  # not reached
                if sc == "shapes_late":
                    p = model.module.layers[-1].bias
                    fault(f"layers[-1].bias.data = torch.randn(1) (was {list(p.shape)})")
                    p.data = torch.randn(1, device=dev)
                if sc == "skip":
                    fault("raising inside forward (caught by the training loop)")
                    net.fail_next = True
            try:
                loss_v = train_step()
            except RuntimeError as e:
                if sc == "skip" and "injected fault" in str(e):
                    say(f"caught at step {step}: {e}; going on with the next batch")
                    opt.zero_grad(set_to_none=True)
                    continue
                raise
            updates += 1
            if sc == "extra" and rank == 0 and step == WARMUP:
                fault("dist.all_reduce of a 2-element metric the others do not call")
                metric = torch.tensor([loss_v, 1.0], device=dev)
                dist.all_reduce(metric)
            if track and step >= WARMUP - 1:
                say(f"CK n={updates} v={checksum()!r}")
            if rank == 0 and step in (0, WARMUP - 1, n_steps - 1):
                say(f"step {step} loss {loss_v:.4f}")
        if sc in ("uneven", "uneven_join") and faulty:
            fault(f"no more inputs after {n_steps} steps (rank 0 has {STEPS}); leaving the loop")
    if sc == "uneven_join" and rank == 0:
        result(completed=True, steps=n_steps)
    finish()
    return 0


# --------------------------------------------------------------------------------------------
# Parent mode: run the jobs, watch them, parse, write the table

def _marked_pids(token):
    """Pids of live processes whose environment carries this job's token (ours alone)."""
    needle = f"{MARK_VAR}={token}".encode()
    me = os.getpid()
    pids = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return pids
    for d in entries:
        if not d.isdigit() or int(d) == me:
            continue
        try:
            with open(f"/proc/{d}/environ", "rb") as f:
                env = f.read()
        except OSError:
            continue
        if needle in env.split(b"\0"):
            pids.append(int(d))
    return pids


def _kill_job(proc, token, group):
    """SIGKILL every process of this job (found by the marker variable: torchrun starts each
    worker in a session of its own, so torchrun's process group alone does not reach them) and,
    with group, torchrun's process group (only while torchrun is not yet reaped, so that its pid
    cannot have been reused). Returns how many marked processes were found alive."""
    found = set()
    if group:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
    for _ in range(5):
        pids = _marked_pids(token)
        if not pids:
            break
        found.update(pids)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.2)
    return len(found)


SIGNAMES = {1: "SIGHUP", 2: "SIGINT", 6: "SIGABRT", 7: "SIGBUS", 9: "SIGKILL", 11: "SIGSEGV",
            14: "SIGALRM", 15: "SIGTERM"}


def _code(c):
    try:
        c = int(c)
    except (TypeError, ValueError):
        return str(c)
    return f"{c} ({SIGNAMES.get(-c, 'signal')})" if c < 0 else str(c)


RE_FAULT = re.compile(r"FAULT t=(\d+(?:\.\d+)?)")
RE_OWN = re.compile(r"\[ddp_faults r(\d+)\]\s*(.*)")
RE_RANKPFX = re.compile(r"^\s*\[rank(\d+)\]:\s?")
RE_CPPLOG = re.compile(r"^\[?[EWIF]\d{4} [\d:.]+ [^\]]*\]\s*")  # "[E1126 20:42:18.1 X.cpp:1] "
RE_FRAME = re.compile(r"^\s*(frame #\d+:|Exception raised from )")
RE_TR_FAILED = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+) \(pid: (\d+)\)")
RE_TR_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)\s*\(local_rank")
RE_TR_EXIT = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)")
RE_TR_TB = re.compile(r"^\s*traceback\s*:\s*(.*)")
RE_WATCHDOG = re.compile(r"Watchdog caught collective operation timeout: (.*?ran for \d+ "
                         r"milliseconds before timing out\.?)")
RE_SEQ = re.compile(r"SeqNum\s*=\s*(\d+)")
RE_TIMEOUT = re.compile(r"(?i)time[d ]?\s*out|timeout")
RE_RANKWORD = re.compile(r"(?i)\branks?\b\s*[:=]?\s*\d|\branks?\b")
RE_PYEXC = re.compile(r"^((?:[A-Za-z_][\w.]*\.)?[A-Za-z_]\w*(?:Error|Exception|Interrupt)):\s*(.*)")
EXCERPT_PATTERNS = [  # most telling first
    ("watchdog", re.compile(r"Watchdog caught collective operation timeout.*")),
    ("shape check", re.compile(r"(DDP expects same model.*|.*appears not to match sizes.*)")),
    ("nccl error", re.compile(r"(NCCL (error|communicator was aborted|WARN).*|ncclRemoteError.*|"
                              r".*remote process exit.*)")),
    ("exception", None),  # RE_PYEXC, special-cased
    ("terminate", re.compile(r"(terminate called.*|what\(\):.*)")),
]


def _clean(line):
    """(rank or None, text without the [rankN]: prefix and the C++ log header)."""
    r = None
    m = RE_RANKPFX.match(line)
    if m:
        r = int(m.group(1))
        line = line[m.end():]
    line = RE_CPPLOG.sub("", line.strip())
    if r is None:
        m = re.search(r"\[Rank (\d+)\]", line)
        if m:
            r = int(m.group(1))
    return r, line.strip()


def _short(s, n):
    s = " ".join(s.split())
    return s if len(s) <= n else s[: n - 1] + "…"


def _f(v, spec):
    try:
        return format(float(v), spec)
    except (TypeError, ValueError):
        return "?"


def _cell(s):
    return s.replace("|", "\\|").replace("\n", " ")


def _own_only(raw):
    """True for a line the workers printed themselves and nothing else shares."""
    m = RE_OWN.search(raw)
    return bool(m) and not RE_RANKPFX.sub("", raw[: m.start()]).strip()


def analyse(name, lines, marks, start, end, rc, killed_at_limit, T, leftovers):
    """lines: [(arrival time, text)] (the last 20000), marks: every line holding a worker's own
    output (kept apart, so that a flood of other output cannot push them out). Returns a dict
    with everything the report needs."""
    faults, own = [], collections.defaultdict(list)
    info, results, cks = {}, {}, collections.defaultdict(dict)
    for t, raw in marks:
        m = RE_FAULT.search(raw)
        if m:
            try:
                faults.append(float(m.group(1)))
            except ValueError:
                pass
        m = RE_OWN.search(raw)
        if not m:
            continue
        r, rest = int(m.group(1)), m.group(2)
        own[r].append(rest)
        try:
            if rest.startswith("INFO "):
                info = json.loads(rest[5:])
            elif rest.startswith("RESULT "):
                results[r] = json.loads(rest[7:])
            elif rest.startswith("CK "):
                mm = re.match(r"CK n=(\d+) v=(\S+)", rest)
                if mm:
                    cks[r][int(mm.group(1))] = float(mm.group(2))
        except (ValueError, TypeError):
            pass
    pt = []  # (arrival, rank, cleaned text, raw) of lines not printed by the workers themselves
    for t, raw in lines:
        if _own_only(raw):
            continue
        r, text = _clean(raw)
        if text:
            pt.append((t, r, text, raw))
    fault_t = min(faults) if faults else None

    # torchrun's account of which local rank failed how
    tr = []  # (rank, exitcode, traceback)
    cur = None
    for _, _, text, raw in pt:
        m = RE_TR_RANK.match(raw)
        if m:
            cur = [int(m.group(1)), None, ""]
            tr.append(cur)
            continue
        if cur is not None:
            m = RE_TR_EXIT.match(raw)
            if m and cur[1] is None:
                cur[1] = int(m.group(1))
                continue
            m = RE_TR_TB.match(raw)
            if m:
                cur[2] = m.group(1).strip()
                cur = None
    if not tr:
        for _, _, text, raw in pt:
            m = RE_TR_FAILED.search(raw)
            if m:
                tr.append([int(m.group(2)), int(m.group(1)), ""])
    sigterm_sent = sum(1 for _, _, text, _ in pt if "closing signal SIGTERM" in text)

    # lines of interest (frames of C++ stacks left out), deduplicated
    seen, seq_lines, tmo_lines, rank_lines = set(), [], [], []
    for t, r, text, _ in pt:
        if RE_FRAME.match(text) or text in seen:
            continue
        seen.add(text)
        tag = f"rank{r}: " if r is not None else ""
        if "SeqNum" in text:
            seq_lines.append(tag + text)
        if RE_TIMEOUT.search(text):
            tmo_lines.append(tag + text)
        if RE_RANKWORD.search(text):
            rank_lines.append(tag + text)
    seqnums = sorted({int(s) for ln in seq_lines for s in RE_SEQ.findall(ln)})
    ranks_named = sorted({int(n) for ln in rank_lines
                          for n in re.findall(r"(?i)\brank\s*[:=]?\s*(\d+)", ln.split(": ", 1)[-1])})
    watchdog = any(RE_WATCHDOG.search(text) or "Watchdog caught collective operation timeout"
                   in text for _, _, text, _ in pt)

    # the excerpt: per rank, its most telling line
    best = {}
    for t, r, text, raw in pt:
        if RE_FRAME.match(text) or "ChildFailedError" in text or "elastic" in raw:
            continue
        for prio, (kind, rx) in enumerate(EXCERPT_PATTERNS):
            if rx is None:
                m = RE_PYEXC.match(text)
                if not m or m.group(1) in ("Traceback",):
                    continue
                msg = f"{m.group(1)}: {m.group(2)}"
            else:
                m = rx.search(text)
                if not m:
                    continue
                msg = m.group(0)
                mw = RE_WATCHDOG.search(text)
                if kind == "watchdog" and mw:
                    msg = "Watchdog caught collective operation timeout: " + mw.group(1)
            key = r if r is not None else -1
            if key not in best or prio < best[key][0]:
                best[key] = (prio, t, msg)
            break
    pieces = []
    for key in sorted(best, key=lambda k: (best[k][0], best[k][1])):
        who = f"rank {key}" if key >= 0 else "?"
        pieces.append(f"{who}: {_short(best[key][2], 170)}")
    excerpt = "; ".join(pieces[:2])
    if tr:
        trs = ", ".join(f"rank {a} exitcode {_code(b)}" + (f" ({_short(c, 60)})" if c and
                        not c.startswith(("<", "To enable", "Signal")) else "")
                        for a, b, c in tr[:3])
        excerpt = (excerpt + "; " if excerpt else "") + "torchrun: " + trs
    first_err = None
    if fault_t is not None:
        for t, r, text, _ in pt:
            if t >= fault_t and (any(rx is not None and rx.search(text) for _, rx in EXCERPT_PATTERNS)
                                 or RE_PYEXC.match(text) or RE_TR_FAILED.search(text)):
                first_err = t - fault_t
                break

    # checksums of the parameters (skip, extra, shapes_late): do the ranks still agree?
    ck_note = ""
    if len(cks) >= 2:
        common = sorted(set.intersection(*(set(d) for d in cks.values())))
        differ = [n for n in common if len({cks[r][n] for r in cks}) > 1]
        if not common:
            ck_note = "no parameter checksum common to all ranks"
        elif differ:
            ck_note = (f"parameters differ between ranks from update {differ[0]} on "
                       f"(checked updates {common[0]}-{common[-1]})")
        else:
            ck_note = (f"parameters bitwise equal on all ranks through update {common[-1]} "
                       f"(each rank's own count of optimizer steps)")
        last = {r: max(d) for r, d in cks.items()}
        ck_note += "; last update printed: " + ", ".join(f"rank {r} #{n}" for r, n in sorted(last.items()))

    return dict(name=name, rc=rc, killed=killed_at_limit, start=start, end=end, fault_t=fault_t,
                n_faults=len(faults), info=info, results=results, excerpt=excerpt, tr=tr,
                sigterm_sent=sigterm_sent, seq_lines=seq_lines, tmo_lines=tmo_lines,
                rank_lines=rank_lines, seqnums=seqnums, ranks_named=ranks_named, watchdog=watchdog, first_err=first_err,
                ck_note=ck_note, leftovers=leftovers, T=T,
                tail=[raw for _, raw in lines[-15:]], own=own)


def run_one(name, a, torchrun, script, env_base, log_dir):
    T = a.timeout_s
    wall = a.wall_s if a.wall_s else 3 * T + 60
    token = uuid.uuid4().hex
    cmd = torchrun + ["--standalone", "--nproc-per-node", str(a.nproc), script,
                      "--worker", name, "--timeout-s", f"{T:g}", "--guard-s", f"{wall + 30:g}"]
    env = dict(env_base)
    env[MARK_VAR] = token
    lines = collections.deque(maxlen=20000)
    marks = []
    print(f"[ddp_faults] {name}: {' '.join(shlex.quote(c) for c in cmd)} (wall limit {wall:g} s)",
          file=sys.stderr, flush=True)
    start = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                            stdin=subprocess.DEVNULL, start_new_session=True,
                            cwd=os.path.dirname(os.path.dirname(script)))

    def reader():
        for raw in iter(proc.stdout.readline, b""):
            item = (time.time(), raw.decode("utf-8", "replace").rstrip("\r\n"))
            lines.append(item)
            if OWN in item[1] and len(marks) < 20000:
                marks.append(item)

    th = threading.Thread(target=reader, daemon=True)
    th.start()
    killed = False
    try:
        try:
            rc = proc.wait(timeout=wall)
        except subprocess.TimeoutExpired:
            killed = True
            _kill_job(proc, token, group=True)
            try:
                rc = proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                rc = None
        end = time.time()
    except BaseException:
        _kill_job(proc, token, group=proc.returncode is None)
        raise
    # torchrun gone: anything of this job still alive outlived it; end it
    leftovers = _kill_job(proc, token, group=False)
    th.join(timeout=10)
    snapshot = list(lines)
    marks_snapshot = list(marks)
    if log_dir:
        try:
            os.makedirs(log_dir, exist_ok=True)
            with open(os.path.join(log_dir, f"{name}.log"), "w") as f:
                f.write(f"# {' '.join(shlex.quote(c) for c in cmd)}\n# start {start:.6f} end "
                        f"{end:.6f} rc {rc} killed_at_wall_limit {killed}\n")
                for t, raw in snapshot:
                    f.write(f"{t - start:9.3f} {raw}\n")
        except OSError as e:
            print(f"[ddp_faults] cannot write the log: {e}", file=sys.stderr)
    res = analyse(name, snapshot, marks_snapshot, start, end, rc, killed, T, leftovers)
    res["wall"] = wall
    res["cmd"] = cmd
    print(f"[ddp_faults] {name}: torchrun exit {rc}{' (killed at the wall limit)' if killed else ''}"
          f", {end - start:.1f} s from start", file=sys.stderr, flush=True)
    return res


def env_summary(env):
    forced = " ".join(f"{k}={v}" for k, v in FORCED_ENV.items() if k != "PYTHONUNBUFFERED")
    keys = sorted(k for k in env if k not in FORCED_ENV and k.startswith(
        ("TORCH_NCCL_", "NCCL_", "TORCH_DISTRIBUTED", "TORCH_CPP_LOG", "TORCH_FR_", "TORCHELASTIC",
         "TORCH_SHOW_CPP", "CUDA_LAUNCH_BLOCKING", "TORCH_NCCL", "NVSHMEM_")))
    inherited = " ".join(f"{k}={env[k]}" for k in keys)
    ae = env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")
    short = (f"{forced}; TORCH_NCCL_ASYNC_ERROR_HANDLING "
             f"{'=' + ae if ae is not None else 'unset (default)'}; "
             f"{'also ' + inherited if inherited else 'no other TORCH_NCCL_*/NCCL_* set'}")
    return short, inherited


def row(res, notes_env):
    name = res["name"]
    num, desc = next((n, d) for s, n, d in SCENARIOS if s == name)
    T = res["T"]
    # seconds
    if res["fault_t"] is None:
        secs = f"no FAULT line; {res['end'] - res['start']:.1f} s start to exit"
    else:
        d = res["end"] - res["fault_t"]
        secs = f"{d:.1f}"
        if res["watchdog"]:
            secs += f" (T={T:g} s; with the default {DEFAULT_T_S} s: ≈ {d - T + DEFAULT_T_S:.0f})"
    if res["killed"]:
        secs += f" — killed at the wall limit {res['wall']:g} s, still running"
    # exit code
    code = "killed by bench" if res["killed"] else _code(res["rc"])
    if res["tr"]:
        code += "; " + ", ".join(f"rank {a}: {_code(b)}" for a, b, _ in res["tr"][:3])
    # excerpt
    ex = res["excerpt"] or "(no error printed)"
    # notes
    notes = []
    r0 = res["results"].get(0) or next(iter(res["results"].values()), None)
    if name == "nonfinite" and res["results"]:
        for r, v in sorted(res["results"].items()):
            notes.append(f"rank {r}: {v.get('skipped')} of {v.get('steps')} steps skipped "
                         f"(first at step {v.get('first_skip_step')}, {v.get('skipped_before_fault')}"
                         f" before the fault), final scale {_f(v.get('final_scale'), '.3g')}, "
                         f"parameters unchanged since the fault: "
                         f"{v.get('params_unchanged_since_fault')}")
        notes.append("never stops" if res["rc"] == 0 else "stopped")
    if name == "slow" and res["results"]:
        for r, v in sorted(res["results"].items()):
            notes.append(f"rank {r}: {v.get('slow_steps')} steps in "
                         f"{_f(v.get('slow_total_s'), '.3f')} s ({_f(v.get('slow_step_ms'), '.2f')} "
                         f"ms/step, normal {_f(v.get('normal_step_ms'), '.2f')} ms, slept "
                         f"{_f(v.get('sleep_ms'), '.2f')} ms/step)")
        notes.append("no failure, no report" if res["rc"] == 0 and not res["excerpt"]
                     else "see the output")
    if name == "uneven_join":
        notes.append("completed" if res["rc"] == 0 and r0 and r0.get("completed") else "did not complete")
    if res["ck_note"]:
        notes.append(res["ck_note"])
    if res["watchdog"]:
        notes.append(f"NCCL watchdog timeout fired (timeout shortened to T={T:g} s on purpose; "
                     f"PyTorch's default is {DEFAULT_T_S} s)")
    if res["first_err"] is not None:
        notes.append(f"first error text {res['first_err']:.1f} s after the fault")
    names = [f"SeqNum {'yes (' + ','.join(map(str, res['seqnums'][:4])) + ')' if res['seqnums'] else 'no'}",
             f"timeout {'yes' if res['tmo_lines'] else 'no'}",
             f"a rank {'yes' if res['rank_lines'] else 'no'}"
             + (f" ({', '.join(map(str, res['ranks_named'][:6]))})" if res["ranks_named"] else "")]
    notes.append("PyTorch's lines name: " + ", ".join(names))
    if res["sigterm_sent"]:
        notes.append(f"torchrun sent SIGTERM to {res['sigterm_sent']} survivor(s)")
    if res["leftovers"]:
        notes.append(f"{res['leftovers']} process(es) outlived torchrun (killed by the bench)")
    if res["n_faults"] == 0:
        notes.append("no FAULT line seen")
    notes.append("env: " + notes_env)
    scen = f"{num} `{name}`: {desc}"
    return "| " + " | ".join(_cell(c) for c in (scen, f"`{ex.replace('`', chr(39))}`", secs,
                                                  code, "; ".join(notes))) + " |"


def render(results, a, env_short, inherited, torchrun_desc, started):
    info = next((r["info"] for r in results if r["info"]), {})
    out = ["# PyTorch DDP with its defaults under faults (bench/ddp_faults.py)", ""]
    out.append(f"Measured {datetime.datetime.fromtimestamp(started).strftime('%Y-%m-%d %H:%M')}: "
               f"{a.nproc} × {info.get('gpu', '?')}, torch {info.get('torch', '?')}, CUDA "
               f"{info.get('cuda', '?')}, NCCL {info.get('nccl', '?')}, Python {info.get('python', '?')}; "
               f"`{torchrun_desc} --standalone --nproc-per-node {a.nproc}`, one job per scenario.")
    out.append("")
    out.append(f"**The NCCL timeout is shortened on purpose** to T = {a.timeout_s:g} s "
               f"(`init_process_group(\"nccl\", device_id=..., timeout=timedelta(seconds={a.timeout_s:g}))`); "
               f"PyTorch's default is {DEFAULT_T_S} s, so where the watchdog fired a job with the "
               f"defaults takes about {DEFAULT_T_S - a.timeout_s:g} s longer (the estimate is in the "
               f"seconds column). Seconds: from the earliest `FAULT t=` line (time.time() printed by "
               f"the faulty rank just before the fault) to torchrun's exit. Model: {DEPTH} Linear "
               f"layers of {WIDTH}, DDP(bucket_cap_mb=1), SGD, batch {BATCH}, a loss.item() each step; "
               f"faulty rank {FAULTY} unless said.")
    out.append("")
    out.append(f"Environment: {env_short}, PYTHONUNBUFFERED=1; everything else at PyTorch's and "
               f"torchrun's defaults.")
    out.append("")
    out.append("| scenario | what PyTorch printed (short excerpt) | seconds from fault to exit | "
               "exit code | note |")
    out.append("| --- | --- | --- | --- | --- |")
    for r in results:
        out.append(row(r, env_short))
    out.append("")
    out.append("## Details")
    for r in results:
        out.append("")
        out.append(f"### {r['name']}")
        out.append("")
        out.append(f"`{' '.join(shlex.quote(c) for c in r['cmd'])}`: start to exit "
                   f"{r['end'] - r['start']:.1f} s" +
                   (f", start to fault {r['fault_t'] - r['start']:.1f} s" if r['fault_t'] else "") +
                   f", torchrun exit {r['rc']}" + (", killed at the wall limit" if r["killed"] else ""))
        for label, key in (("Lines naming a sequence number (SeqNum)", "seq_lines"),
                           ("Lines mentioning a timeout", "tmo_lines"),
                           ("Lines naming a rank", "rank_lines")):
            ls = r[key]
            out.append("")
            out.append(f"{label}: {len(ls)}" + (" (first 12)" if len(ls) > 12 else ""))
            if ls:
                out.append("")
                out.append("```")
                out.extend(_short(x, 400).replace("```", "'''") for x in ls[:12])
                out.append("```")
        out.append("")
        out.append("Last lines of the output:")
        out.append("")
        out.append("```")
        out.extend(x[:400].replace("```", "'''") for x in r["tail"])
        out.append("```")
    return "\n".join(out) + "\n"


def parent_main(a):
    if a.nproc < 2:
        sys.exit("--nproc must be at least 2 (rank 1 is the faulty rank)")
    names = NAMES
    if a.only:
        names = [n.strip() for n in a.only.split(",") if n.strip()]
        bad = [n for n in names if n not in NAMES]
        if bad:
            sys.exit(f"unknown scenario(s) {', '.join(bad)}; known: {', '.join(NAMES)}")
    if a.torchrun:
        torchrun = shlex.split(a.torchrun)
    elif shutil.which("torchrun"):
        torchrun = [shutil.which("torchrun")]
    else:
        torchrun = [sys.executable, "-m", "torch.distributed.run"]
    torchrun_desc = "torchrun" if not a.torchrun and shutil.which("torchrun") else " ".join(torchrun)
    script = os.path.abspath(__file__)
    env_base = dict(os.environ)
    env_base.update(FORCED_ENV)
    env_short, inherited = env_summary(env_base)
    log_dir = a.log_dir
    if log_dir is None:
        base = a.out[:-3] if a.out.endswith(".md") else a.out
        log_dir = base + ".logs"
    started = time.time()
    results = []
    text = ""
    try:
        for name in names:
            results.append(run_one(name, a, torchrun, script, env_base, log_dir or None))
            text = render(results, a, env_short, inherited, torchrun_desc, started)
            with open(a.out, "w") as f:  # after every scenario: a partial run keeps what it has
                f.write(text)
    except KeyboardInterrupt:
        print("[ddp_faults] interrupted; the results so far are in " + a.out, file=sys.stderr)
        return 130
    table = text.split("## Details")[0]
    print(table)
    print(f"[ddp_faults] {len(results)} scenario(s) in {time.time() - started:.0f} s; table and "
          f"details in {a.out}" + (f", whole outputs in {log_dir}/" if log_dir else ""), file=sys.stderr)
    return 0


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="ddp_faults.md", help="markdown file to write (parent mode)")
    p.add_argument("--timeout-s", type=float, default=20.0,
                   help="NCCL process-group timeout T in seconds (PyTorch's default: 600)")
    p.add_argument("--nproc", type=int, default=2, help="processes (GPUs) per job")
    p.add_argument("--only", default="", help=f"comma-separated subset of: {','.join(NAMES)}")
    p.add_argument("--wall-s", type=float, default=0.0,
                   help="hard wall limit per job, then kill (default 3*T + 60)")
    p.add_argument("--log-dir", default=None,
                   help="where each job's whole output goes (default <out>.logs; '' for none)")
    p.add_argument("--torchrun", default="",
                   help="launcher command (default: torchrun on PATH, else python -m torch.distributed.run)")
    p.add_argument("--worker", choices=NAMES, help=argparse.SUPPRESS)
    p.add_argument("--guard-s", type=float, default=0.0, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.timeout_s <= 0:
        p.error("--timeout-s must be positive")
    if a.worker:
        return worker_main(a)
    return parent_main(a)


if __name__ == "__main__":
    sys.exit(main())
