#!/usr/bin/env bash
# Drives one lockstep-run test case:  run_case.sh LOCKSTEP_RUN CHILD CASE
# CHILD is tests/launcher/child.cpp (its actions are listed there). Random choices (rank counts,
# failing rank, exit code, sizes) are fresh per run; the seed is printed so a failure can be
# replayed with LAUNCHER_TEST_SEED=<seed>.
set -u
LR=$1
CHILD=$2
CASE=$3
SEED=${LAUNCHER_TEST_SEED:-$(( (RANDOM << 15) | RANDOM ))}
RANDOM=$SEED
echo "case $CASE, seed $SEED (replay: LAUNCHER_TEST_SEED=$SEED)"

WORK=$(mktemp -d)
PIDS_TO_CLEAN=()
cleanup() {
  for p in "${PIDS_TO_CLEAN[@]}"; do kill -9 "$p" 2>/dev/null; done
  rm -rf "$WORK"
}
trap cleanup EXIT

fail() {
  echo "FAIL ($CASE, seed $SEED): $*"
  for f in "$WORK"/out "$WORK"/err; do
    [[ -f $f ]] && { echo "--- ${f##*/} (first 40 lines, cut to 200 columns) ---"; head -n 40 "$f" | cut -c1-200; }
  done
  exit 1
}
now_ms() { local t=${EPOCHREALTIME//[!0-9]/}; echo $(( t / 1000 )); }
rand() { echo $(( $1 + RANDOM % ($2 - $1 + 1) )); }  # inclusive range

# Runs lockstep-run in the foreground; sets RC and MS (duration). A hang is cut off at 40 s.
run_lr() {
  local t0; t0=$(now_ms)
  timeout -k 5 40 "$LR" "$@" >"$WORK/out" 2>"$WORK/err" </dev/null
  RC=$?
  MS=$(( $(now_ms) - t0 ))
  echo "  lockstep-run $* -> exit $RC in $MS ms"
}
# Starts lockstep-run in the background (LR_PID, T0).
start_lr() {
  T0=$(now_ms)
  "$LR" "$@" >"$WORK/out" 2>"$WORK/err" </dev/null &
  LR_PID=$!
  PIDS_TO_CLEAN+=("$LR_PID")
}
# Waits for the background lockstep-run at most $1 seconds; sets RC and MS (since T0).
wait_lr() {
  local limit_ms=$(( $1 * 1000 )) t0; t0=$(now_ms)
  while kill -0 "$LR_PID" 2>/dev/null; do
    (( $(now_ms) - t0 > limit_ms )) && { kill -9 "$LR_PID"; fail "lockstep-run still running after $1 s"; }
    sleep 0.05
  done
  wait "$LR_PID"
  RC=$?
  MS=$(( $(now_ms) - T0 ))
  echo "  lockstep-run -> exit $RC after $MS ms"
}
# Waits until stdout holds $1 lines matching $2 (at most 10 s).
wait_lines() {
  local t0; t0=$(now_ms)
  until (( $(grep -c -E "$2" "$WORK/out") >= $1 )); do
    (( $(now_ms) - t0 > 10000 )) && fail "expected $1 lines matching '$2' within 10 s"
    sleep 0.05
  done
}
# The PIDs the ranks printed (child action "pid"), in rank order.
rank_pids() { sed -n -E 's/^\[([0-9]+)\] PID=([0-9]+)$/\1 \2/p' "$WORK/out" | sort -n | cut -d' ' -f2; }
pid_of_rank() { sed -n -E "s/^\\[$1\\] PID=([0-9]+)\$/\\1/p" "$WORK/out"; }
# Fails if any of the given processes still exists (a zombie counts: it was never reaped).
expect_gone() {
  local p
  for p in "$@"; do
    [[ -e /proc/$p ]] && fail "process $p is still there: $(cat /proc/$p/stat 2>/dev/null)"
  done
  return 0
}
expect_rc() { [[ $RC -eq $1 ]] || fail "exit code $RC, expected $1"; }
expect_err() { grep -q -F -- "$1" "$WORK/err" || fail "stderr lacks '$1'"; }
expect_faster() { (( MS < $1 )) || fail "took $MS ms, expected under $1 ms"; }

# Every rank sees its own rank, one world size, one port, one token; overrides win; the rest of
# the environment (NCCL_NVLS_ENABLE, a canary) passes through unchanged.
check_env() {
  local n=$1 port_expect=${2:-}
  local canary="canary-$RANDOM-$RANDOM" nvls=$(rand 0 1)
  local args=(--nproc "$n")
  (( RANDOM % 2 )) && args=(--cpu "${args[@]}")
  [[ -n $port_expect ]] && args+=(--master-port "$port_expect")
  LAUNCHER_TEST_CANARY=$canary NCCL_NVLS_ENABLE=$nvls RANK=999 WORLD_SIZE=999 MASTER_PORT=1 \
    LOCKSTEP_JOB_TOKEN=stale LOCKSTEP_LAUNCHER=other LOCKSTEP_ELASTIC_JOIN=1 run_lr "${args[@]}" "$CHILD" env
  expect_rc 0
  [[ -s $WORK/err ]] && fail "unexpected stderr"
  (( $(wc -l <"$WORK/out") == 21 * n )) || fail "expected $((21 * n)) lines"
  get() {  # sets GOT to rank $1's value of $2, which must be printed exactly once
    local v; v=$(grep -E "^\[$1\] $2=" "$WORK/out")
    [[ $(grep -c . <<<"$v") -eq 1 ]] || fail "rank $1: $2 printed $(grep -c . <<<"$v") times"
    GOT=${v#*=}
  }
  local r port0 token0
  get 0 MASTER_PORT; port0=$GOT
  get 0 LOCKSTEP_JOB_TOKEN; token0=$GOT
  [[ $port0 =~ ^[0-9]+$ ]] && (( port0 >= 1 && port0 <= 65535 )) || fail "MASTER_PORT '$port0'"
  [[ $port0 != 1 ]] || fail "MASTER_PORT from the outer environment leaked through"
  [[ -z $port_expect || $port0 == "$port_expect" ]] || fail "MASTER_PORT $port0, asked for $port_expect"
  [[ $token0 =~ ^[0-9a-f]{32}$ ]] || fail "token '$token0' is not 32 hex digits"
  for (( r = 0; r < n; ++r )); do
    local want=(RANK "$r" LOCAL_RANK "$r" LOCKSTEP_RANK "$r" LOCKSTEP_LOCAL_RANK "$r"
                WORLD_SIZE "$n" LOCAL_WORLD_SIZE "$n" LOCKSTEP_WORLD_SIZE "$n" LOCKSTEP_LOCAL_WORLD_SIZE "$n"
                MASTER_ADDR 127.0.0.1 LOCKSTEP_MASTER_ADDR 127.0.0.1 MASTER_PORT "$port0"
                LOCKSTEP_MASTER_PORT "$port0" LOCKSTEP_JOB_TOKEN "$token0" LOCKSTEP_LAUNCHER lockstep-run
                LOCKSTEP_RESTART_COUNT 0 LOCKSTEP_ELASTIC_JOIN "<unset>" NCCL_NVLS_ENABLE "$nvls"
                LAUNCHER_TEST_CANARY "$canary")
    local k
    for (( k = 0; k < ${#want[@]}; k += 2 )); do
      get "$r" "${want[k]}"
      [[ $GOT == "${want[k+1]}" ]] || fail "rank $r: ${want[k]}='$GOT', expected '${want[k+1]}'"
    done
  done
  TOKEN=$token0
}

case $CASE in
env_1 | env_2 | env_4)
  check_env "${CASE#env_}"
  first=$TOKEN
  check_env "${CASE#env_}"
  [[ $TOKEN != "$first" ]] || fail "two jobs got the same token $TOKEN"
  ;;

env_port)
  check_env "$(rand 1 3)" "$(rand 20000 60000)"
  ;;

output)
  # Heavy concurrent output: every line arrives whole, prefixed, in order, none lost; a final
  # line without '\n' is still shown.
  n=4 lines=$(rand 500 2000) bytes=$(rand 20 2000)
  run_lr --cpu --nproc $n "$CHILD" "spam=$lines:$bytes" partial=END
  expect_rc 0
  for stream in out err; do
    tag=S; [[ $stream == err ]] && tag=E
    awk -v n=$n -v lines="$lines" -v bytes="$bytes" -v tag=$tag '
      /^\[[0-9]+\] END$/ && tag == "S" { end[substr($0, 2, index($0, "]") - 2)]++; next }
      {
        if (!match($0, /^\[[0-9]+\] /)) { print "unprefixed line " NR ": " substr($0, 1, 80); bad = 1; exit }
        r = substr($0, 2, RLENGTH - 3); body = substr($0, RLENGTH + 1)
        split(body, f, ":")
        if (f[1] != tag r || f[2] != next_i[r] + 0 || length(f[3]) != bytes + 1 || substr(f[3], bytes + 1) != "#" ||
            substr(f[3], 1, 1) != sprintf("%c", 97 + (f[2] % 26))) {
          print "bad line " NR " (rank " r ", want index " next_i[r] + 0 "): " substr($0, 1, 120); bad = 1; exit
        }
        next_i[r]++
      }
      END {
        if (bad) exit 1
        for (r = 0; r < n; ++r) {
          if (next_i[r] != lines) { print "rank " r ": " next_i[r] + 0 " of " lines " lines"; exit 1 }
          if (tag == "S" && end[r] != 1) { print "rank " r ": partial last line missing"; exit 1 }
        }
      }' "$WORK/$stream" || fail "$stream is mangled"
  done
  echo "  4 ranks x $lines lines x $bytes bytes on each stream: all whole and in order"
  ;;

exit_code)
  n=4 bad=$(rand 0 3) code=$(rand 1 120)
  run_lr --cpu --nproc $n --grace 5 "$CHILD" pid "@$bad:sleep=0.3" "@$bad:exit=$code" sleep=60
  expect_rc "$code"
  expect_faster 4000
  expect_err "rank $bad exited with code $code"
  mapfile -t pids < <(rank_pids)
  (( ${#pids[@]} == n )) || fail "expected $n PIDs"
  expect_gone "${pids[@]}"
  ;;

kill_rank)
  # kill -9 from outside: the message names the signal, the others stop within the grace.
  n=3 victim=$(rand 0 2)
  start_lr --cpu --nproc $n --grace 5 "$CHILD" pid sleep=60
  wait_lines $n '^\[[0-9]+\] PID='
  mapfile -t pids < <(rank_pids)
  kill -9 "$(pid_of_rank "$victim")"
  T0=$(now_ms)
  wait_lr 20
  expect_rc 137
  expect_faster 4000
  expect_err "rank $victim was killed by signal 9 (SIGKILL)"
  expect_gone "${pids[@]}"
  ;;

ignore_term)
  # Ranks that ignore SIGTERM are SIGKILLed once --grace has passed, not before.
  n=3 bad=$(rand 0 2)
  run_lr --cpu --nproc $n --grace 1 "$CHILD" pid ignore=15 "@$bad:sleep=0.3" "@$bad:exit=1" sleep=60
  expect_rc 1
  expect_err "rank $bad exited with code 1"
  expect_err "sending SIGKILL"
  (( MS >= 1250 )) || fail "took $MS ms: SIGKILL came before the 1 s grace"
  expect_faster 5000
  mapfile -t pids < <(rank_pids)
  expect_gone "${pids[@]}"
  ;;

sigint | sigterm)
  # A signal to lockstep-run reaches every rank (each prints CAUGHT and exits 0); lockstep-run
  # still exits non-zero (128 + signal). Started as a background job, where the shell leaves
  # SIGINT ignored: lockstep-run must handle it anyway.
  sig=INT num=2
  [[ $CASE == sigterm ]] && sig=TERM num=15
  n=$(rand 2 4)
  start_lr --cpu --nproc "$n" --grace 5 "$CHILD" pid trap out=READY sleep=60
  wait_lines "$n" '^\[[0-9]+\] READY$'
  mapfile -t pids < <(rank_pids)
  kill -$sig "$LR_PID"
  T0=$(now_ms)
  wait_lr 20
  expect_rc $((128 + num))
  expect_faster 3000
  expect_err "received SIG$sig"
  for (( r = 0; r < n; ++r )); do
    grep -q -x "\[$r\] CAUGHT $r $num" "$WORK/out" || fail "rank $r did not see SIG$sig"
  done
  expect_gone "${pids[@]}"
  ;;

rank0_only)
  n=3 word=w$RANDOM$RANDOM
  args=()
  for (( r = 0; r < n; ++r )); do args+=("@$r:out=o$r-$word" "@$r:err=e$r-$word"); done
  run_lr --cpu --nproc $n --rank0-only "$CHILD" "${args[@]}"
  expect_rc 0
  grep -q -x "\[0\] o0-$word" "$WORK/out" || fail "rank 0's stdout missing"
  grep -q -x "\[0\] e0-$word" "$WORK/err" || fail "rank 0's stderr missing"
  grep -q -E '^\[[12]\]' "$WORK/out" "$WORK/err" && fail "other ranks' output shown"
  # A failing rank's stderr is shown when it fails; its stdout is not.
  bad=$(rand 1 2) code=$(rand 1 100)
  run_lr --cpu --nproc $n --rank0-only --grace 5 "$CHILD" "${args[@]}" "@$bad:err=last-$word" "@$bad:exit=$code" sleep=60
  expect_rc "$code"
  expect_faster 4000
  expect_err "rank $bad exited with code $code"
  grep -q -x "\[$bad\] e$bad-$word" "$WORK/err" || fail "failing rank's stderr not shown"
  grep -q -x "\[$bad\] last-$word" "$WORK/err" || fail "failing rank's last stderr line not shown"
  grep -q -E '^\[[12]\]' "$WORK/out" && fail "other ranks' stdout shown"
  other=$(( 3 - bad ))
  grep -q -E "^\[$other\]" "$WORK/err" && fail "a rank that did not fail had its stderr shown"
  ;;

args)
  expect_usage() {  # exit 2, a message naming what is wrong, no rank started
    local want=$1; shift
    run_lr "$@"
    expect_rc 2
    expect_err "$want"
    [[ -s $WORK/out ]] && fail "something ran"
    return 0
  }
  expect_usage "no program given"
  expect_usage "no program given" --nproc 2
  expect_usage "--nproc wants" --nproc 0 "$CHILD"
  expect_usage "--nproc wants" --nproc abc "$CHILD"
  expect_usage "--nproc wants" --nproc=-3 "$CHILD"
  expect_usage "needs a value" --nproc
  expect_usage "unknown option '--bogus'" --bogus "$CHILD"
  expect_usage "--grace wants" --grace -1 --nproc 1 "$CHILD"
  expect_usage "--timeout wants" --timeout 0 --nproc 1 "$CHILD"
  expect_usage "--master-port wants" --master-port 70000 --nproc 1 "$CHILD"
  # No GPU visible and neither --nproc nor --cpu: say what to pass.
  CUDA_VISIBLE_DEVICES= expect_usage "pass --nproc N, or --cpu" "$CHILD" out=x
  run_lr --help
  expect_rc 0
  grep -q "usage: lockstep-run" "$WORK/out" || fail "--help prints no usage"
  run_lr --nproc 1 "$WORK/no-such-program-$RANDOM"
  expect_rc 127
  expect_err "cannot find an executable program"
  # Options end at the program: its own arguments may look like ours.
  run_lr --nproc 1 "$CHILD" out=--nproc
  expect_rc 0
  grep -q -x "\[0\] --nproc" "$WORK/out" || fail "program arguments were parsed as options"
  # --cpu without --nproc: one rank per usable CPU.
  run_lr --cpu "$CHILD" env
  expect_rc 0
  (( $(grep -c -E '^\[[0-9]+\] RANK=' "$WORK/out") == $(nproc) )) || fail "--cpu did not start $(nproc) ranks"
  ;;

