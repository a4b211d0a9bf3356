"""What the PyTorch DDP peers of lockstep's benchmarks (resnet50_ddp.py, gpt2_ddp.py) share: the
rank's set-up under torchrun and --memory-trace's line, the one lockstep's libtorch programs
print (examples/03_gpt2_torch/bench_memory.hpp)."""
import os
import types

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
