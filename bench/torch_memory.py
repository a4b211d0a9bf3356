"""--memory-trace of the PyTorch peers (resnet50_ddp.py, gpt2_ddp.py): the line lockstep's
libtorch programs print (examples/03_gpt2_torch/bench_memory.hpp), for PyTorch."""
import torch


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