timeout)
  run_lr --cpu --nproc 2 --timeout 1 --grace 1 "$CHILD" pid sleep=60
  expect_rc 124
  expect_err "timeout"
  (( MS >= 900 )) || fail "stopped after $MS ms, before the 1 s timeout"
  expect_faster 4000
  mapfile -t pids < <(rank_pids)
  expect_gone "${pids[@]}"
  ;;

closed_output)
  # A rank that closes its output but keeps running is waited for (by process, not EOF) ...
  run_lr --cpu --nproc 2 "$CHILD" out=before closeio sleep=1.5
  expect_rc 0
  (( MS >= 1400 )) || fail "returned after $MS ms, before the ranks exited"
  expect_faster 5000
  grep -q -x "\[1\] before" "$WORK/out" || fail "output before closing was lost"
  # ... and a helper process still holding a finished rank's pipes does not keep it waiting.
  run_lr --cpu --nproc 2 "$CHILD" helper=30 out=done
  mapfile -t helpers < <(sed -n -E 's/^\[[0-9]+\] HELPER=([0-9]+)$/\1/p' "$WORK/out")
  PIDS_TO_CLEAN+=("${helpers[@]}")
  expect_rc 0
  expect_faster 3000
  (( $(grep -c -x -E '\[[01]\] done' "$WORK/out") == 2 )) || fail "output lost"
  ;;

