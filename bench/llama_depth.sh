#!/usr/bin/env bash
# The largest Llama (example 05's family: width 4096, 32 heads, FFN 11008, vocabulary 32000) each
# system trains on N GPUs without running out of memory, and its step time and memory there:
# issue 27's deep-model comparison. 1 x 2048 tokens per GPU, bf16, fused AdamW, activation
# checkpointing on for all.
#   bench/llama_depth.sh BUILD_DIR N SYSTEM...     SYSTEM: ddp fsdp (PyTorch), z0 z1 z2 z3 (lockstep)
# Per system: depths 4 and 12 give the device memory per block (a straight line through both);
# the depth that line puts at the card's memory less 3 GiB is tried, then 2 deeper while it
# trains (at most twice), or 2 shallower while it does not (at most 3 times). One row per run:
#   "depth: SYSTEM gpus=N depth=D ok|oom step_ms=... tokens_per_s=... peak_gib=... used_gib=..."
# and per system "largest: SYSTEM gpus=N depth=D". DATA (default .carry/fortunes or Debian's);
# DEPTHS="86 88": run those depths only, no search.
set -uo pipefail
B=${1:?build dir}; N=${2:?gpus}; shift 2
ARGS=${ARGS:-}  # more flags for example 05 (lockstep rows), e.g. "--scatters 1"
DATA=${DATA:-/usr/share/games/fortunes}; [[ -d .carry/fortunes ]] && DATA=${DATA_DIR:-.carry/fortunes}
STEPS=${STEPS:-6}; WARM=${WARM:-3}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
DEVS=$(seq -s, 0 $((N - 1)))
total=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i 0)  # MiB
budget=$(( total / 1024 - 3 ))                                                  # GiB

# run SYSTEM DEPTH: prints the row; sets ok, used.
run() {
  local sys=$1 d=$2 out rc
  if [[ $sys == ddp || $sys == fsdp ]]; then
    out=$(CUDA_VISIBLE_DEVICES=$DEVS timeout ${T:-300} torchrun --nproc-per-node "$N" bench/llama_fsdp.py \
      --data "$DATA" --mode "$sys" --depth "$d" --steps "$STEPS" --warmup "$WARM" --recompute 2>&1); rc=$?
    local line; line=$(grep -E "^bench: llama" <<<"$out" | tail -1)
    if [[ $rc == 0 && -n $line ]]; then
      ok=1
      used=$(sed -E 's/.*device_used_gib=([0-9.]+).*/\1/' <<<"$line")
      echo "depth: $sys gpus=$N depth=$d ok step_ms=$(sed -E 's/.*step_ms=([0-9.]+).*/\1/' <<<"$line")" \
        "tokens_per_s=$(sed -E 's/.*tokens_per_s=([0-9.]+).*/\1/' <<<"$line")" \
        "peak_gib=$(sed -E 's/.*peak_reserved_gib=([0-9.]+).*/\1/' <<<"$line") used_gib=$used"
      return
    fi
  else
    out=$(CUDA_VISIBLE_DEVICES=$DEVS timeout ${T:-300} "$B/tools/lockstep-run" --nproc "$N" \
      "$B/examples/05_llama_fsdp/llama_fsdp" --data "$DATA" --depth "$d" --steps "$STEPS" --warmup "$WARM" \
      --log-every "$STEPS" --recompute --zero "${sys#z}" $ARGS 2>&1); rc=$?
    local line; line=$(grep -E "llama_fsdp: loss" <<<"$out" | tail -1)
    if [[ -n $line ]]; then  # trained every step (exit 1 says the loss did not go down: too few steps here)
      ok=1
      used=$(sed -E 's/.* ([0-9.]+) GiB in use at the end.*/\1/' <<<"$line")
      echo "depth: $sys gpus=$N depth=$d ok step_ms=$(sed -E 's/.*median step ([0-9.]+) ms.*/\1/' <<<"$line")" \
        "tokens_per_s=$(sed -E 's/.*ms, ([0-9]+) tokens.*/\1/' <<<"$line")" \
        "peak_gib=$(sed -E 's/.*peak ([0-9.]+) GiB per GPU.*/\1/' <<<"$line") used_gib=$used"
      grep -E "llama_fsdp: memory" <<<"$out" | sed 's/^/  /'
      return
    fi
  fi
  ok=0
  local why=failed; grep -qiE "out of memory|oom=1|OutOfMemory|cudaErrorMemoryAllocation" <<<"$out" && why=oom
  echo "depth: $sys gpus=$N depth=$d $why rc=$rc $(grep -iE "out of memory|error" <<<"$out" | head -1 | cut -c1-480)"
}

if [[ -n ${DEPTHS:-} ]]; then  # given depths: one run each, no search
  for sys in "$@"; do for d in $DEPTHS; do run "$sys" "$d"; done; done
  exit 0
fi
for sys in "$@"; do
  run "$sys" 4; u4=${used:-0}; ok4=$ok
  run "$sys" 12; u12=${used:-0}
  if [[ $ok4 != 1 || $ok != 1 ]]; then echo "largest: $sys gpus=$N depth=<12 (see rows)"; continue; fi
  d=$(awk -v a="$u4" -v b="$u12" -v m="$budget" 'BEGIN { s = (b - a) / 8; print (s > 0) ? int(4 + (m - a) / s) : 12 }')
  best=12; tries=0
  run "$sys" "$d"
  if [[ $ok == 1 ]]; then
    best=$d
    while (( tries < 2 )); do d=$((d + 2)); tries=$((tries + 1)); run "$sys" "$d"; [[ $ok == 1 ]] || break; best=$d; done
  else
    while (( tries < 3 && d > 12 )); do d=$((d - 2)); tries=$((tries + 1)); run "$sys" "$d"; [[ $ok == 1 ]] && { best=$d; break; }; done
  fi
  echo "largest: $sys gpus=$N depth=$best"
done
