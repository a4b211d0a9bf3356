#!/usr/bin/env bash
# Failure test of example 02's GPU path (ctest example_02_distributed_gpu_kill, label
# multigpu): one process per GPU, started BY HAND (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
# MASTER_PORT, LOCKSTEP_JOB_TOKEN), so no launcher stops the survivors: lockstep's watchdog
# must. NP = min(3, GPUs) processes.
#
#   gpu_kill_test.sh WORK EXE LOCKSTEP_RUN
#
# 1. straight: NP ranks under lockstep-run, E epochs, uninterrupted → reference checksum.
# 2. kill:     the same started by hand with --checkpoint; once the first checkpoint exists,
#              kill -9 rank 1. Every survivor must exit non-zero within 5 s, saying
#              "rank 1 left". The time each took is printed.
# 3. resume:   lockstep-run --resume from that checkpoint ends on the straight run's parameters.
# 4. stop:     started by hand again, then SIGSTOP rank 1: every survivor must exit non-zero
#              within LOCKSTEP_TIMEOUT + 5 s, saying "rank 1 stopped responding".
# 5. rank 0:   kill -9 rank 0 (it hosts the store): the others exit non-zero within 5 s, saying
#              "rank 0 left".
# 6. graph:    as 2, with every full step replayed as one CUDA graph (--input device
#              --cuda-graph): rank 1 dies during replays; the survivors exit within 5 s, saying
#              "rank 1 left".
# 7. symmetric: as 2 with --symmetric (the buckets in lockstep's peer kernel, which an abort
#              ends): the survivors exit within 5 s, saying "rank 1 left".
# 8. symmetric, NCCL: as 7 with the peer kernel off (NCCL's symmetric kernels, which an abort
#              does not end): within 10 s (the watchdog's 5 s grace), saying "rank 1 left".
# KILL_TEST_PHASES="6 7" runs only those phases (3 needs 1 and 2). A survivor that outlives its
# limit has its threads' stacks printed (gdb, where installed; else each thread's kernel wait
# and system call) before the test fails.
# Exit 0 pass, 1 fail, 77 skip (fewer than 2 GPUs, or Fashion-MNIST not installed).
set -u
if [ $# -lt 3 ]; then
  echo "usage: gpu_kill_test.sh WORK EXE LOCKSTEP_RUN" >&2
  exit 1
fi
work=$1 exe=$2 lr=$3

data=/usr/share/datasets/fashion-mnist
for f in train-images-idx3-ubyte.gz train-labels-idx1-ubyte.gz t10k-images-idx3-ubyte.gz t10k-labels-idx1-ubyte.gz; do
  [ -r "$data/$f" ] || { echo "SKIPPED: $data/$f is missing (Debian package dataset-fashion-mnist)"; exit 77; }
done
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
[ "$gpus" -ge 2 ] || { echo "[lockstep-skip] needs 2 GPUs, found $gpus"; exit 77; }
np=$(( gpus < 3 ? gpus : 3 ))

timeout_s=30           # LOCKSTEP_TIMEOUT of the straight, kill and resume runs
stop_timeout_s=8       # LOCKSTEP_TIMEOUT of the stop run (it always waits it out)
kill_limit_s=5         # survivors of a kill -9 must be gone by then
epochs=8
args=(--data "$data" --epochs "$epochs" --progress 0)
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}