no_zombie)
  # A rank that exits early is reaped at once, while the others run on.
  start_lr --cpu --nproc 2 "$CHILD" pid @0:exit=0 @1:sleep=3
  wait_lines 2 '^\[[0-9]+\] PID='
  early=$(pid_of_rank 0)
  sleep 0.5
  expect_gone "$early"
  kill -0 "$LR_PID" 2>/dev/null || fail "lockstep-run ended before rank 1"
  wait_lr 20
  expect_rc 0
  ;;

restart)
  # --max-restarts: a rank failing in the first launch stops the others; the whole job starts
  # again with LOCKSTEP_RESTART_COUNT=1, a new token and port, and ends with status 0.
  n=$(rand 2 4) bad=$(rand 0 $((n - 1))) code=$(rand 1 120) max=$(rand 1 3)
  mkdir "$WORK/m"  # the failing rank fails once every rank has printed its environment
  run_lr --cpu --nproc $n --grace 5 --max-restarts $max "$CHILD" env "mark=$WORK/m" "@$bad:await=$WORK/m:$n" \
    "@$bad:exit_first=$code" sleep=0.5
  expect_rc 0
  expect_err "restarting the job (1 of $max restarts): rank $bad exited with code $code"
  grep -q -F "restarting the job (2 of" "$WORK/err" && fail "restarted twice"
  for k in 0 1; do
    c=$(grep -c -E "^\[[0-9]+\] LOCKSTEP_RESTART_COUNT=$k\$" "$WORK/out")
    (( c == n )) || fail "$c ranks saw LOCKSTEP_RESTART_COUNT=$k, expected $n"
  done
  (( $(grep -c -E '^\[[0-9]+\] LOCKSTEP_RESTART_COUNT=[^01]' "$WORK/out") == 0 )) || fail "a third launch"
  tokens=$(sed -n -E 's/^\[0\] LOCKSTEP_JOB_TOKEN=//p' "$WORK/out" | sort -u | wc -l)
  (( tokens == 2 )) || fail "$tokens distinct job tokens over two launches"
  expect_faster 8000
  ;;

