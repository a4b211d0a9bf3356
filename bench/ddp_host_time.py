"""PyTorch DDP's own host time per step for GPT-2's parameter set, the counterpart of
bench_sync's "g" row (lockstep's host time per step and per bucket). A module holds GPT-2's
148 tensors (bf16); its forward touches one element of each, so the backward is 148 small
autograd nodes that write full gradients. The host time of forward + backward (nothing waits
for the GPU inside; every iteration ends synchronised, untimed) is taken with DDP (best
settings: gradient_as_bucket_view, static_graph) and without it on the same GPU; DDP's own
cost is the difference, per step and per bucket.

    torchrun --nproc-per-node 2 bench/ddp_host_time.py --shapes gpt2_124m_shapes.txt [--iters 50]
"""
import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_peer


class Shapes(torch.nn.Module):
    def __init__(self, shapes, dev):
        super().__init__()
        self.ps = torch.nn.ParameterList(
            [torch.nn.Parameter(torch.randn(*dims, device=dev, dtype=torch.bfloat16)) for _, dims in shapes])

    def forward(self, x):
        return sum((p.view(-1)[:1] * x).sum() for p in self.ps)


def host_us(model, x, iters):
    times = []
    for i in range(iters + 5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model(x).backward()
        t1 = time.perf_counter()
        if i >= 5:
            times.append((t1 - t0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", required=True)
    ap.add_argument("--iters", type=int, default=50)
    a = ap.parse_args()
    shapes = []
    for line in open(a.shapes):
        f = line.split()
        if f and not f[0].startswith("#"):
            shapes.append((f[0], [int(d) for d in f[1:]]))
    r = ddp_peer.start(False)
    world, rank, dev = r.world, r.rank, r.dev
    x = torch.ones(1, device=dev, dtype=torch.bfloat16)
    plain = host_us(Shapes(shapes, dev), x, a.iters)
    for name, kw in (("defaults", {}), ("bucket view + static graph", dict(gradient_as_bucket_view=True,
                                                                           static_graph=True))):
        ddp = DDP(Shapes(shapes, dev), device_ids=[dev.index], bucket_cap_mb=25, **kw)
        wrapped = host_us(ddp, x, a.iters)
        # The slowest rank's figures.
        t = torch.tensor([plain, wrapped], device=dev, dtype=torch.float64)
        if world > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        p, w = t.tolist()
        log = ddp._get_ddp_logging_data()
        sizes = log.get("rebuilt_bucket_sizes") or log.get("bucket_sizes", "")
        buckets = len([s for s in str(sizes).split(",") if s.strip()]) or 1
        if rank == 0:
            print(f"ddp-host  bf16 {world} GPU  DDP ({name}): forward+backward host time {w:.1f} us, without DDP "
                  f"{p:.1f} us: DDP's own {w - p:.1f} us per step, {buckets} buckets, {(w - p) / buckets:.1f} us "
                  f"per bucket", flush=True)
        del ddp
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