rm -rf "$work" && mkdir -p "$work" || exit 1
pids=()
stopped=
cleanup() {
  [ -n "$stopped" ] && kill -CONT "$stopped" 2>/dev/null
  for p in "${pids[@]}"; do kill -KILL "$p" 2>/dev/null; done
}
trap cleanup EXIT
fail() {
  echo "FAIL: $*" >&2
  for f in "$work"/*.log; do [ -f "$f" ] && { echo "--- $f"; tail -n 15 "$f"; }; done >&2
  exit 1
}
phases=" ${KILL_TEST_PHASES:-1 2 3 4 5 6 7 8} "
want() { [[ $phases == *" $1 "* ]]; }
stacks() {  # where a process that should have ended is: gdb's stacks, else each thread's wait
  if command -v gdb >/dev/null; then
    timeout 60 gdb -p "$1" -batch -ex "thread apply all bt 15" 2>/dev/null | grep -E "^(Thread|#)" | head -120
    return
  fi
  local t
  for t in /proc/"$1"/task/*; do
    echo "  thread $(basename "$t") $(cat "$t/comm" 2>/dev/null): waits in $(cat "$t/wchan" 2>/dev/null)," \
      "syscall $(cut -d' ' -f1 "$t/syscall" 2>/dev/null)"
  done
}
now() { echo "$EPOCHREALTIME"; }
elapsed() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2f", b - a }'; }
less_than() { awk -v a="$1" -v b="$2" 'BEGIN { exit !(a < b) }'; }
final_checksum() { sed -n 's/^\(\[0\] \)\{0,1\}final: .*parameters fnv1a \(0x[0-9a-f]*\) (identical on all ranks)$/\2/p' "$1"; }
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])' 2>/dev/null || echo $((20000 + RANDOM % 20000)); }

# Starts NP ranks by hand (logs $1.R.log, LOCKSTEP_TIMEOUT $2, then options); sets pids.
start_by_hand() {
  local name=$1 t=$2
  shift 2
  local port token r
  port=$(free_port)
  token="kill-test-$RANDOM$RANDOM"
  pids=()
  for ((r = 0; r < np; r++)); do
    RANK=$r WORLD_SIZE=$np LOCAL_RANK=$r LOCAL_WORLD_SIZE=$np MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
      LOCKSTEP_JOB_TOKEN=$token LOCKSTEP_TIMEOUT=$t "$exe" "${args[@]}" "$@" >"$work/$name.$r.log" 2>&1 &
    pids+=($!)
  done
}
wait_for_file() {
  local deadline=$((SECONDS + 120))
  while [ ! -e "$1" ]; do
    for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null || fail "a rank ended before $1 existed"; done
    [ $SECONDS -lt $deadline ] || fail "no $1 after 120 s"
    sleep 0.01
  done
}
# Waits for every rank but $1 (at most $2 s); checks each exited non-zero within $2 s of T0
# and that its output contains $3. Prints the times.
check_survivors() {
  local victim=$1 limit=$2 expect=$3 r p rc t
  for ((r = 0; r < np; r++)); do
    [ "$r" -eq "$victim" ] && continue
    p=${pids[$r]}
    while kill -0 "$p" 2>/dev/null; do
      less_than "$(elapsed "$T0" "$(now)")" "$((limit + 20))" || { stacks "$p" >&2; fail "rank $r still runs $((limit + 20)) s after the failure"; }
      sleep 0.01
    done
    t=$(elapsed "$T0" "$(now)")
    wait "$p"
    rc=$?
    echo "  rank $r exited $rc after $t s: $(grep -m1 -o "lockstep: rank $r stops: .\{0,110\}" "$work/$NAME.$r.log")"
    [ "$rc" -ne 0 ] || fail "rank $r exited 0 after rank $victim was lost"
    less_than "$t" "$limit" || fail "rank $r took $t s to exit (limit $limit s)"
    grep -q "$expect" "$work/$NAME.$r.log" || fail "rank $r's output does not say '$expect'"
  done
}

# Starts a run by hand (name $1, options $4...) with --checkpoint, and once the first checkpoint
# exists sends signal $2 to rank $3; sets T0 (the signal's time) and NAME (the logs' prefix).
start_and_signal() {
  local name=$1 sig=$2 victim=$3
  NAME=$name
  start_by_hand "$name" "${RUN_TIMEOUT:-$timeout_s}" --checkpoint "$work/$name.ck" "${@:4}"
  wait_for_file "$work/$name.ck"
  T0=$(now)
  kill "-$sig" "${pids[$victim]}"
}

# kill -9 of rank $2 in a run named $1 (options $5...): every survivor must exit within $3 s
# saying "rank $2 left"; $4 says what the phase is.
kill_and_check() {
  local name=$1 victim=$2 limit=$3 what=$4
  start_and_signal "$name" KILL "$victim" "${@:5}"
  wait "${pids[$victim]}" 2>/dev/null
  echo "kill -9 of rank $victim$what (pid ${pids[$victim]}):"
  check_survivors "$victim" "$limit" "rank $victim left"
}

# --- 1. straight ---------------------------------------------------------------------------
if want 1 || want 3; then
  LOCKSTEP_TIMEOUT=$timeout_s "$lr" --nproc "$np" "$exe" "${args[@]}" >"$work/straight.log" 2>&1
  rc=$?
  [ $rc -eq 77 ] && { echo "SKIPPED:"; cat "$work/straight.log"; exit 77; }
  [ $rc -eq 0 ] || fail "the uninterrupted run exited $rc"
  straight=$(final_checksum "$work/straight.log")
  [ -n "$straight" ] || fail "the uninterrupted run has no agreeing final line"
  echo "straight: $epochs epochs on $np GPU processes, parameters $straight"
fi

# --- 2. kill -9 rank 1 after the first checkpoint ------------------------------------------
if want 2 || want 3; then
  kill_and_check kill 1 "$kill_limit_s" ""
  grep -q "epoch $epochs/$epochs" "$work/kill.0.log" && fail "the killed run finished all epochs; the kill came too late"
  pids=()
fi

# --- 3. resume from the last checkpoint ------------------------------------------------------
if want 3; then
  cp "$work/kill.ck" "$work/ck.killed"
  LOCKSTEP_TIMEOUT=$timeout_s "$lr" --nproc "$np" "$exe" "${args[@]}" --resume "$work/ck.killed" >"$work/resume.log" 2>&1
  rc=$?
  [ $rc -eq 0 ] || fail "the resumed run exited $rc"
  done_epochs=$(sed -n 's/^\(\[0\] \)\{0,1\}resumed from .*: \([0-9]*\) epochs\{0,1\} done.*/\2/p' "$work/resume.log")
  [ -n "$done_epochs" ] || fail "the resumed run did not load the checkpoint"
  resumed=$(final_checksum "$work/resume.log")
  [ "$resumed" = "$straight" ] || fail "resumed parameters '$resumed' != uninterrupted $straight"
  echo "resume: checkpoint after $done_epochs epoch(s); epochs $((done_epochs + 1))-$epochs end on $resumed = the uninterrupted run"
fi

# --- 4. SIGSTOP rank 1 ----------------------------------------------------------------------
if want 4; then
  RUN_TIMEOUT=$stop_timeout_s start_and_signal stop STOP 1
  stopped=${pids[1]}
  echo "SIGSTOP of rank 1 (LOCKSTEP_TIMEOUT=$stop_timeout_s):"
  check_survivors 1 "$((stop_timeout_s + 5))" "rank 1 stopped responding"
  kill -KILL "$stopped"; kill -CONT "$stopped" 2>/dev/null; wait "$stopped" 2>/dev/null; stopped=
  pids=()
fi

# --- 5. kill -9 rank 0, the store's host ------------------------------------------------------
if want 5; then
  kill_and_check kill0 0 "$kill_limit_s" ", the store's host"
  pids=()
fi

# --- 6. kill -9 rank 1 while each step is a CUDA graph replay ---------------------------------
if want 6; then
  kill_and_check kill_graph 1 "$kill_limit_s" " during CUDA graph replays" --input device --cuda-graph
  pids=()
fi

# --- 7. kill -9 rank 1 with the buckets in lockstep's peer kernel -----------------------------
if want 7; then
  # Its waits poll the abort word: the survivors stop as in 2.
  kill_and_check kill_symmetric 1 "$kill_limit_s" " with --symmetric" --symmetric
  pids=()
fi

# --- 8. kill -9 rank 1 with the buckets in NCCL's symmetric kernels ---------------------------
if want 8; then
  # An aborted communicator does not end those kernels: the survivors stop when the watchdog's
  # grace period (5 s) ends their processes, still naming rank 1.
  LOCKSTEP_PEER_ALL_REDUCE_MIB=0 kill_and_check kill_symmetric_nccl 1 "$((kill_limit_s + 5))" \
    " with --symmetric, NCCL's kernels" --symmetric
  pids=()
fi

echo "PASS: phases$phases(kill -9 / SIGSTOP / kill -9 of rank 0 / kill -9 during graph replays / with symmetric" \
  "kernels: lockstep's, NCCL's) all ended the job; resume == uninterrupted (${straight:-not run})"
exit 0
