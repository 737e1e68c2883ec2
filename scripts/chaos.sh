#!/usr/bin/env bash
# chaos.sh — the demo under fire: trains the demo configuration while killing
# it at random moments (SIGKILL, or SIGUSR1 for a graceful checkpoint-and-stop)
# and restarting it, until it completes; then compares the final adapter with
# that of an uninterrupted run. They must be bit-identical (CPU backend).
# Not part of CI (it takes several minutes).
# usage: scripts/chaos.sh [--ranks N] [--kills N] [--seed S]
set -uo pipefail
cd "$(dirname "$0")/.."
ranks=1 kills=10 seed=$RANDOM
while [ $# -gt 0 ]; do
  case "$1" in
    --ranks) ranks=$2; shift 2 ;;
    --kills) kills=$2; shift 2 ;;
    --seed) seed=$2; shift 2 ;;
    *) echo "usage: scripts/chaos.sh [--ranks N] [--kills N] [--seed S]" >&2; exit 2 ;;
  esac
done
RANDOM=$seed
echo "chaos: seed $seed, $ranks rank(s), $kills interruptions"
scripts/install-deps.sh >/dev/null
cmake -S . -B build-cpu -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSPOTUNE_CUDA=OFF >/dev/null
ninja -C build-cpu spotune >/dev/null
spotune=$PWD/build-cpu/spotune
inputs=runs/demo-inputs
mkdir -p "$inputs"
[ -f "$inputs/data.train.h5" ] || { scripts/make_demo_text.sh "$inputs/demo.txt" &&
  "$spotune" prepare-text "$inputs/demo.txt" "$inputs/data" --val-fraction 0.05 >/dev/null; }
[ -f "$inputs/tiny-model/config.json" ] ||
  "$spotune" init-model --preset tiny --seed 1 "$inputs/tiny-model" >/dev/null
[ "$(id -u)" -eq 0 ] && export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
launch=()
[ "$ranks" -gt 1 ] && launch=(mpirun -np "$ranks" --oversubscribe)
sets=(--set checkpoint.every_steps=5 --set checkpoint.every_minutes=0 --set log.every=50)

rm -rf runs/chaos-ref runs/chaos
echo "chaos: the uninterrupted reference run"
"${launch[@]}" "$spotune" train configs/tiny-cpu.yaml --set run.dir=runs/chaos-ref "${sets[@]}" \
  > runs/chaos-ref.log 2>&1 || { echo "chaos: the reference run failed"; tail runs/chaos-ref.log; exit 1; }

done_=0 n=0
while [ "$done_" = 0 ]; do
  "${launch[@]}" "$spotune" train configs/tiny-cpu.yaml --set run.dir=runs/chaos "${sets[@]}" \
    >> runs/chaos.log 2>&1 &
  pid=$!
  if [ "$n" -lt "$kills" ]; then
    sleep "$((RANDOM % 8 + 1)).$((RANDOM % 10))"
    if kill -0 "$pid" 2>/dev/null; then
      if [ $((RANDOM % 2)) = 0 ]; then sig=KILL; else sig=USR1; fi
      # SIGKILL hits every rank at once, as a vanished machine would
      if [ "$sig" = KILL ] && [ "$ranks" -gt 1 ]; then pkill -KILL -P "$pid"; fi
      kill -"$sig" "$pid" 2>/dev/null
      n=$((n + 1))
      echo "chaos: interruption $n: SIG$sig"
    fi
  fi
  wait "$pid"; rc=$?
  [ "$rc" = 0 ] && done_=1
  if [ "$rc" != 0 ] && [ "$rc" != 75 ] && [ "$rc" != 137 ] && [ "$rc" -lt 128 ] && [ "$rc" != 1 ]; then
    echo "chaos: unexpected exit $rc"; tail -20 runs/chaos.log; exit 1
  fi
done
if cmp runs/chaos-ref/adapter/adapter_model.safetensors runs/chaos/adapter/adapter_model.safetensors; then
  echo "chaos: $n interruptions; the final adapter is bit-identical to the uninterrupted run's"
else
  echo "chaos: FAILED: the final adapters differ"; exit 1
fi
