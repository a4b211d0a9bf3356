#!/usr/bin/env python3
"""A Llama-style decoder in PyTorch, fully sharded by FSDP2 (fully_shard) or replicated by DDP: the
peer that examples/05_llama_fsdp (libtorch + lockstep's FullySharded) is measured against.

The same model as examples/05_llama_fsdp/llama.hpp (token embeddings, `depth` blocks of pre-RMSNorm
causal self-attention with rotary positions, theta 10000, and a SwiGLU MLP, no biases, a final
RMSNorm, an untied head, cross-entropy in fp32; every parameter but the norms ~ N(0, 0.02), the
norms ones; the same parameter names), the same data (byte windows of a text directory, tokens
< 256), fused AdamW(0.9, 0.95, wd 0.1). The model is built on the meta device and only then given
memory, so that one too large for a GPU can still be sharded:
  --mode fsdp  fully_shard per block and on the root, MixedPrecisionPolicy(param_dtype=bf16,
               reduce_dtype=fp32), no autocast (the default)
  --mode ddp   DistributedDataParallel(gradient_as_bucket_view, static_graph), bf16 autocast; one GPU: no DDP
--recompute recomputes each block in the backward (torch.utils.checkpoint, non-reentrant).

  torchrun --nproc-per-node 2 bench/llama_fsdp.py --depth 8               # FSDP2 on 2 GPUs
  torchrun --nproc-per-node 4 bench/llama_fsdp.py --mode ddp --depth 4    # DDP on 4
  python3 bench/llama_fsdp.py --depth 2                                    # one GPU (a group of one)
Prints one line from rank 0:
  "bench: llama MODE gpus=N depth=D params_m=... step_ms=... tokens_per_s=... peak_alloc_gib=...
   peak_reserved_gib=... device_used_gib=... loss_first=... loss_last=..."
step_ms is the median step after --warmup (the slowest rank's), the GiB the most of any rank
(torch.cuda.max_memory_allocated, max_memory_reserved, and cudaMemGetInfo's used bytes after the
last step), the losses the mean over ranks of the first and last step's. A rank that runs out of
device memory prints "[rank R] bench: llama MODE gpus=N depth=D oom=1 where=build|step" and exits 3.
"""
import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

import ddp_peer  # bench/ddp_peer.py, beside this script
from gpt2_ddp import load_text  # bench/gpt2_ddp.py: every file of a directory as bytes


class RMSNorm(nn.Module):
    """x / rms(x) * weight, the mean of squares taken in fp32 (llama.hpp's RMSNormImpl)."""

    def __init__(self, width):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x):
        f = x.float()
        return (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype) * self.weight


def rotate(x, cos, sin):
    """Rotates pairs (x[i], x[i + d/2]) of the last dimension by the angles of cos/sin [T, d/2]."""
    half = x.size(-1) // 2
    a, b = x.narrow(-1, 0, half), x.narrow(-1, half, half)
    c, s = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat((a * c - b * s, a * s + b * c), dim=-1)


class Block(nn.Module):
    def __init__(self, width, heads, ffn):
        super().__init__()
        self.heads = heads
        self.attention_norm = RMSNorm(width)
        self.wq = nn.Linear(width, width, bias=False)
        self.wk = nn.Linear(width, width, bias=False)
        self.wv = nn.Linear(width, width, bias=False)
        self.wo = nn.Linear(width, width, bias=False)
        self.ffn_norm = RMSNorm(width)
        self.w1 = nn.Linear(width, ffn, bias=False)
        self.w3 = nn.Linear(width, ffn, bias=False)
        self.w2 = nn.Linear(ffn, width, bias=False)

    def forward(self, x, cos, sin):
        """x [B, T, width]; cos/sin [T, head_dim / 2]."""
        B, T, C = x.shape
        d = C // self.heads
        h = self.attention_norm(x)

        def split(t):
            return t.view(B, T, self.heads, d).transpose(1, 2)

        q, k = rotate(split(self.wq(h)), cos, sin), rotate(split(self.wk(h)), cos, sin)
        y = F.scaled_dot_product_attention(q, k, split(self.wv(h)), is_causal=True)
        r = x + self.wo(y.transpose(1, 2).reshape(B, T, C))
        m = self.ffn_norm(r)
        return r + self.w2(F.silu(self.w1(m)) * self.w3(m))


