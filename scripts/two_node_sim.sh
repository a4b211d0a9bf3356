#!/usr/bin/env bash
# A simulated two-node run on one 4-GPU machine: 4 processes under lockstep-run, GPUs 0-1 as
# "node A" and 2-3 as "node B". NCCL_HOSTID gives each pair its own host identity, so NCCL
# keeps NVLink (P2P) inside a pair and carries all traffic between the pairs over its Socket
# network transport (NCCL_NET=Socket, loopback), as between two hosts without InfiniBand.
#
#   scripts/two_node_sim.sh LOCKSTEP_RUN PROGRAM [ARGS...]
#   e.g. scripts/two_node_sim.sh build/tools/lockstep-run build/bench/bench_sync --only ab --iters 5
#
# NCCL_DEBUG=INFO shows the transports: "via P2P/CUMEM" inside a pair, "via NET/Socket" across.
# GPUS_PER_NODE (default 2) and NPROC (default 4) change the layout; LOCKSTEP_RUN_FLAGS adds
# lockstep-run options (e.g. --rank0-only).
set -euo pipefail
if [ $# -lt 2 ]; then
  echo "usage: two_node_sim.sh LOCKSTEP_RUN PROGRAM [ARGS...]" >&2
  exit 2
fi
lr=$1
shift
per_node=${GPUS_PER_NODE:-2}
nproc=${NPROC:-4}
export NCCL_NVLS_ENABLE=0 NCCL_NET=Socket NCCL_IB_DISABLE=1 NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-lo}
# Each rank picks its node from its local rank (set by lockstep-run) before NCCL starts.
# shellcheck disable=SC2086  # LOCKSTEP_RUN_FLAGS is a list of words on purpose
exec "$lr" --nproc "$nproc" ${LOCKSTEP_RUN_FLAGS:-} bash -c \
  'export NCCL_HOSTID="lockstep-sim-node-$((LOCAL_RANK / '"$per_node"'))"; exec "$0" "$@"' "$@"