restart_limit)
  # A rank that fails every time: max + 1 launches, then the rank's code and a message.
  n=$(rand 2 3) bad=$(rand 0 $((n - 1))) code=$(rand 1 120) max=$(rand 1 2)
  mkdir "$WORK/m"
  run_lr --cpu --nproc $n --grace 5 --max-restarts $max "$CHILD" env "mark=$WORK/m" "@$bad:await=$WORK/m:$n" \
    "@$bad:exit=$code" sleep=30
  expect_rc "$code"
  expect_err "giving up: the job failed in each of its $((max + 1)) launches (--max-restarts $max); the last: rank $bad exited with code $code"
  for (( k = 0; k <= max; ++k )); do
    c=$(grep -c -E "^\[[0-9]+\] LOCKSTEP_RESTART_COUNT=$k\$" "$WORK/out")
    (( c == n )) || fail "$c ranks saw LOCKSTEP_RESTART_COUNT=$k, expected $n"
  done
  expect_faster 10000
  ;;

elastic)
  # --elastic: a rank other than 0 failing leaves the others running, and the job's status is
  # rank 0's; rank 0 failing stops the others as without it.
  n=$(rand 3 4) bad=$(rand 1 $((n - 1))) code=$(rand 1 120)
  mkdir "$WORK/m"
  run_lr --cpu --nproc $n --grace 5 --elastic "$CHILD" "mark=$WORK/m" "@$bad:await=$WORK/m:$n" "@$bad:exit=$code" \
    sleep=1 out=done
  expect_rc 0
  expect_err "rank $bad exited with code $code; the other ranks go on without it (--elastic)"
  c=$(grep -c -E '^\[[0-9]+\] done$' "$WORK/out")
  (( c == n - 1 )) || fail "$c ranks finished, expected $((n - 1))"
  grep -q -E "^\[$bad\] done\$" "$WORK/out" && fail "rank $bad finished after exiting"
  rm -rf "$WORK/m" && mkdir "$WORK/m"
  run_lr --cpu --nproc $n --grace 5 --elastic "$CHILD" "mark=$WORK/m" "@0:await=$WORK/m:$n" "@0:exit=$code" sleep=30
  expect_rc "$code"
  expect_err "rank 0 exited with code $code; sending SIGTERM"
  expect_faster 10000
  ;;

