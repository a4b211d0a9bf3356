#!/usr/bin/env python3
"""Losing a rank mid-training, side by side (docs/elastic.md, bench/RESULTS.md):

  lockstep  `lockstep-run --elastic` with tests/cuda/dist/elastic_nccl: the survivors shrink in
            place and redo the step; with --max-restarts 1 a replacement joins them again.
  PyTorch   `torchrun --max-restarts 1` with DDP, resuming from a checkpoint saved after every
            step (the best case for the restart path: no step is lost to the checkpoint's age).

The same model (an MLP 37-64-33-10, fp32), per-rank batch 16, SGD, random data; rank N-1 SIGKILLs
itself before the forward of step --at. Reported, from the victim's clock at its kill (its
"KILL t=" line; CLOCK_MONOTONIC, one clock for every process of the host):
  - lockstep: "recovered in" (the kill to the survivors' next applied step), "joined in" (a
    replacement's start to its first applied step) and when the job was back at N ranks;
  - PyTorch: the kill to the first step applied after the restart, and how many steps were
    done again (the kill's step minus the checkpoint's).

  python3 bench/elastic_recovery.py --nproc 2 --lockstep build-gpu --repeat 3 --out results.md

The worker mode (--worker) is what torchrun runs.
"""
import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import time


def worker(args):
    import torch
    import torch.distributed as dist
    import torch.nn as nn

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")  # PyTorch's default: NCCL connects at the first collective
    torch.manual_seed(args.seed)
    dims = [37, 64, 33, 10]
    layers = []
    for i in range(len(dims) - 1):
        layers.append(nn.Linear(dims[i], dims[i + 1]))
        if i + 2 < len(dims):
            layers.append(nn.ReLU())
    model = nn.Sequential(*layers).cuda()
    ddp = nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(args.seed)
    X = (torch.rand(1999, dims[0], generator=g) * 4 - 2).cuda()
    y = torch.randint(0, 10, (1999,), generator=g).cuda()
    step = 0
    if os.path.exists(args.ckpt):
        ck = torch.load(args.ckpt, map_location="cuda")
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        step = ck["step"]
        print(f"RESUMED step={step} t={time.monotonic():.6f}", flush=True)
    while step < args.steps:
        if rank == world - 1 and restart == 0 and step == args.at:
            print(f"KILL t={time.monotonic():.6f}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        rows = (torch.arange(16, device="cuda") + step * 16 * world + rank * 16) % 1999
        loss = nn.functional.cross_entropy(ddp(X[rows]), y[rows])
        opt.zero_grad(set_to_none=False)
        loss.backward()
        opt.step()
        torch.cuda.synchronize()
        step += 1
        print(f"APPLIED step={step} t={time.monotonic():.6f}", flush=True)
        if rank == 0:  # a checkpoint after every step, replaced atomically
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, args.ckpt + ".tmp")
            os.replace(args.ckpt + ".tmp", args.ckpt)
        dist.barrier()  # the checkpoint is complete before any rank goes on
        if args.step_ms:
            time.sleep(args.step_ms / 1000)
    dist.destroy_process_group()


def run(cmd, env, limit):
    p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=limit)
    return p.returncode, p.stdout


def times(pattern, text):
    return [float(m) for m in re.findall(pattern, text)]


def one_torch(args, n):
    ckpt = f"/dev/shm/elastic_recovery_{os.getpid()}.pt"
    if os.path.exists(ckpt):
        os.remove(ckpt)
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", PYTHONUNBUFFERED="1")
    cmd = ["torchrun", "--standalone", f"--nproc-per-node={n}", "--max-restarts=1", __file__, "--worker",
           "--ckpt", ckpt, "--at", str(args.at), "--steps", str(args.steps), "--seed", str(args.seed),
           "--step-ms", str(args.step_ms)]
    rc, out = run(cmd, env, 600)
    if os.path.exists(ckpt):
        os.remove(ckpt)
    kill = times(r"KILL t=([0-9.]+)", out)
    applied = [(int(s), float(t)) for s, t in re.findall(r"APPLIED step=(\d+) t=([0-9.]+)", out)]
    resumed = [int(s) for s in re.findall(r"RESUMED step=(\d+)", out)]
    if rc != 0 or not kill or not resumed:
        return {"error": f"torchrun exit {rc}", "log": out[-3000:]}
    after = [t for _, t in applied if t > kill[0]]
    return {"recovered": min(after) - kill[0], "redone": args.at - min(resumed), "rc": rc}


def one_lockstep(args, n, rejoin):
    exe = os.path.join(args.lockstep, "tests", "cuda", "elastic_nccl")
    lr = os.path.join(args.lockstep, "tools", "lockstep-run")
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", LOCKSTEP_TIMEOUT="20")
    cmd = [lr, "--elastic"] + (["--max-restarts", "1"] if rejoin else []) + [
        "--nproc", str(n), exe, "--phase", "forward", "--at", str(args.at), "--steps", str(args.steps),
        "--step-ms", str(args.step_ms)] + (["--rejoin"] if rejoin else [])
    rc, out = run(cmd, env, 600)
    rec = times(r"recovered in ([0-9.]+) s", out)
    joined = times(r"joined in ([0-9.]+) s", out)
    if rc != 0 or "PASS" not in out or not rec:
        return {"error": f"lockstep-run exit {rc}", "log": out[-3000:]}
    r = {"recovered": max(rec), "rc": rc}
    if rejoin:
        r["joined"] = max(joined) if joined else float("nan")
    return r


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--ckpt", default="/dev/shm/elastic_recovery.pt")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--at", type=int, default=5)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--step-ms", type=int, default=100)
    ap.add_argument("--seed", type=int, default=int(time.time()) % 100000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--lockstep", default="build-gpu", help="lockstep's build folder")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    rows = []
    for kind in ("lockstep shrink", "lockstep shrink + rejoin", "PyTorch torchrun --max-restarts 1 + resume"):
        got, failed = [], []
        for _ in range(args.repeat):
            r = (one_torch(args, args.nproc) if kind.startswith("PyTorch")
                 else one_lockstep(args, args.nproc, "rejoin" in kind))
            if "error" in r:
                print(f"{kind}: {r['error']}\n{r['log']}", file=sys.stderr)
                why = [l for l in r["log"].splitlines() if "Error" in l or "error" in l]
                failed.append(why[-1].strip()[:160] if why else r["error"])
                continue
            got.append(r)
        note_failed = f"{len(failed)} of {args.repeat} runs failed (last: {failed[-1]})" if failed else ""
        if not got:
            rows.append(f"| {kind} | failed | | {note_failed} |")
            continue
        rec = [g["recovered"] for g in got]
        extra = ""
        if "joined" in got[0]:
            extra = "replacement's start → its first step: " + ", ".join(f"{g['joined']:.2f}" for g in got) + " s"
        if "redone" in got[0]:
            extra = f"steps done again: {got[0]['redone']} (checkpoint every step)"
        extra = "; ".join(x for x in (extra, note_failed) if x)
        rows.append(f"| {kind} | {statistics.median(rec):.2f} | {min(rec):.2f}–{max(rec):.2f} | {extra} |")
    table = "\n".join([f"{args.nproc} processes, kill -9 of rank {args.nproc - 1} before step {args.at}'s forward, "
                       f"{args.repeat} runs each, steps {args.step_ms} ms apart",
                       "",
                       "| path | kill → next applied step, median s | range s | note |",
                       "| --- | --- | --- | --- |"] + rows)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    sys.exit(main())
