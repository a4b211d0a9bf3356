#!/usr/bin/env bash
# What --deterministic costs on the real libtorch GPT-2 small step (examples/03_gpt2_torch: bf16
# autocast, FusedAdamW, 4 x 1024 tokens per GPU and micro-step), split in two: libtorch's
# deterministic kernels alone (--torch-deterministic, the plain mean) and with lockstep's
# fixed-point sums (--deterministic N: one micro-batch per GPU, the same windows as the plain run
# on one GPU). The three rows run alternated, REPS times each, on the first `gpus` GPUs; prints
# each "bench:" line and the median step time of each row.
#
#   bench/gpt2_deterministic.sh BUILD_DIR TEXT_DIR [gpus] [reps]
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
build=${1:?usage: bench/gpt2_deterministic.sh BUILD_DIR TEXT_DIR [gpus] [reps]}
data=${2:?usage: bench/gpt2_deterministic.sh BUILD_DIR TEXT_DIR [gpus] [reps]}
gpus=${3:-1}
reps=${4:-5}
CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((gpus - 1)))
export NCCL_NVLS_ENABLE=0 CUDA_VISIBLE_DEVICES
exe=$build/examples/03_gpt2_torch/gpt2_torch
common=(--data "$data" --batch 4 --seq 1024 --steps 40 --warmup 10 --bench --log-every 100000)
declare -A times
for ((i = 1; i <= reps; ++i)); do
  for row in plain torch-deterministic deterministic; do
    case $row in
      plain) extra=() ;;
      torch-deterministic) extra=(--torch-deterministic) ;;
      deterministic) extra=(--deterministic "$gpus") ;;
    esac
    line=$("$exe" "${common[@]}" "${extra[@]}" 2>&1 | grep -E "^bench:|rror" | head -1)
    echo "$row $i: $line"
    ms=$(sed -n 's/.*step_ms=\([0-9.]*\).*/\1/p' <<<"$line")
    [[ -n $ms ]] && times[$row]+="$ms "
  done
done
for row in plain torch-deterministic deterministic; do
  median=$(tr ' ' '\n' <<<"${times[$row]:-}" | grep . | sort -g | awk '{a[NR]=$1} END {if (NR) print (NR % 2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}')
  echo "median $row: ${median:-none} ms (${times[$row]:-no runs})"
done
