#!/usr/bin/env bash
# scripts/spot-run.sh against a fake metadata service on loopback:
#   - each cloud's notice format is recognised (and its absence too);
#   - a notice during training: SIGUSR1 -> checkpoint -> exit 75, no restart,
#     and the same command on the "next machine" resumes and finishes;
#   - a crash (SIGKILL of the trainer) is restarted with a backoff and the
#     run completes; a config error (exit 2) is not restarted;
#   - with a fake command exiting with given codes: exit 75 without a notice
#     is restarted at once, 0 stops, 2 and 3 stop at once with that code, a
#     crash loop gives up after --max-restarts, and the backoff doubles up to
#     --max-backoff;
#   - a launch that leaves a process behind: the restart waits for it, and
#     kills one that outlives --orphan-wait;
#   - a stop signal that is lost (a notice up at launch, a stop to the
#     supervisor) is sent again every --resend seconds until the run exits.
# usage: tests/test_spot_run.sh BUILD_DIR
set -uo pipefail
build=$(cd "${1:?usage: test_spot_run.sh BUILD_DIR}" && pwd)
src=$(cd "$(dirname "$0")/.." && pwd)
spot="$src/scripts/spot-run.sh"
work=$(mktemp -d "$build/tmp-spot.XXXXXX")
server=""
cleanup() { [ -n "$server" ] && kill "$server" 2>/dev/null; rm -rf "$work"; }
trap cleanup EXIT
fails=0
check() { # description, command...
  local what=$1; shift
  if "$@"; then echo "ok: $what"; else echo "FAIL: $what"; fails=$((fails + 1)); fi
}

python3 "$src/tests/tools/fake_metadata.py" --trigger "$work/notice" --other "$work/other" \
  --maintenance "$work/maint" > "$work/port" &
server=$!
for _ in $(seq 100); do [ -s "$work/port" ] && break; sleep 0.05; done
url="http://127.0.0.1:$(cat "$work/port")"

for c in aws gcp azure alibaba; do
  check "$c: no notice yet" bash -c "! '$spot' --cloud $c --metadata-url $url --check-notice >/dev/null"
done
touch "$work/notice"
for c in aws gcp azure alibaba; do
  check "$c: notice seen" bash -c "'$spot' --cloud $c --metadata-url $url --check-notice | grep -qx notice"
done
# Azure: a Preempt of another VM of the set (its Resources) is not ours
touch "$work/other"
check "azure: another VM's Preempt is not a notice here" \
  bash -c "'$spot' --cloud azure --metadata-url $url --check-notice | grep -qx none"
rm -f "$work/other"
# a proxy in the environment is bypassed: a dead one changes nothing
check "a dead proxy in the environment: the notice is still seen" \
  env http_proxy=http://127.0.0.1:9 HTTP_PROXY=http://127.0.0.1:9 all_proxy=http://127.0.0.1:9 \
  bash -c "'$spot' --cloud aws --metadata-url $url --check-notice | grep -qx notice"
rm -f "$work/notice"
# GCP: a GPU VM's host maintenance that will terminate it is a notice too
touch "$work/maint"
check "gcp: TERMINATE_ON_HOST_MAINTENANCE is a notice" \
  bash -c "'$spot' --cloud gcp --metadata-url $url --check-notice | grep -qx notice"
