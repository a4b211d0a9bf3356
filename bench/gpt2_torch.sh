#!/usr/bin/env bash
# GPT-2 small (bf16 autocast, 8 x 1024 tokens per GPU, AdamW) at 1, 2 and 4 GPUs, in one call
# on one machine: lockstep + libtorch (examples/03_gpt2_torch) with one thread per GPU
# (DataParallel) and one process per GPU (Distributed, lockstep-run; also with --shard:
# ShardedOptimizer, the all-gather waited for block by block in the forward), against PyTorch DDP in
# Python with its best settings (bench/gpt2_ddp.py) and PyTorch on one GPU; on more than one
# GPU also libtorch's own torch::nn::parallel::data_parallel (bench/gpt2_data_parallel.cpp, the
# same model and data; it clones the model every step). Prints the "bench:" line of each run
# (median step time after warm-up, tokens/s, peak memory), or its error.
#
#   bench/gpt2_torch.sh BUILD_DIR TEXT_DIR [steps] [gpu counts]
#   DP_STEPS=N: steps of the data_parallel row (default: steps; more than the warm-up's 10; 0: no such row)
set -uo pipefail
cd "$(dirname "$0")/.."
build=${1:?usage: bench/gpt2_torch.sh BUILD_DIR TEXT_DIR [steps] [gpu counts]}
data=${2:?usage: bench/gpt2_torch.sh BUILD_DIR TEXT_DIR [steps] [gpu counts]}
steps=${3:-30}
counts=${4:-1 2 4}
warmup=10
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
exe=$build/examples/03_gpt2_torch/gpt2_torch
dp=$build/bench/gpt2_data_parallel
dp_steps=${DP_STEPS:-$steps}
common=(--data "$data" --batch 8 --seq 1024 --steps "$steps" --warmup "$warmup")
for n in $counts; do
  devices=$(seq -s, 0 $((n - 1)))
  echo "== $n GPU(s)"
  CUDA_VISIBLE_DEVICES=$devices "$exe" "${common[@]}" --bench --log-every 100000 2>&1 | grep -E "^bench:|rror" | sed "s/^bench: lockstep/bench: lockstep-threads/"
  if [[ $n -gt 1 ]]; then
    for shard in "" --shard; do
      CUDA_VISIBLE_DEVICES=$devices "$build/tools/lockstep-run" --nproc "$n" "$exe" "${common[@]}" --bench --log-every 100000 $shard 2>&1 \
        | grep -E "bench:|rror" | sed "s/^\[0\] //; s/^bench: lockstep/bench: lockstep-processes/"
    done
    CUDA_VISIBLE_DEVICES=$devices torchrun --standalone --nproc-per-node "$n" bench/gpt2_ddp.py "${common[@]}" 2>&1 | grep -E "^bench:|rror"
    if [[ $dp_steps -eq 0 ]]; then
      :
    elif [[ -x $dp ]]; then
      CUDA_VISIBLE_DEVICES=$devices "$dp" "${common[@]}" --steps "$dp_steps" 2>&1 | grep -E "^bench:|rror|skipped|: replicate"
      rc=${PIPESTATUS[0]}
      [[ $rc -eq 0 ]] || echo "libtorch-data_parallel: error: exit status $rc"
    else
      echo "libtorch-data_parallel: error: $dp not built (it needs libtorch with CUDA)"
    fi
  else
    CUDA_VISIBLE_DEVICES=$devices python3 bench/gpt2_ddp.py "${common[@]}" 2>&1 | grep -E "^bench:|rror" | sed "s/^bench: ddp/bench: pytorch-1gpu/"
  fi
done