class Llama(nn.Module):
    def __init__(self, vocab, depth, heads, width, ffn, recompute=False):
        super().__init__()
        self.heads, self.width, self.recompute = heads, width, recompute
        self.tok_embeddings = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(Block(width, heads, ffn) for _ in range(depth))
        self.norm = RMSNorm(width)
        self.output = nn.Linear(width, vocab, bias=False)

    def forward(self, idx, targets):
        """Mean cross-entropy of predicting targets [B, T] from idx [B, T] (int64)."""
        T, d = idx.size(1), self.width // self.heads
        inv = torch.pow(10000.0, -torch.arange(0, d, 2, dtype=torch.float32, device=idx.device) / d)
        angles = torch.outer(torch.arange(T, dtype=torch.float32, device=idx.device), inv)  # [T, d/2]
        x = self.tok_embeddings(idx)
        # cos/sin in the blocks' input dtype (bf16 under FSDP, as its cast of forward inputs would make them
        # anyway; fp32 under autocast): rotate() casts them to q's and k's dtype, as llama.hpp does, and a
        # recomputed block sees the same dtypes as its forward did.
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        for b in self.layers:
            x = checkpoint(b, x, cos, sin, use_reentrant=False) if self.recompute else b(x, cos, sin)
        logits = self.output(self.norm(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.reshape(-1))


def init_parameters(model, seed):
    """In place, as llama.hpp: every parameter whose name lacks "norm" ~ N(0, 0.02), the norms ones.
    The same seed on every rank: plain tensors get the same values everywhere, and DTensor (FSDP2's
    shards) draws each shard from its own offset of the one random stream, consistently across ranks."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)


def is_oom(e):
    """The caching allocator's OutOfMemoryError, or a CUDA "out of memory" met elsewhere (NCCL, a kernel)."""
    return isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower()


def oom_exit(rank, mode, world, depth, where):
    """Reports this rank's OOM and leaves at once: the process group may be broken (a collective the other
    ranks wait in), so no destroy_process_group, no all-reduce; torchrun ends the other ranks."""
    print(f"[rank {rank}] bench: llama {mode} gpus={world} depth={depth} oom=1 where={where}", flush=True)
    sys.stderr.flush()
    os._exit(3)


def main():
    ap = argparse.ArgumentParser(description="Llama-style decoder under FSDP2 or DDP (peer of examples/05_llama_fsdp)")
    ap.add_argument("--data", default="/usr/share/games/fortunes")
    ap.add_argument("--depth", type=int, default=32)
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--ffn", type=int, default=11008)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--mode", choices=("ddp", "fsdp"), default="fsdp")
    ap.add_argument("--recompute", action="store_true", help="recompute each block in the backward")
    ap.add_argument("--memory-trace", action="store_true",
                    help="rank 0 prints the device memory in use after each phase of set-up")
    ddp_peer.add_profile_option(ap)
    a = ap.parse_args()
    if (a.depth < 1 or a.heads < 1 or a.width % a.heads or (a.width // a.heads) % 2 or a.vocab < 256
            or a.batch < 1 or a.seq < 2 or a.steps <= a.warmup or a.warmup < 0):
        ap.error("need depth >= 1, width a multiple of heads with an even head size, vocab >= 256 (byte tokens), "
                 "batch >= 1, seq >= 2, steps > warmup >= 0")

    peer = ddp_peer.start(a.memory_trace)  # torchrun's rank, its GPU, NCCL when several; --memory-trace's mark
    world, rank, local, dev, mark = peer.world, peer.rank, peer.local, peer.dev, peer.mark
    if a.mode == "fsdp" and not dist.is_initialized():  # one GPU: fully_shard still wants a process group
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=dev)
    text = load_text(a.data)
    if len(text) < a.seq + 2:
        raise SystemExit(f"llama_fsdp.py: {a.data} holds {len(text)} bytes, fewer than --seq + 2")

    try:  # build: nothing of the model's size touches the device before to_empty
        with torch.device("meta"):
            model = Llama(a.vocab, a.depth, a.heads, a.width, a.ffn, recompute=a.recompute)
        params = sum(p.numel() for p in model.parameters())
        if a.mode == "fsdp":
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            for b in model.layers:
                fully_shard(b, mp_policy=mp, reshard_after_forward=True)
            fully_shard(model, mp_policy=mp)  # the root: embeddings, final norm, head
            model.to_empty(device=dev)
            init_parameters(model, a.seed)  # on the DTensor shards
        else:
            model.to_empty(device=dev)
            init_parameters(model, a.seed)
            if world > 1:
                model = DDP(model, device_ids=[local], gradient_as_bucket_view=True, static_graph=True)
        mark("model on the device")
        opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                                fused=True)
        mark("optimizer")
    except RuntimeError as e:
        if not is_oom(e):
            raise
        oom_exit(rank, a.mode, world, a.depth, "build")

    try:
        times, losses = ddp_peer.run_steps(a, model, opt, text, rank, dev, mark, autocast=a.mode == "ddp")
    except RuntimeError as e:
        if not is_oom(e):
            raise
        oom_exit(rank, a.mode, world, a.depth, "step")
    mark("end")

    timed = sorted(times[a.warmup:])
    free, total = torch.cuda.mem_get_info(dev)  # everything on the GPU: NCCL's buffers, the allocator's cache
    stats = torch.tensor([timed[len(timed) // 2], torch.cuda.max_memory_allocated(dev) / 2**30,
                          torch.cuda.max_memory_reserved(dev) / 2**30, (total - free) / 2**30], device=dev)
    if world > 1:
        dist.all_reduce(stats, op=dist.ReduceOp.MAX)
        dist.all_reduce(losses, op=dist.ReduceOp.SUM)
        losses /= world
    if rank == 0:
        ms, alloc, reserved, used = stats.tolist()
        first, last = losses.tolist()
        print(f"bench: llama {a.mode} gpus={world} depth={a.depth} params_m={params / 1e6:.1f} step_ms={ms:.2f} "
              f"tokens_per_s={a.batch * a.seq * world / (ms / 1e3):.0f} peak_alloc_gib={alloc:.2f} "
              f"peak_reserved_gib={reserved:.2f} device_used_gib={used:.2f} "
              f"loss_first={first:.3f} loss_last={last:.3f}", flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
