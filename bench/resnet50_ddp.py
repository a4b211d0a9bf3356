#!/usr/bin/env python3
"""ResNet-50 in PyTorch under DistributedDataParallel: the peer that bench/resnet50_torch.cpp
(libtorch + lockstep) is measured against (bench/resnet50_torch.sh).

The same model as bench/resnet50/resnet.hpp, written out with plain torch.nn: torchvision's
resnet50 (Bottleneck blocks [3, 4, 6, 3], the stride on the 3x3 convolution, BatchNorm2d,
Kaiming-normal convolutions, BatchNorm weight 1 / bias 0, zero_init_residual off, 1000 classes;
25,557,032 parameters — checked against torchvision.models.resnet50(weights=None) when
torchvision is importable). The same data: a pool of --pool batches per rank (normal images,
uniform labels) made on the GPU from the seed and the rank, cycled. bf16 autocast,
channels_last (model and images), cuDNN's autotuner on, SGD(momentum 0.9, weight decay 1e-4;
fused where this PyTorch has it, else foreach). DDP with its best settings for this model:
gradient_as_bucket_view=True, static_graph=True, broadcast_buffers at DDP's default (True).
One GPU: no DDP.

  python3 bench/resnet50_ddp.py                                     # one GPU: bench: pytorch-1gpu ...
  torchrun --standalone --nproc-per-node 4 bench/resnet50_ddp.py    # DDP on 4: bench: ddp ...
Prints one line on rank 0:
  "bench: ddp gpus=N step_ms=... images_per_s=... params=... peak_alloc_gib=... reserved_gib=...
   used_gib=... loss_first=... loss_last=..."
step_ms: each rank's median step after the warm-up (synchronised), the most of any rank;
peak_alloc_gib: torch.cuda.max_memory_allocated; reserved_gib: torch.cuda.memory_reserved at the
end; used_gib: torch.cuda.mem_get_info's used bytes at the end (everything: NCCL too), the most of
any GPU. --bucket-cap-mb / --broadcast-buffers, when given, go to DDP and into the label.
"""
import argparse
import math
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_peer  # bench/ddp_peer.py, beside this script

RESNET50_PARAMETERS = 25_557_032


class Bottleneck(nn.Module):
    """torchvision's Bottleneck (groups 1, base width 64, dilation 1)."""
    expansion = 4

    def __init__(self, inplanes, planes, stride):
        super().__init__()
        out = planes * self.expansion
        self.conv1 = nn.Conv2d(inplanes, planes, kernel_size=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, kernel_size=3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, out, kernel_size=1, bias=False)
        self.bn3 = nn.BatchNorm2d(out)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or inplanes != out:
            self.downsample = nn.Sequential(nn.Conv2d(inplanes, out, kernel_size=1, stride=stride, bias=False),
                                            nn.BatchNorm2d(out))

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


