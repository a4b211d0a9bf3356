#!/usr/bin/env python3
"""GPT-2 small in PyTorch under DistributedDataParallel: the peer that
examples/03_gpt2_torch (libtorch + lockstep) is measured against (bench/gpt2_torch.sh).

The same model as examples/03_gpt2_torch/gpt2.hpp (GPT-2 small, vocabulary 50304, learned
positions, pre-LayerNorm, GELU(tanh) MLP, causal scaled-dot-product attention, untied head,
the same initialisation), the same data (byte windows of a text directory), bf16 autocast,
AdamW(0.9, 0.95, wd 0.1). DDP with its best settings: gradient_as_bucket_view=True,
static_graph=True, fused AdamW. One GPU: no DDP.

  python3 bench/gpt2_ddp.py --data DIR                      # one GPU
  torchrun --nproc-per-node 4 bench/gpt2_ddp.py --data DIR  # DDP on 4
Prints one line: "bench: ddp gpus=N step_ms=... tokens_per_s=... peak_gib=... loss_first=... loss_last=..."
--profile TRACE.json writes a Chrome trace (torch.profiler) of the three steps after the warm-up
(rank 0), for bench/kernel_profile.py to set beside examples/03_gpt2_torch's --profile trace.
"""
import argparse
import math
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_peer  # bench/ddp_peer.py, beside this script


class Block(nn.Module):
    def __init__(self, width, heads, layers):
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(width)
        self.attn_qkv = nn.Linear(width, 3 * width)
        self.attn_proj = nn.Linear(width, width)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp_fc = nn.Linear(width, 4 * width)
        self.mlp_proj = nn.Linear(4 * width, width)
        residual = 0.02 / math.sqrt(2 * layers)
        with torch.no_grad():
            for l, std in ((self.attn_qkv, 0.02), (self.mlp_fc, 0.02),
                           (self.attn_proj, residual), (self.mlp_proj, residual)):
                l.weight.normal_(0.0, std)
                l.bias.zero_()

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.attn_qkv(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = x + self.attn_proj(y.transpose(1, 2).contiguous().view(B, T, C))
        return h + self.mlp_proj(F.gelu(self.mlp_fc(self.ln_2(h)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, vocab=50304, context=1024, layers=12, heads=12, width=768):
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(context, width)
        self.h = nn.ModuleList(Block(width, heads, layers) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        with torch.no_grad():
            self.wte.weight.normal_(0.0, 0.02)
            self.wpe.weight.normal_(0.0, 0.01)
            self.lm_head.weight.normal_(0.0, 0.02)

    def forward(self, idx, targets):
        T = idx.size(1)
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for b in self.h:
            x = b(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.reshape(-1))


def load_text(path):
    files = [path] if os.path.isfile(path) else sorted(
        os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs
        if not f.endswith(".dat") and not os.path.islink(os.path.join(d, f)))
    return np.frombuffer(b"".join(open(f, "rb").read() for f in files), dtype=np.uint8)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/usr/share/games/fortunes")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--seed", type=int, default=42)
    ddp_peer.add_profile_option(ap)
    ap.add_argument("--fsdp", action="store_true",
                    help="PyTorch FSDP2 instead of DDP: fully_shard per block and the root, "
                         "MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32), no autocast")
    ap.add_argument("--memory-trace", action="store_true",
                    help="rank 0 prints the device memory in use after each phase of set-up")
    a = ap.parse_args()

    peer = ddp_peer.start(a.memory_trace)  # torchrun's rank, its GPU, NCCL; --memory-trace's mark
    world, rank, local, dev, mark = peer.world, peer.rank, peer.local, peer.dev, peer.mark
    text = load_text(a.data)
    torch.manual_seed(a.seed)
    model = GPT(context=max(1024, a.seq)).to(dev)
    mark("model on the device")
    if a.fsdp:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for b in model.h:
            fully_shard(b, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
    elif world > 1:
        model = DDP(model, device_ids=[local], gradient_as_bucket_view=True, static_graph=True)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)
    mark("DDP, optimizer")
    times, losses = ddp_peer.run_steps(a, model, opt, text, rank, dev, mark, autocast=not a.fsdp)
    mark("end")
    timed = sorted(times[a.warmup:])
    free, total = torch.cuda.mem_get_info(dev)  # everything on the GPU: NCCL's buffers, the allocator's cache
    stats = torch.tensor([timed[len(timed) // 2], torch.cuda.max_memory_allocated(dev) / 2**30, (total - free) / 2**30],
                         device=dev)
    if world > 1:
        dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    if rank == 0:
        ms, peak, used = stats.tolist()
        first, last = losses.tolist()
        name = "fsdp2" if a.fsdp else "ddp"
        print(f"bench: {name} gpus={world} step_ms={ms:.2f} tokens_per_s={a.batch * a.seq * world / (ms / 1e3):.0f} "
              f"peak_gib={peak:.2f} loss_first={first:.3f} loss_last={last:.3f}", flush=True)
        print(f"bench-memory: {name} device_used_gib={used:.2f} (cudaMemGetInfo at the end, the most of any GPU)",
              flush=True)
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
