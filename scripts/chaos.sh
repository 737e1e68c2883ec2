#!/usr/bin/env bash
# chaos.sh — the demo under fire: trains the demo configuration (LoRA on the
# tiny model, over mpirun with N ranks) while interrupting it at random
# moments, restarting it after each interruption, until it completes; then
# compares the final adapter with that of an uninterrupted run. They must be
# bit-identical (CPU backend), and every checkpoint left must verify.
# An interruption is, at random, one of:
#   SIGTERM to every rank  (the children of mpirun): they agree at the next
#                          step boundary, checkpoint and exit 75 — a graceful
#                          stop. (SIGTERM to mpirun itself would make mpirun
#                          exit 1 and SIGKILL the ranks after a short grace:
#                          see docs/launching.md.) Sent once the ranks have
#                          installed their handler, so the exit must be 75
#                          (or 0 if the run had just finished).
#   SIGKILL to one rank    mpirun sees it die and ends the others.
#   SIGKILL to mpirun      as if the launcher vanished; ranks that outlive it
#                          are reported, then killed, before the restart.
# With --ranks 1 spotune runs without mpirun and gets SIGTERM or SIGKILL.
# Not part of CI (it takes a few minutes).
#
# usage: scripts/chaos.sh [options]
#   --ranks N     MPI ranks (default 2, as the demo)
#   --kills N     at most N interruptions, then the run is let finish (default
#                 10; fewer when the run completes first)
#   --steps N     training steps (default: the demo's 200)
#   --seed S      the random moments and kinds (default: random)
#   --build DIR   use DIR/spotune as it is (default: install what is missing and
#                 build build-cpu/)
#   --out DIR     where the runs and logs go (default runs/)
set -uo pipefail
cd "$(dirname "$0")/.." || { echo "chaos: cannot enter the repository root" >&2; exit 1; }
ranks=2 kills=10 seed=$RANDOM steps="" build="" out=runs
usage() { sed -n '/^# usage:/,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit "$1"; }
while [ $# -gt 0 ]; do
  case "$1" in
    --ranks) ranks=$2; shift 2 ;;
    --kills) kills=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    --seed) seed=$2; shift 2 ;;
    --build) build=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    -h|--help) usage 0 ;;
    *) echo "chaos: unknown option $1" >&2; usage 2 >&2 ;;
  esac
done
RANDOM=$seed
echo "chaos: seed $seed, $ranks rank(s), $kills interruptions${steps:+, $steps steps}"
if [ -z "$build" ]; then
  scripts/install-deps.sh >/dev/null
  cmake -S . -B build-cpu -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSPOTUNE_CUDA=OFF >/dev/null
  ninja -C build-cpu spotune >/dev/null || { echo "chaos: the build failed"; exit 1; }
  build=build-cpu
fi
build_abs=$(cd "$build" && pwd) || { echo "chaos: no build directory $build"; exit 2; }
spotune=$build_abs/spotune
[ -x "$spotune" ] || { echo "chaos: no $spotune"; exit 2; }
mkdir -p "$out"
inputs=$out/demo-inputs
mkdir -p "$inputs"
[ -f "$inputs/data.train.h5" ] || { scripts/make_demo_text.sh "$inputs/demo.txt" &&
  "$spotune" prepare-text "$inputs/demo.txt" "$inputs/data" --val-fraction 0.05 >/dev/null; }
[ -f "$inputs/tiny-model/config.json" ] ||
  "$spotune" init-model --preset tiny --seed 1 "$inputs/tiny-model" >/dev/null
[ "$(id -u)" -eq 0 ] && export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
launch=()
[ "$ranks" -gt 1 ] && launch=(mpirun -np "$ranks" --oversubscribe)
sets=(--set model.path="$inputs/tiny-model" --set data.train="$inputs/data.train.h5"
      --set data.val="$inputs/data.val.h5" --set checkpoint.every_steps=5
      --set checkpoint.every_minutes=0 --set log.every=50)
[ -n "$steps" ] && sets+=(--set train.steps="$steps")
ref=$out/chaos-ref run=$out/chaos log=$out/chaos.log

rm -rf "$ref" "$run" "$log"
echo "chaos: the uninterrupted reference run"
t0=$SECONDS
"${launch[@]}" "$spotune" train configs/tiny-cpu.yaml --set run.dir="$ref" "${sets[@]}" \
  > "$ref.log" 2>&1 || { echo "chaos: the reference run failed"; tail "$ref.log"; exit 1; }
echo "chaos: reference done in $((SECONDS - t0)) s"

