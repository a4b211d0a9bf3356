#!/usr/bin/env bash
# Failure test of example 02 (ctest example_02_distributed_kill, label mpi): a rank lost
# mid-training ends the job, and the last checkpoint resumes it.
#
#   kill_test.sh WORK EXE MPIEXEC NUMPROC_FLAG [LAUNCHER_FLAGS...]
#   e.g. kill_test.sh /tmp/kt ./distributed_fashion_mnist mpirun -np --allow-run-as-root --oversubscribe
#
# 1. straight: 3 ranks, E epochs, uninterrupted → the reference parameter checksum.
# 2. kill:     the same with --checkpoint; once the first checkpoint exists, kill -9 rank 1.
#              mpirun must exit non-zero within LOCKSTEP_TIMEOUT + a margin, and its output
#              (Open MPI's or lockstep's) must name rank 1.
# 3. resume:   --resume from that checkpoint finishes the remaining epochs, every rank ends
#              with the same parameters, and they equal the straight run's (bit for bit).
# 4. stop:     the same start, then SIGSTOP rank 1: nothing tells mpirun, so only the other
#              ranks' MpiComm timeouts can end the job: it must end non-zero within
#              LOCKSTEP_TIMEOUT + LOCKSTEP_ABORT_GRACE + a margin.
# Exit 0 pass, 1 fail, 77 Fashion-MNIST not installed (ctest SKIP_RETURN_CODE).
set -u
if [ $# -lt 4 ]; then
  echo "usage: kill_test.sh WORK EXE MPIEXEC NUMPROC_FLAG [LAUNCHER_FLAGS...]" >&2
  exit 1
fi
work=$1 exe=$2
shift 2
mpiexec=$1 npflag=$2
shift 2
launcher_flags=("$@")

data=/usr/share/datasets/fashion-mnist
for f in train-images-idx3-ubyte.gz train-labels-idx1-ubyte.gz t10k-images-idx3-ubyte.gz t10k-labels-idx1-ubyte.gz; do
  if [ ! -r "$data/$f" ]; then
    echo "SKIPPED: $data/$f is missing (Debian package dataset-fashion-mnist)"
    exit 77
  fi
done

timeout_s=${KILL_TEST_TIMEOUT:-20}      # LOCKSTEP_TIMEOUT of the kill run
stop_timeout_s=${KILL_TEST_STOP_TIMEOUT:-8}  # LOCKSTEP_TIMEOUT of the stop run (it always waits it out)
grace_s=1                               # LOCKSTEP_ABORT_GRACE
margin_s=10                             # start-up, MPI_Abort and a busy machine
np=3
epochs=3
# ~1 s per epoch on 2 shared cores; small enough that the whole test stays under a minute.
args=(--data "$data" --limit-train 24000 --limit-test 1000 --epochs "$epochs" --progress 0)
export LOCKSTEP_ABORT_GRACE=$grace_s

rm -rf "$work" && mkdir -p "$work" || exit 1
mpirun_cmd=("$mpiexec" "$npflag" "$np" "${launcher_flags[@]}" "$exe")

mpid=  # the mpirun in flight, ended on any exit
stopped_pid=
cleanup() {
  [ -n "$stopped_pid" ] && kill -CONT "$stopped_pid" 2>/dev/null
  if [ -n "$mpid" ] && kill -0 "$mpid" 2>/dev/null; then
    kill -TERM "$mpid" 2>/dev/null
    sleep 1
    kill -KILL "$mpid" 2>/dev/null
  fi
}
trap cleanup EXIT

fail() {
  echo "FAIL: $*" >&2
  exit 1
}
now() { echo "$EPOCHREALTIME"; }
elapsed() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2f", b - a }'; }
less_than() { awk -v a="$1" -v b="$2" 'BEGIN { exit !(a < b) }'; }

# The final checksum of a run's output, if every rank agreed on it.
final_checksum() {
  sed -n 's/^final: .*parameters fnv1a \(0x[0-9a-f]*\) (identical on all ranks)$/\1/p' "$1"
}

# The process of rank $2 among the descendants of $1 (Open MPI sets OMPI_COMM_WORLD_RANK
# in each rank's environment; mpirun starts local ranks as its children).
rank_pid() {
  local todo=("$1") p c
  while [ ${#todo[@]} -gt 0 ]; do
    p=${todo[0]}
    todo=("${todo[@]:1}")
    for c in $(pgrep -P "$p"); do
      if tr '\0' '\n' <"/proc/$c/environ" 2>/dev/null | grep -qx "OMPI_COMM_WORLD_RANK=$2"; then
        echo "$c"
        return 0
      fi
      todo+=("$c")
    done
  done
  return 1
}

# Starts mpirun in the background (log $1, LOCKSTEP_TIMEOUT $2, then the program's options)
# and waits until the checkpoint file $3 exists; sets mpid and victim (rank 1's pid).
start_and_wait_for_checkpoint() {
  local log=$1 t=$2 ck=$3
  shift 3
  LOCKSTEP_TIMEOUT=$t "${mpirun_cmd[@]}" "${args[@]}" "$@" >"$log" 2>&1 &
  mpid=$!
  local deadline=$((SECONDS + 60))
  while [ ! -e "$ck" ]; do
    kill -0 "$mpid" 2>/dev/null || fail "mpirun ended before the first checkpoint:$(echo; cat "$log")"
    [ $SECONDS -lt $deadline ] || fail "no checkpoint $ck after 60 s:$(echo; cat "$log")"
    sleep 0.02
  done
  victim=$(rank_pid "$mpid" 1) || fail "cannot find the process of rank 1 under mpirun (pid $mpid)"
}

# --- 1. straight -------------------------------------------------------------------------
LOCKSTEP_TIMEOUT=$timeout_s "${mpirun_cmd[@]}" "${args[@]}" >"$work/straight.log" 2>&1
rc=$?
[ $rc -eq 77 ] && { echo "SKIPPED: the data set could not be read"; cat "$work/straight.log"; exit 77; }
[ $rc -eq 0 ] || fail "the uninterrupted run exited $rc:$(echo; cat "$work/straight.log")"
straight=$(final_checksum "$work/straight.log")
[ -n "$straight" ] || fail "the uninterrupted run has no agreeing final line:$(echo; cat "$work/straight.log")"
echo "straight: $epochs epochs on $np ranks, parameters $straight"

# --- 2. kill -9 rank 1 after the first checkpoint -----------------------------------------
start_and_wait_for_checkpoint "$work/kill.log" "$timeout_s" "$work/ck" --checkpoint "$work/ck"
t0=$(now)
kill -KILL "$victim"
wait "$mpid"
rc=$?
t1=$(now)
mpid=
kill_s=$(elapsed "$t0" "$t1")
echo "--- output of the killed run:"
cat "$work/kill.log"
echo "---"
echo "kill -9 of rank 1 (pid $victim) -> mpirun exited $rc after $kill_s s (LOCKSTEP_TIMEOUT=$timeout_s)"
[ $rc -ne 0 ] || fail "mpirun exited 0 after a rank was killed"
less_than "$kill_s" "$((timeout_s + margin_s))" || fail "mpirun took $kill_s s to end (limit $((timeout_s + margin_s)) s)"
# Open MPI 4: "mpirun noticed that process rank 1 with PID N on node H exited on signal 9
# (Killed)." (the text may be wrapped); lockstep: "lockstep: rank r failed: ... rank 1 ...".
flat=$(tr '\n' ' ' <"$work/kill.log" | tr -s ' ')
if [[ $flat =~ process\ rank\ 1\ with\ PID\ [0-9]+\ .*signal\ 9 ]]; then
  echo "named: ${BASH_REMATCH[0]:0:120}"
elif [[ $flat =~ lockstep:\ rank\ [0-9]+\ failed:[^\"]*rank\ 1[^0-9] ]]; then
  echo "named by lockstep: ${BASH_REMATCH[0]:0:200}"
else
  fail "no message names the lost rank 1"
fi
grep -q "^epoch $epochs/$epochs" "$work/kill.log" && fail "the killed run finished all epochs; the kill came too late"
ls "$work"/ck.tmp-* >/dev/null 2>&1 && echo "note: a temporary checkpoint file was left: $(ls "$work"/ck.tmp-*)"

# --- 3. resume from the last checkpoint ----------------------------------------------------
cp "$work/ck" "$work/ck.killed"
LOCKSTEP_TIMEOUT=$timeout_s "${mpirun_cmd[@]}" "${args[@]}" --resume "$work/ck.killed" >"$work/resume.log" 2>&1
rc=$?
echo "--- output of the resumed run:"
cat "$work/resume.log"
echo "---"
[ $rc -eq 0 ] || fail "the resumed run exited $rc"
done_epochs=$(sed -n 's/^resumed from .*: \([0-9]*\) epochs\{0,1\} done.*/\1/p' "$work/resume.log")
[ -n "$done_epochs" ] || fail "the resumed run did not load the checkpoint"
[ "$done_epochs" -ge 1 ] && [ "$done_epochs" -lt "$epochs" ] || fail "the checkpoint says $done_epochs epochs done"
grep -q "^epoch $done_epochs/$epochs" "$work/resume.log" && fail "the resumed run repeated epoch $done_epochs"
grep -q "^epoch $epochs/$epochs" "$work/resume.log" || fail "the resumed run did not reach epoch $epochs"
grep -qi "warning" "$work/resume.log" && fail "the resumed run warned"
resumed=$(final_checksum "$work/resume.log")
[ -n "$resumed" ] || fail "the resumed run has no agreeing final line"
[ "$resumed" = "$straight" ] || fail "resumed parameters $resumed != uninterrupted $straight"
echo "resume: checkpoint after $done_epochs epoch(s) loaded; epochs $((done_epochs + 1))-$epochs end on $resumed = the uninterrupted run"

# --- 4. SIGSTOP rank 1: only the survivors' timeouts end the job --------------------------
start_and_wait_for_checkpoint "$work/stop.log" "$stop_timeout_s" "$work/ck2" --checkpoint "$work/ck2"
t0=$(now)
kill -STOP "$victim" && stopped_pid=$victim
wait "$mpid"
rc=$?
t1=$(now)
mpid=
# A process that is gone, or a zombie nobody reaps (no init in a container), counts as ended.
victim_state() { awk '{ print $3 }' "/proc/$victim/stat" 2>/dev/null || echo gone; }
state_at_exit=$(victim_state)
kill -CONT "$victim" 2>/dev/null
stopped_pid=
stop_s=$(elapsed "$t0" "$t1")
echo "--- output of the stopped run:"
cat "$work/stop.log"
echo "---"
limit=$((stop_timeout_s + grace_s + margin_s))
echo "SIGSTOP of rank 1 (pid $victim) -> mpirun exited $rc after $stop_s s (LOCKSTEP_TIMEOUT=$stop_timeout_s, LOCKSTEP_ABORT_GRACE=$grace_s)"
[ $rc -ne 0 ] || fail "mpirun exited 0 with a stopped rank"
less_than "$stop_s" "$limit" || fail "mpirun took $stop_s s to end (limit $limit s)"
grep -q "LOCKSTEP_TIMEOUT" "$work/stop.log" || fail "no rank reported the timeout"
echo "rank 1 when mpirun exited: $state_at_exit (T: still stopped, Z: dead, gone: reaped)"
sleep 0.5
case $(victim_state) in Z|gone) ;; *) fail "the stopped rank 1 (pid $victim) outlived mpirun and SIGCONT" ;; esac

echo "PASS: kill -> exit $kill_s s, stop -> exit $stop_s s, resume == uninterrupted ($straight)"
exit 0