rm -f "$work/maint"
# a service that cannot be asked is said, not taken for "no notice"
for c in aws gcp azure alibaba; do
  out=$("$spot" --cloud "$c" --metadata-url http://127.0.0.1:9 --check-notice); rc=$?
  check "$c: no service: 'cannot ask', exit 2 ($out)" \
    test "$rc" = 2 -a "${out#cannot ask: HTTP 000 from http://127.0.0.1:9/}" != "$out"
done
# AWS without a token (IMDSv1 only, or a container past the hop limit of 1)
python3 "$src/tests/tools/fake_metadata.py" --trigger "$work/notice" --imdsv1 \
  > "$work/port1" &
server1=$!
for _ in $(seq 100); do [ -s "$work/port1" ] && break; sleep 0.05; done
url1="http://127.0.0.1:$(cat "$work/port1")"
check "aws, IMDSv1: no notice yet" \
  bash -c "'$spot' --cloud aws --metadata-url $url1 --check-notice | grep -qx none"
touch "$work/notice"
check "aws, IMDSv1: notice seen" \
  bash -c "'$spot' --cloud aws --metadata-url $url1 --check-notice | grep -qx notice"
rm -f "$work/notice"
kill "$server1" 2>/dev/null
# the watcher says, once a minute, that it cannot ask
timeout 20 "$spot" --cloud gcp --metadata-url http://127.0.0.1:9 --poll 0.1 -- sleep 1 \
  > "$work/blind.log" 2>&1
check "a watcher that cannot ask says so once a minute" \
  bash -c "[ \$(grep -c 'WARNING: cannot ask gcp for a spot notice (HTTP 000' '$work/blind.log') = 1 ]"

# a small training run
"$src/scripts/make_demo_text.sh" "$work/text.txt" 5 >/dev/null
"$build/spotune" prepare-text "$work/text.txt" "$work/data" --val-fraction 0 >/dev/null
"$build/spotune" init-model --preset tiny --seed 2 "$work/model" >/dev/null
cat > "$work/run.yaml" <<YAML
run: {dir: $work/run, seed: 3}
model: {path: $work/model}
train: {mode: lora, steps: 400, seq_len: 32, micro_batch: 2, lr: 1e-3}
lora: {r: 2, alpha: 4, targets: [q_proj]}
data: {train: $work/data.train.h5}
log: {every: 1}
runtime: {backend: cpu, threads: 1}
checkpoint: {every_minutes: 0}
YAML
train=("$build/spotune" train "$work/run.yaml")

# 1. the notice arrives mid-run
( "$spot" --cloud aws --metadata-url "$url" --poll 0.2 -- "${train[@]}" > "$work/notice.log" 2>&1
  echo $? > "$work/notice.rc" ) &
for _ in $(seq 600); do grep -q '"step":20,' "$work/run/metrics.jsonl" 2>/dev/null && break; sleep 0.05; done
touch "$work/notice"
for _ in $(seq 600); do [ -s "$work/notice.rc" ] && break; sleep 0.1; done
check "notice: the supervisor exits 75" test "$(cat "$work/notice.rc" 2>/dev/null)" = 75
check "notice: the watcher signalled the run" grep -q "spot termination notice from aws" "$work/notice.log"
check "notice: a checkpoint was committed" grep -q "after committing checkpoint step" "$work/notice.log"
check "notice: no restart on this machine" bash -c "[ \$(grep -c 'starting:' '$work/notice.log') = 1 ]"
rm -f "$work/notice"

# 2. crashes are restarted with a backoff; the run resumes and completes
"$spot" --cloud none --backoff 1 --max-restarts 5 -- "${train[@]}" > "$work/crash.log" 2>&1 &
sup=$!
victim=""
for _ in $(seq 200); do victim=$(pgrep -P "$sup" -x spotune) && break; sleep 0.05; done
sleep 0.5
[ -n "$victim" ] && kill -KILL "$victim"
wait "$sup"
echo $? > "$work/crash.rc"
check "crash: the trainer was killed" test -n "$victim"
check "crash: the run finally succeeds" test "$(cat "$work/crash.rc" 2>/dev/null)" = 0
check "crash: restarted after a backoff" grep -q "a crash): restarting in 1s" "$work/crash.log"
check "crash: resumed from the checkpoint" grep -q "resumed from" "$work/crash.log"
check "crash: 400 steps logged, none twice" \
  bash -c "[ \$(grep -c '\"event\":\"train\"' '$work/run/metrics.jsonl') = 400 ]"

# 3. a config error is not restarted
"$spot" --cloud none --backoff 1 -- "$build/spotune" train "$work/run.yaml" --set train.lr=-1 \
  > "$work/bad.log" 2>&1
rc=$?
check "config error: exit 2" test "$rc" = 2
check "config error: not restarted" grep -q "not restarting" "$work/bad.log"

# 4. what each exit code leads to, with a fake command that exits with the
#    codes of a sequence file, one per run, and logs each run
cat > "$work/fake.sh" <<'SH'
#!/usr/bin/env bash
# fake.sh SEQ RUNS: exits with SEQ's first line (removed), appending it to RUNS
code=$(head -n 1 "$1")
sed -i 1d "$1"
echo "${code:-none}" >> "$2"
exit "${code:-99}"
SH
chmod +x "$work/fake.sh"
# supervise NAME CODES OPTIONS...: runs spot-run.sh over the fake command; the
# exit status lands in NAME.rc, the supervisor's messages in NAME.log, the
# codes of the runs made in NAME.runs
supervise() {
  local name=$1 codes=$2; shift 2
  printf '%s\n' $codes > "$work/$name.seq"
  : > "$work/$name.runs"
  timeout 120 "$spot" "$@" -- "$work/fake.sh" "$work/$name.seq" "$work/$name.runs" \
    > "$work/$name.log" 2>&1
  echo $? > "$work/$name.rc"
}
rc_is() { test "$(cat "$work/$1.rc")" = "$2"; }
runs_are() { test "$(paste -sd ' ' "$work/$1.runs")" = "$2"; }

# exit 75 with no notice (the watcher polls a service that has none): the run
# was stopped by someone else's signal; restarted at once, without backoff
supervise ckpt75 "75 75 0" --cloud aws --metadata-url "$url" --poll 0.1 --backoff 1
check "exit 75, no notice: restarted until exit 0" rc_is ckpt75 0
check "exit 75, no notice: 3 runs" runs_are ckpt75 "75 75 0"
check "exit 75, no notice: restarted at once" \
  bash -c "[ \$(grep -c 'checkpointed and stopped (exit 75): restarting to resume' '$work/ckpt75.log') = 2 ] &&
           ! grep -q 'restarting in' '$work/ckpt75.log'"
supervise finish "0 1" --cloud none --backoff 0
check "exit 0: the supervisor exits 0" rc_is finish 0
check "exit 0: not restarted" runs_are finish 0
for code in 2 3; do
  supervise "input$code" "$code 0" --cloud none --backoff 0
  check "exit $code: the supervisor exits $code" rc_is "input$code" "$code"
  check "exit $code: not restarted" runs_are "input$code" "$code"
  check "exit $code: says why" grep -q "exit $code: a config or input error; not restarting" \
    "$work/input$code.log"
done
# a crash loop: --max-restarts 2 means 3 runs, then the crash's own exit code
supervise giveup "42 42 42 0" --cloud none --backoff 0 --max-restarts 2
check "crash loop: gives up with the crash's exit code" rc_is giveup 42
check "crash loop: 1 run + 2 restarts" runs_are giveup "42 42 42"
check "crash loop: says it gives up" grep -q "exit 42 after 2 restart(s) (crashes in a row): giving up" "$work/giveup.log"
# a graceful stop (75) between crashes is not a crash
supervise mixed "42 75 42 42 0" --cloud none --backoff 0 --max-restarts 2
check "75 between crashes: not counted as a crash" runs_are mixed "42 75 42 42"
check "75 between crashes: gives up at the third crash" rc_is mixed 42
# a run that lasted --healthy-after seconds resets the count
supervise healthy "42 42 42 0" --cloud none --backoff 0 --max-restarts 1 --healthy-after 0
check "healthy runs reset the crash count" rc_is healthy 0
check "healthy runs: every crash restarted" runs_are healthy "42 42 42 0"
# numeric options are checked
out=$("$spot" --backoff 0.5 -- true 2>&1); rc=$?
check "--backoff 0.5 refused" test "$rc" -eq 2 -a -n "$(grep -F "takes a whole number, got '0.5'" <<<"$out")"
# backoff doubling from --backoff up to --max-backoff (1 + 2 + 3 s of waiting)
supervise backoff "1 137 1 0" --cloud none --backoff 1 --max-backoff 3 --max-restarts 5
check "backoff: restarted until exit 0" rc_is backoff 0
check "backoff: 4 runs" runs_are backoff "1 137 1 0"
check "backoff: 1 s, doubled to 2 s, then capped at 3 s" \
  test "$(grep -o 'a crash): restarting in [0-9]*s' "$work/backoff.log" | grep -o '[0-9]*s$' | paste -sd ' ')" = "1s 2s 3s"

# a launch that leaves a process behind (as ranks run on after SIGKILL to
# mpirun): the next launch starts only once it has exited; one that will not
# exit is killed after --orphan-wait
cat > "$work/orphan.sh" <<'SH'
#!/usr/bin/env bash
# orphan.sh DIR SECONDS: the first run leaves a process that lives SECONDS and
# then writes DIR/orphan.end; every run writes its start time to DIR/starts
date +%s.%N >> "$1/starts"
if [ ! -e "$1/orphan.started" ]; then
  touch "$1/orphan.started"
  setsid bash -c "sleep $2; date +%s.%N > '$1/orphan.end'" < /dev/null > /dev/null 2>&1 &
  exit 1
fi
exit 0
SH
chmod +x "$work/orphan.sh"
mkdir -p "$work/orph1" "$work/orph2"
timeout 120 "$spot" --cloud none --backoff 0 -- "$work/orphan.sh" "$work/orph1" 2 \
  > "$work/orph1.log" 2>&1
echo $? > "$work/orph1.rc"
check "orphans: the supervisor ends 0" rc_is orph1 0
check "orphans: said it waits" grep -q "waiting for the previous launch's processes to exit" \
  "$work/orph1.log"
check "orphans: the restart came after the orphan exited" \
  python3 -c "import sys; s=open('$work/orph1/starts').read().split(); e=float(open('$work/orph1/orphan.end').read()); sys.exit(0 if len(s)==2 and float(s[1]) >= e else 1)"
timeout 120 "$spot" --cloud none --backoff 0 --orphan-wait 1 -- "$work/orphan.sh" \
  "$work/orph2" 1000 > "$work/orph2.log" 2>&1
echo $? > "$work/orph2.rc"
check "stubborn orphan: the supervisor ends 0" rc_is orph2 0
check "stubborn orphan: killed after --orphan-wait" \
  grep -q "killing what is left of the previous launch after 1s" "$work/orph2.log"
gone() { # every pid the supervisor said it killed has exited
  local p
  for p in $(grep -o 'after 1s: pids [0-9 ]*' "$work/orph2.log" | sed 's/.*pids //'); do
    # (a killed process may stay a zombie until something reaps it)
    [ -e "/proc/$p/stat" ] && [ "$(awk '{print $3}' "/proc/$p/stat" 2>/dev/null)" != Z ] &&
      return 1
  done
  grep -q 'after 1s: pids [0-9]' "$work/orph2.log"
}
check "stubborn orphan: it is gone" gone

# a notice already up when the command starts, or a stop to the supervisor:
# the first SIGUSR1 can be lost (mpirun forwards it before its ranks exist,
# a rank gets it before its handler is in), so the supervisor sends it again
# every --resend seconds until the command exits. deaf.sh loses the first
# one and exits 75 on the second.
cat > "$work/deaf.sh" <<'SH'
#!/usr/bin/env bash
# deaf.sh DIR: counts SIGUSR1s in DIR/usr1; exits 75 after the second
n=0
trap 'n=$((n + 1)); echo $n > "$1/usr1"' USR1
while [ "$n" -lt 2 ]; do sleep 0.05; done
exit 75
SH
chmod +x "$work/deaf.sh"
mkdir -p "$work/deaf1" "$work/deaf2"
touch "$work/notice"
timeout 30 "$spot" --cloud aws --metadata-url "$url" --poll 0.1 --resend 0.3 -- "$work/deaf.sh" \
  "$work/deaf1" > "$work/deaf1.log" 2>&1
echo $? > "$work/deaf1.rc"
rm -f "$work/notice"
check "notice at launch, first signal lost: the supervisor exits 75" rc_is deaf1 75
check "notice at launch: the signal was sent again" test "$(cat "$work/deaf1/usr1" 2>/dev/null)" = 2
# (the supervisor runs in a subshell that records its pid and exit status:
# no wait on it in this shell)
( timeout 60 "$spot" --cloud none --resend 0.3 -- "$work/deaf.sh" "$work/deaf2" \
    > "$work/deaf2.log" 2>&1 &
  echo $! > "$work/deaf2.pid"; wait $!; echo $? > "$work/deaf2.rc" ) &
for _ in $(seq 200); do [ -s "$work/deaf2.pid" ] && break; sleep 0.05; done
sup=$(pgrep -P "$(cat "$work/deaf2.pid")" -f spot-run.sh | head -n 1)
for _ in $(seq 200); do pgrep -P "$sup" -f deaf.sh >/dev/null && break; sleep 0.05; done
kill -TERM "$sup"
for _ in $(seq 700); do [ -s "$work/deaf2.rc" ] && break; sleep 0.1; done
check "SIGTERM to the supervisor, first signal lost: exit 75" rc_is deaf2 75
check "SIGTERM to the supervisor: the signal was sent again" \
  test "$(cat "$work/deaf2/usr1" 2>/dev/null)" = 2

# --watch-local without the launch it is to signal: refused by name
out=$(env -u SPOTUNE_SUPERVISOR_TAG "$spot" --cloud aws --metadata-url "$url" --watch-local 2>&1)
rc=$?
check "--watch-local without SPOTUNE_SUPERVISOR_TAG: exit 2, named ($out)" \
  test "$rc" = 2 -a "${out#*needs SPOTUNE_SUPERVISOR_TAG}" != "$out"

# several nodes: launch.sh --hostfile under spot-run.sh starts a watcher on
# every node (spot-run.sh --watch-local) through a second mpirun; a worker's
# notice reaches that node's ranks as SIGUSR1. Here mpirun is a stand-in
# that runs both commands on this machine, the "worker's" watcher asking its
# own metadata service (a second fake, with the notice up), the supervisor's
# none: only the worker's watcher can signal the rank.
printf 'node-a slots=1\nnode-b slots=1\n' > "$work/hosts"
mkdir -p "$work/nodeb"
python3 "$src/tests/tools/fake_metadata.py" --trigger "$work/nodeb/notice" > "$work/portb" &
serverb=$!
for _ in $(seq 100); do [ -s "$work/portb" ] && break; sleep 0.05; done
touch "$work/nodeb/notice"
cat > "$work/mpirun.sh" <<SH
#!/usr/bin/env bash
# runs the program after mpirun's options here; a watcher asks node-b's service
while [ \$# -gt 0 ] && [ "\$1" != bash ] && [ "\$1" != "$work/rank.sh" ]; do shift; done
if [ "\$1" = bash ]; then
  exec "\$@" --metadata-url "http://127.0.0.1:$(cat "$work/portb")"
fi
exec "\$@"
SH
cat > "$work/rank.sh" <<'SH'
#!/usr/bin/env bash
# a rank: SIGUSR1 ends it (exit 0, so that the supervisor is done too)
trap 'echo usr1 >> "$0.got"; exit 0' USR1
for _ in $(seq 600); do sleep 0.05; done
exit 9
SH
chmod +x "$work/mpirun.sh" "$work/rank.sh"
timeout 60 "$spot" --cloud aws --metadata-url "$url" --poll 0.1 --resend 0.3 -- \
  "$src/scripts/launch.sh" --mpirun "$work/mpirun.sh" --hostfile "$work/hosts" -g 1 \
  "$work/rank.sh" > "$work/nodes.log" 2>&1
echo $? > "$work/nodes.rc"
kill "$serverb" 2>/dev/null
check "2 nodes: the worker's notice reached its rank" test -s "$work/rank.sh.got"
check "2 nodes: the worker's watcher said so" \
  grep -q "spot termination notice from aws on .*: sending SIGUSR1 to this node's ranks" \
  "$work/nodes.log"
check "2 nodes: the job ended as the rank did (exit 0)" rc_is nodes 0
check "2 nodes: the watchers were stopped with the job" \
  bash -c "! pgrep -f -- '[-]-watch-local --metadata-url http://127.0.0.1:$(cat "$work/portb")'"

# a notice, then an exit other than 75 (mpirun dying of the resent signal in
# its own shutdown, a launcher still in bash): the machine is still going
# away, so no restart
cat > "$work/dies.sh" <<'SH'
#!/usr/bin/env bash
trap 'exit 138' USR1
while :; do sleep 0.05; done
SH
chmod +x "$work/dies.sh"
touch "$work/notice"
timeout 30 "$spot" --cloud aws --metadata-url "$url" --poll 0.1 --backoff 0 -- "$work/dies.sh" \
  > "$work/dies.log" 2>&1
echo $? > "$work/dies.rc"
rm -f "$work/notice"
check "notice, then exit 138: the supervisor exits 138" rc_is dies 138
check "notice, then exit 138: not restarted" \
  bash -c "[ \$(grep -c 'starting:' '$work/dies.log') = 1 ] &&
           grep -q 'after the spot notice: this machine is going away' '$work/dies.log'"

if [ "$fails" -gt 0 ]; then echo "$fails check(s) failed"; cat "$work"/*.log; exit 1; fi
echo "all spot-run checks passed"