# the training processes of launcher pid $1: the ranks (children of mpirun),
# or the process itself without mpirun
procs_of() {
  if [ "$ranks" -gt 1 ]; then pgrep -P "$1"; else kill -0 "$1" 2>/dev/null && echo "$1"; fi
}
# whether every pid given catches SIGTERM yet (bit 14 of SigCgt: signal 15)
catch_term() {
  local p m
  [ $# -gt 0 ] || return 1
  for p in "$@"; do
    m=$(awk '/^SigCgt:/ {print $2}' "/proc/$p/status" 2>/dev/null)
    [ -n "$m" ] && (( (16#$m >> 14) & 1 )) || return 1
  done
}
# every committed checkpoint verifies (a .tmp- leftover of a kill is allowed)
check_checkpoints() {
  [ -d "$run/checkpoints" ] || return 0
  local listing bad
  listing=$("$spotune" ckpt list "$run" 2>&1) || { echo "$listing"; return 1; }
  bad=$(echo "$listing" | awk 'NR > 1 && $1 ~ /^step-/ && $NF != "ok"')
  [ -z "$bad" ] || { echo "chaos: FAILED: a committed checkpoint does not verify:"; echo "$bad"; return 1; }
}

done_=0 n=0 round=0
while [ "$done_" = 0 ]; do
  round=$((round + 1))
  if [ "$round" -gt $((kills + 10)) ]; then echo "chaos: FAILED: no end after $round starts"; exit 1; fi
  echo "=== start $round" >> "$log"
  "${launch[@]}" "$spotune" train configs/tiny-cpu.yaml --set run.dir="$run" "${sets[@]}" \
    >> "$log" 2>&1 &
  pid=$!
  kind=none
  if [ "$n" -lt "$kills" ]; then
    for _ in $(seq 600); do [ -n "$(procs_of "$pid")" ] && break; kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    sleep "$((RANDOM % 8 + 1)).$((RANDOM % 10))"
    pick=$((RANDOM % (ranks > 1 ? 3 : 2)))
    case "$pick" in 0) kind=TERM ;; 1) kind=KILL-rank ;; 2) kind=KILL-mpirun ;; esac
    # a stop is only graceful once the handler is there (a signal before it
    # ends a starting process with nothing to save): wait for it
    if [ "$kind" = TERM ]; then
      for _ in $(seq 600); do catch_term $(procs_of "$pid") && break; kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    fi
    mapfile -t victims < <(procs_of "$pid")
    if [ "${#victims[@]}" -gt 0 ] && kill -0 "$pid" 2>/dev/null; then
      case "$kind" in
        TERM) kill -TERM "${victims[@]}" 2>/dev/null ;;
        KILL-rank) kill -KILL "${victims[$((RANDOM % ${#victims[@]}))]}" 2>/dev/null ;;
        KILL-mpirun) kill -KILL "$pid" 2>/dev/null ;;
      esac
      n=$((n + 1))
      echo "chaos: interruption $n: $kind (start $round)"
      echo "=== interruption $n: $kind" >> "$log"
    else
      kind=none # it had already finished
    fi
  fi
  { wait "$pid"; } 2>/dev/null; rc=$? # (no "Killed" notice from bash)
  if [ "$kind" = KILL-mpirun ]; then
    # ranks left behind must not write into the next run's directory
    strays=()
    for _ in $(seq 100); do
      strays=(); for v in "${victims[@]}"; do kill -0 "$v" 2>/dev/null && strays+=("$v"); done
      [ "${#strays[@]}" = 0 ] && break; sleep 0.1
    done
    if [ "${#strays[@]}" -gt 0 ]; then
      echo "chaos:   ${#strays[@]} rank(s) outlived mpirun by 10 s; killing them"
      kill -KILL "${strays[@]}" 2>/dev/null
      for _ in $(seq 100); do kill -0 "${strays[@]}" 2>/dev/null || break; sleep 0.1; done
    fi
  fi
  echo "=== exit $rc" >> "$log"
  case "$kind:$rc" in
    *:0) done_=1 ;;
    TERM:75) ;;
    KILL-*:2|KILL-*:3) echo "chaos: FAILED: exit $rc (bad input) after $kind"; tail -20 "$log"; exit 1 ;;
    KILL-*:*) ;;
    *) echo "chaos: FAILED: exit $rc after ${kind/none/no interruption}"; tail -20 "$log"; exit 1 ;;
  esac
  check_checkpoints || exit 1
done
reported=$(grep -c 'skipping checkpoint' "$log")
leftovers=$(find "$run/checkpoints" -maxdepth 1 -name '.tmp-*' | wc -l)
echo "chaos: $n interruptions, $round starts; $reported incomplete or damaged checkpoint(s) reported on resume"
if [ "$leftovers" != 0 ]; then
  echo "chaos: FAILED: $leftovers .tmp- leftover(s) in $run/checkpoints after the end"; exit 1
fi
if cmp "$ref/adapter/adapter_model.safetensors" "$run/adapter/adapter_model.safetensors"; then
  echo "chaos: the final adapter is bit-identical to the uninterrupted run's"
else
  echo "chaos: FAILED: the final adapters differ"; exit 1
fi