elastic_replace)
  # --elastic --max-restarts: the failed rank's replacement starts with its rank number,
  # LOCKSTEP_ELASTIC_JOIN=1 and the next restart count, while the others run on.
  n=$(rand 2 3) bad=$(rand 1 $((n - 1))) code=$(rand 1 120) max=$(rand 1 3)
  run_lr --cpu --nproc $n --grace 5 --elastic --max-restarts $max "$CHILD" "@$bad:sleep=0.3" \
    "@$bad:exit_first=$code" env sleep=2 out=done
  expect_rc 0
  expect_err "rank $bad exited with code $code; the other ranks go on without it (--elastic), and a replacement joins them (restart 1 of $max)"
  expect_err "started a replacement for rank $bad"
  grep -q -E "^\[$bad\] LOCKSTEP_ELASTIC_JOIN=1\$" "$WORK/out" || fail "the replacement lacks LOCKSTEP_ELASTIC_JOIN=1"
  grep -q -E "^\[$bad\] LOCKSTEP_RESTART_COUNT=1\$" "$WORK/out" || fail "the replacement lacks LOCKSTEP_RESTART_COUNT=1"
  c=$(grep -c -E '^\[[0-9]+\] LOCKSTEP_ELASTIC_JOIN=1$' "$WORK/out")
  (( c == 1 )) || fail "$c processes saw LOCKSTEP_ELASTIC_JOIN=1, expected the replacement alone"
  c=$(grep -c -E '^\[[0-9]+\] done$' "$WORK/out")
  (( c == n )) || fail "$c processes finished, expected $n (the replacement among them)"
  ;;

