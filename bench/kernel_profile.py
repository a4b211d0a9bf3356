#!/usr/bin/env python3
"""Where two programs' GPU time goes, side by side, from their Chrome traces (Kineto/CUPTI, as
written by torch.profiler's export_chrome_trace or libtorch's ProfilerResult::save).

  python3 bench/kernel_profile.py A.json B.json [--steps 3] [--names A,B] [--top 25]

Both traces must cover the same number of steps (examples/03_gpt2_torch --profile and
bench/gpt2_ddp.py --profile record the three steps after the warm-up). Prints, per step:
the span from the first to the last GPU activity, the time some GPU activity ran (the union of
kernel, copy and memset intervals; span - busy = the GPU waiting for the host), then the time and
launch count of each family of kernels (GEMMs, attention, LayerNorm, the optimizer, ...) and the
kernels whose time differs most, so that a gap between two implementations of one model shows
where it is.
"""
import argparse
import collections
import json
import re
import sys

GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}

# (family, pattern on the kernel's name), first match wins.
FAMILIES = [
    ("nccl", r"nccl"),
    ("attention (flash / SDPA)", r"flash|fmha|attention|sdpa|cudnn.*(mha|sdpa)"),
    ("GEMM", r"gemm|sm90_xmma|sm80_xmma|cutlass|nvjet|cublas|xmma"),
    ("LayerNorm", r"layer_norm|LayerNorm|layernorm"),
    ("softmax / cross-entropy", r"softmax|nll_loss|cross_entropy|log_softmax"),
    ("GELU", r"gelu|Gelu|GeluCUDA"),
    ("embedding", r"embedding|indexSelect|index_select|EmbeddingBag"),
    ("optimizer (AdamW)", r"adam|Adam|fused_optimizer|lockstep::cuda::kernels::detail::adamw"),
    ("lockstep kernels", r"lockstep"),
    ("reduction (sum)", r"reduce_kernel|ReduceOp|sum_functor"),
    ("fill / zero", r"FillFunctor|fill_kernel|zero"),
    ("copy / cast", r"copy|Copy|cast"),
    ("elementwise (add, mul, ...)", r"elementwise|Functor|vectorized|unrolled"),
]


def load(path):
    with open(path) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    out = []
    for e in events:
        if e.get("ph") != "X" or str(e.get("cat", "")).lower() not in GPU_CATS:
            continue
        args = e.get("args") or {}
        out.append((float(e["ts"]), float(e.get("dur", 0.0)), str(e.get("cat")).lower(), e.get("name", "?"),
                    args.get("device", 0)))
    if not out:
        sys.exit(f"kernel_profile: {path} holds no GPU activity (kernel / gpu_memcpy / gpu_memset events): "
                 "was it recorded with CUDA activity on?")
    return out


def family(cat, name):
    if cat == "gpu_memcpy":
        return "memcpy"
    if cat == "gpu_memset":
        return "memset"
    for fam, pat in FAMILIES:
        if re.search(pat, name):
            return fam
    return "other"


def busy_union(intervals):
    total, end = 0.0, None
    start = None
    for ts, dur in sorted(intervals):
        if end is None or ts > end:
            if end is not None:
                total += end - start
            start, end = ts, ts + dur
        else:
            end = max(end, ts + dur)
    if end is not None:
        total += end - start
    return total


def summarize(events, steps):
    by_dev = collections.defaultdict(list)
    for ts, dur, _, _, dev in events:
        by_dev[dev].append((ts, dur))
    first = min(ts for ts, *_ in events)
    last = max(ts + dur for ts, dur, *_ in events)
    fam_t, fam_n = collections.Counter(), collections.Counter()
    name_t, name_n = collections.Counter(), collections.Counter()
    for ts, dur, cat, name, _ in events:
        f = family(cat, name)
        fam_t[f] += dur
        fam_n[f] += 1
        name_t[name] += dur
        name_n[name] += 1
    busy = max(busy_union(v) for v in by_dev.values())  # the busiest GPU
    ms = 1e-3 / steps
    return {
        "span": (last - first) * ms,
        "busy": busy * ms,
        "devices": len(by_dev),
        "fam_t": {k: v * ms for k, v in fam_t.items()},
        "fam_n": {k: v / steps for k, v in fam_n.items()},
        "name_t": {k: v * ms for k, v in name_t.items()},
        "name_n": {k: v / steps for k, v in name_n.items()},
    }


def short(name, width=110):
    name = re.sub(r"\s+", " ", name)
    return name if len(name) <= width else name[: width - 1] + "…"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--steps", type=int, default=3, help="steps each trace covers (default 3)")
    ap.add_argument("--names", default="A,B", help="column names, e.g. pytorch,lockstep")
    ap.add_argument("--top", type=int, default=25, help="kernels listed by |difference| (default 25)")
    a = ap.parse_args()
    na, nb = (a.names.split(",") + ["B"])[:2]
    A, B = summarize(load(a.a), a.steps), summarize(load(a.b), a.steps)

    print(f"per step (ms), {a.steps} steps each; {na}: {a.a} ({A['devices']} GPU(s)); {nb}: {a.b} ({B['devices']} GPU(s))\n")
    print(f"| | {na} | {nb} | {nb} - {na} |")
    print("| --- | ---: | ---: | ---: |")
    for key, label in (("span", "first to last GPU activity"), ("busy", "GPU busy (union of intervals)")):
        print(f"| {label} | {A[key]:.3f} | {B[key]:.3f} | {B[key] - A[key]:+.3f} |")
    print(f"| GPU idle inside the span | {A['span'] - A['busy']:.3f} | {B['span'] - B['busy']:.3f} | "
          f"{(B['span'] - B['busy']) - (A['span'] - A['busy']):+.3f} |")
    print()
    print(f"| family | {na} ms | {na} launches | {nb} ms | {nb} launches | {nb} - {na} ms |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    fams = sorted(set(A["fam_t"]) | set(B["fam_t"]), key=lambda f: -max(A["fam_t"].get(f, 0), B["fam_t"].get(f, 0)))
    for f in fams:
        ta, tb = A["fam_t"].get(f, 0.0), B["fam_t"].get(f, 0.0)
        print(f"| {f} | {ta:.3f} | {A['fam_n'].get(f, 0):.0f} | {tb:.3f} | {B['fam_n'].get(f, 0):.0f} | {tb - ta:+.3f} |")
    print(f"| **sum of GPU activity** | {sum(A['fam_t'].values()):.3f} | {sum(A['fam_n'].values()):.0f} | "
          f"{sum(B['fam_t'].values()):.3f} | {sum(B['fam_n'].values()):.0f} | "
          f"{sum(B['fam_t'].values()) - sum(A['fam_t'].values()):+.3f} |")
    print()
    names = set(A["name_t"]) | set(B["name_t"])
    diff = sorted(names, key=lambda n: -abs(B["name_t"].get(n, 0) - A["name_t"].get(n, 0)))[: a.top]
    print(f"kernels whose time differs most (ms per step; launches per step)\n")
    print(f"| {nb} - {na} | {na} ms (n) | {nb} ms (n) | kernel |")
    print("| ---: | ---: | ---: | --- |")
    for n in diff:
        ta, tb = A["name_t"].get(n, 0.0), B["name_t"].get(n, 0.0)
        print(f"| {tb - ta:+.3f} | {ta:.3f} ({A['name_n'].get(n, 0):.0f}) | {tb:.3f} ({B['name_n'].get(n, 0):.0f}) | "
              f"`{short(n)}` |")


if __name__ == "__main__":
    main()