class ResNet(nn.Module):
    """torchvision's ResNet with Bottleneck blocks; the defaults are resnet50."""

    def __init__(self, blocks=(3, 4, 6, 3), width=64, classes=1000):
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        inplanes = width
        for s, n in enumerate(blocks):
            planes = width << s
            stage = []
            for b in range(n):
                stage.append(Bottleneck(inplanes, planes, 2 if b == 0 and s > 0 else 1))
                inplanes = planes * Bottleneck.expansion
            setattr(self, f"layer{s + 1}", nn.Sequential(*stage))
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(inplanes, classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


CONFIGS = {
    "full": dict(blocks=(3, 4, 6, 3), width=64, classes=1000),  # ResNet-50
    "tiny": dict(blocks=(1, 1, 1, 1), width=8, classes=10),     # resnet.hpp's tiny config
}


def check_against_torchvision(model):
    """Same parameter count, names and shapes as torchvision's resnet50, if torchvision imports."""
    try:
        import torchvision
    except Exception as e:  # not installed, or built for another torch
        return f"torchvision not importable ({type(e).__name__}); parameter count checked against {RESNET50_PARAMETERS}"
    try:
        ref = torchvision.models.resnet50(weights=None)
    except TypeError:  # torchvision < 0.13
        ref = torchvision.models.resnet50(pretrained=False)
    ref_count = sum(p.numel() for p in ref.parameters())
    assert ref_count == RESNET50_PARAMETERS, ref_count
    mine = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    theirs = {k: tuple(v.shape) for k, v in ref.state_dict().items()}
    assert mine == theirs, sorted(set(mine.items()) ^ set(theirs.items()))[:8]
    return f"equal to torchvision {torchvision.__version__}'s resnet50 (parameters, buffers, names, shapes)"


def make_sgd(params, lr):
    kw = dict(lr=lr, momentum=0.9, weight_decay=1e-4)
    try:
        return torch.optim.SGD(params, fused=True, **kw), "fused"
    except (TypeError, RuntimeError, ValueError):  # no fused SGD in this PyTorch
        return torch.optim.SGD(params, foreach=True, **kw), "foreach"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", choices=sorted(CONFIGS), default="full")
    ap.add_argument("--batch", type=int, default=64, help="images per GPU and step")
    ap.add_argument("--image", type=int, default=224)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--pool", type=int, default=4, help="distinct batches per rank, cycled")
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--bucket-cap-mb", type=float, default=None, help="DDP's bucket_cap_mb (default: DDP's, 25)")
    ap.add_argument("--memory-trace", action="store_true",
                    help="rank 0 prints the device memory in use after each phase of set-up")
    ap.add_argument("--broadcast-buffers", choices=("on", "off"), default=None,
                    help="DDP's broadcast_buffers (default: DDP's, on)")
    a = ap.parse_args()
    if not (a.batch >= 1 and a.image >= 32 and a.steps >= 1 and 0 <= a.warmup < a.steps and a.pool >= 1):
        ap.error("give batch >= 1, image >= 32, steps >= 1, 0 <= warmup < steps, pool >= 1")

    peer = ddp_peer.start(a.memory_trace)  # torchrun's rank, its GPU, NCCL; --memory-trace's mark
    world, rank, local, dev, mark = peer.world, peer.rank, peer.local, peer.dev, peer.mark
    torch.backends.cudnn.benchmark = True
    cfg = CONFIGS[a.config]

    torch.manual_seed(a.seed)  # the same weights on every rank (DDP broadcasts rank 0's anyway)
    model = ResNet(**cfg)
    params = sum(p.numel() for p in model.parameters())
    note = ""
    if a.config == "full":
        assert params == RESNET50_PARAMETERS, params
        note = check_against_torchvision(model)
    model = model.to(dev, memory_format=torch.channels_last)
    # The data: fresh per run from the seed, different on every rank, made on the GPU.
    torch.manual_seed(a.seed + 1 + rank)
    pool = [(torch.randn(a.batch, 3, a.image, a.image, device=dev).contiguous(memory_format=torch.channels_last),
             torch.randint(cfg["classes"], (a.batch,), device=dev)) for _ in range(a.pool)]

    mark("model and data on the GPU")
    label = "ddp" if world > 1 else "pytorch-1gpu"
    if world > 1:
        ddp_kw = dict(device_ids=[local], gradient_as_bucket_view=True, static_graph=True)
        if a.bucket_cap_mb is not None:
            ddp_kw["bucket_cap_mb"] = a.bucket_cap_mb
            label += f"+bucket-cap-mb={a.bucket_cap_mb:g}"
        if a.broadcast_buffers is not None:
            ddp_kw["broadcast_buffers"] = a.broadcast_buffers == "on"
            label += f"+broadcast-buffers={a.broadcast_buffers}"
        model = DDP(model, **ddp_kw)
    mark("DDP" if world > 1 else "(no DDP)")
    opt, opt_kind = make_sgd(model.parameters(), a.lr)
    if rank == 0:
        print(f"resnet50_ddp: {a.config}, {params} parameters, {world} GPU(s), {a.batch} images of {a.image} x "
              f"{a.image} per GPU and step, SGD {opt_kind}, torch {torch.__version__}"
              + (f"; {note}" if note else ""), flush=True)

    times, losses = [], []
    for step in range(a.steps):
        t0 = time.perf_counter()
        x, y = pool[step % a.pool]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        torch.cuda.synchronize(dev)
        times.append((time.perf_counter() - t0) * 1e3)
        if step in (0, a.steps - 1):
            losses.append(loss.item())
        if step < 2:
            mark("after step 1" if step == 0 else "after step 2")
    mark("end")
    timed = sorted(times[a.warmup:])
    free, total = torch.cuda.mem_get_info(dev)  # everything on the GPU: NCCL's buffers, the allocator's cache
    gib = 2**30
    worst = torch.tensor([timed[len(timed) // 2], torch.cuda.max_memory_allocated(dev) / gib,
                          torch.cuda.memory_reserved(dev) / gib, (total - free) / gib], device=dev, dtype=torch.float64)
    mean_loss = torch.tensor([losses[0], losses[-1]], device=dev, dtype=torch.float64)
    if world > 1:
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        dist.all_reduce(mean_loss, op=dist.ReduceOp.SUM)
        mean_loss /= world
    first, last = mean_loss.tolist()
    if rank == 0:
        ms, peak, reserved, used = worst.tolist()
        print(f"bench: {label} gpus={world} step_ms={ms:.2f} images_per_s={a.batch * world / (ms / 1e3):.0f} "
              f"params={params} peak_alloc_gib={peak:.2f} reserved_gib={reserved:.2f} used_gib={used:.2f} "
              f"loss_first={first:.3f} loss_last={last:.3f}", flush=True)
    if world > 1:
        dist.destroy_process_group()
    if not (math.isfinite(first) and math.isfinite(last)):
        print("resnet50_ddp: error: the loss is not finite", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