restart_signal)
  # A job that lockstep-run was told to stop is not restarted; nor one whose time ran out.
  start_lr --cpu --nproc 2 --grace 5 --max-restarts 3 "$CHILD" pid sleep=60
  wait_lines 2 '^\[[0-9]+\] PID='
  kill -TERM "$LR_PID"
  wait_lr 20
  expect_rc 143
  grep -q -F "restarting" "$WORK/err" && fail "restarted after SIGTERM to lockstep-run"
  run_lr --cpu --nproc 2 --grace 1 --max-restarts 3 --timeout 0.5 "$CHILD" sleep=60
  expect_rc 124
  grep -q -F "restarting" "$WORK/err" && fail "restarted after --timeout"
  # A rank failed and the others are still stopping (they ignore SIGTERM) when lockstep-run is
  # told to stop: no restart either.
  start_lr --cpu --nproc 2 --grace 3 --max-restarts 3 "$CHILD" pid ignore=15 @1:sleep=0.3 @1:exit=7 sleep=60
  wait_lines 2 '^\[[0-9]+\] PID='
  until grep -q -F "rank 1 exited with code 7" "$WORK/err"; do sleep 0.05; done
  kill -TERM "$LR_PID"
  wait_lr 20
  grep -q -F "restarting" "$WORK/err" && fail "restarted after SIGTERM to lockstep-run during the stop"
  # --timeout spans the restarts: a rank failing in every launch is cut off by it.
  run_lr --cpu --nproc 2 --grace 0.2 --max-restarts 1000 --timeout 1.5 "$CHILD" @0:sleep=0.2 @0:exit=3 sleep=60
  expect_rc 124
  expect_faster 6000
  (( $(grep -c -F "restarting the job" "$WORK/err") >= 2 )) || fail "fewer than 2 restarts in 1.5 s"
  ;;

*)
  fail "unknown case"
  ;;
esac
echo "PASS $CASE"
