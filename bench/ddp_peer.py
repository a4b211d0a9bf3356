"""What the PyTorch peers of lockstep's benchmarks (resnet50_ddp.py, gpt2_ddp.py, llama_fsdp.py)
share: the rank's set-up under torchrun and --memory-trace's line, the one lockstep's libtorch
programs print (examples/03_gpt2_torch/bench_memory.hpp); the language models' timed step loop
and its --profile trace."""
import os
import time
import types

import numpy as np

import torch
import torch.distributed as dist


def marker(enabled, dev, rank):
    """A function mark(phase) that prints, on rank 0 when enabled, cudaMemGetInfo's used bytes
    on dev (everything: context, NCCL, the allocator's cache) beside the caching allocator's
    reserved and allocated bytes, after the device's work so far."""
    def mark(phase):
        if not enabled or rank != 0:
            return
        torch.cuda.synchronize(dev)
        free, total = torch.cuda.mem_get_info(dev)
        print(f"memory: {phase:<28} used_gib={(total - free) / 2**30:.3f} "
              f"torch_reserved_gib={torch.cuda.memory_reserved(dev) / 2**30:.3f} "
              f"torch_allocated_gib={torch.cuda.memory_allocated(dev) / 2**30:.3f}", flush=True)
    return mark


def start(memory_trace):
    """This rank under torchrun (or alone): its GPU made current, NCCL's process group joined when
    there are several, libtorch's allocator made, and the first memory mark. Returns world, rank,
    local, dev and mark (see marker)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    if world > 1:
        dist.init_process_group("nccl", device_id=dev)
    mark = marker(memory_trace, dev, rank)
    torch.zeros(1, device=dev)
    mark("context" + (", NCCL" if world > 1 else ""))
    return types.SimpleNamespace(world=world, rank=rank, local=local, dev=dev, mark=mark)


PROFILED_STEPS = 3  # --profile records steps [warmup, warmup + 3), as the C++ examples' --profile


def add_profile_option(ap):
    ap.add_argument("--profile", default="",
                    help=f"Chrome trace of steps [warmup, warmup + {PROFILED_STEPS}) on rank 0 (GPU activity)")


def run_steps(a, model, opt, text, rank, dev, mark, autocast):
    """a.steps training steps, each on a.batch windows of a.seq + 1 bytes of text drawn from this
    rank's stream (seed a.seed): forward (under bf16 autocast when autocast), backward, opt.step,
    zero_grad, then the device synchronised. Returns each step's milliseconds and a device tensor
    of the first and the last step's loss. With a.profile, rank 0 writes a Chrome trace of steps
    [a.warmup, a.warmup + PROFILED_STEPS), GPU activity only (CPU operators would slow the host),
    for bench/kernel_profile.py to set beside a lockstep program's."""
    if a.profile and a.steps < a.warmup + PROFILED_STEPS:
        raise SystemExit(f"--profile records steps {a.warmup}..{a.warmup + PROFILED_STEPS - 1}: "
                         f"give --steps >= {a.warmup + PROFILED_STEPS}")
    rng = np.random.default_rng([a.seed, rank])
    times, losses, prof = [], torch.zeros(2, device=dev), None
    for step in range(a.steps):
        torch.cuda.synchronize(dev)
        if a.profile and rank == 0 and step == a.warmup:
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
            prof.__enter__()
        t0 = time.perf_counter()
        starts = rng.integers(0, len(text) - a.seq - 1, size=a.batch)
        rows = torch.from_numpy(np.stack([text[s:s + a.seq + 1] for s in starts]).astype(np.int64))
        rows = rows.pin_memory().to(dev, non_blocking=True)
        x, y = rows[:, :-1], rows[:, 1:]
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        torch.cuda.synchronize(dev)
        times.append((time.perf_counter() - t0) * 1e3)
        if step == 0:
            losses[0] = loss.detach()
            mark("after step 1")
        if step == a.steps - 1:
            losses[1] = loss.detach()
        if prof is not None and step + 1 == a.warmup + PROFILED_STEPS:
            prof.__exit__(None, None, None)
            prof.export_chrome_trace(a.profile)
            prof = None
    return times, losses
