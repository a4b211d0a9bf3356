#!/usr/bin/env bash
# ResNet-50 (torchvision's architecture; bf16 autocast, channels_last, 64 synthetic images of
# 224 x 224 per GPU, SGD with momentum 0.9 and weight decay 1e-4) at 1, 2 and 4 GPUs, in one call
# on one machine: lockstep + libtorch (bench/resnet50_torch.cpp) with one thread per GPU
# (DataParallel) and one process per GPU (lockstep-run), against PyTorch DDP in Python with its
# best settings (bench/resnet50_ddp.py, under torchrun) and PyTorch on one GPU. For each count n:
# n = 1: lockstep (threads) and PyTorch on one GPU; n > 1: lockstep processes, lockstep threads,
# each VARIANTS flag set as one more lockstep processes row, and DDP. Prints each run's
# "bench:" line (median step time after the warm-up, images/s, parameters, peak allocated,
# reserved and used device memory, first and last loss), its start line, or its error.
#
#   bench/resnet50_torch.sh BUILD_DIR [steps] [gpu counts]
#   VARIANTS="--broadcast-buffers off;--bucket-cap-mb 50": extra lockstep processes rows (n > 1),
#     flag sets separated by ';' (resnet50_torch names its DataParallelOptions flags in the label)
#   BATCH (64), IMAGE (224), WARMUP (10): images per GPU and step, image size, warm-up steps
set -uo pipefail
cd "$(dirname "$0")/.."
build=${1:?usage: bench/resnet50_torch.sh BUILD_DIR [steps] [gpu counts]}
steps=${2:-40}
counts=${3:-1 2 4}
warmup=${WARMUP:-10}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
exe=$build/bench/resnet50_torch
launcher=$build/tools/lockstep-run
common=(--batch "${BATCH:-64}" --image "${IMAGE:-224}" --steps "$steps" --warmup "$warmup")
variants=()
IFS=';' read -r -a variants <<< "${VARIANTS:-}"
if [[ ! -x $exe ]]; then
  echo "resnet50_torch: error: $exe not built (it needs libtorch: configure with a CUDA build of libtorch for GPUs)"
  exit 1
fi

# row NAME COMMAND...: runs it; prints its start line, "bench" lines and errors (rank 0's
# "[0] " prefix under lockstep-run removed), or NAME and its exit status when it failed.
row() {
  local name=$1
  shift
  "$@" 2>&1 | grep -E "bench|rror|not found|No such file|^(\[0\] )?resnet50_(torch|ddp): " | sed "s/^\[0\] //"
  local rc=${PIPESTATUS[0]}
  [[ $rc -eq 0 ]] || echo "$name: error: exit status $rc"
}

for n in $counts; do
  devices=$(seq -s, 0 $((n - 1)))
  echo "== $n GPU(s)"
  if [[ $n -gt 1 ]]; then
    row lockstep-processes env CUDA_VISIBLE_DEVICES="$devices" "$launcher" --nproc "$n" "$exe" "${common[@]}" --bench
    row lockstep-threads env CUDA_VISIBLE_DEVICES="$devices" "$exe" "${common[@]}" --bench
    for v in "${variants[@]}"; do
      read -r -a flags <<< "$v"
      [[ ${#flags[@]} -gt 0 ]] || continue
      echo "-- variant: $v"
      row "lockstep-processes $v" env CUDA_VISIBLE_DEVICES="$devices" "$launcher" --nproc "$n" "$exe" "${common[@]}" --bench "${flags[@]}"
    done
    row ddp env CUDA_VISIBLE_DEVICES="$devices" torchrun --standalone --nproc-per-node "$n" bench/resnet50_ddp.py "${common[@]}"
  else
    row lockstep-threads env CUDA_VISIBLE_DEVICES="$devices" "$exe" "${common[@]}" --bench
    row pytorch-1gpu env CUDA_VISIBLE_DEVICES="$devices" python3 bench/resnet50_ddp.py "${common[@]}"
  fi
done
