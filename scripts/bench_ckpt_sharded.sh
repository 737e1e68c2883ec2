#!/usr/bin/env bash
# bench_ckpt_sharded.sh — gathered against sharded checkpoints of a full
# fine-tune (the optimizer sharded over the ranks), pushed to S3 (the local
# Swift server of scripts/swift-s3.sh). For 1, 2 and 4 ranks and each layout
# (checkpoint.layout gathered | sharded) it trains the `small` preset (110M
# parameters, 1.3 GB of fp32 masters and AdamW moments) on the CPU, sends
# SIGUSR1 once training runs (a preemption notice) and reads the run's
# "preemption" record: seconds from the signal to the checkpoint committed
# locally and to it being complete in the store (MANIFEST.json up, after
# every file), the bytes each rank wrote; and the largest resident memory of
# rank 0 over the run (its VmHWM, read until it exits); then, on a "new machine"
# (the run directory removed), the time the same command takes to resume
# from the store and rank 0's peak memory until then. One rank has nothing to shard: its row
# is the same checkpoint under both names. A benchmark, not a test: the
# figures depend on the machine's disks, cores and network.
# usage: scripts/bench_ckpt_sharded.sh [--ranks "1 2 4"] [--preset small]
set -euo pipefail
cd "$(dirname "$0")/.."
ranks_list="1 2 4" preset=small
while [ $# -gt 0 ]; do
  case "$1" in
    --ranks) ranks_list=$2; shift 2 ;;
    --preset) preset=$2; shift 2 ;;
    *) echo "usage: scripts/bench_ckpt_sharded.sh [--ranks \"1 2 4\"] [--preset NAME]" >&2; exit 2 ;;
  esac
done
scripts/install-deps.sh >/dev/null
scripts/install-s3-test-deps.sh >/dev/null
cmake -S . -B build-cpu -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSPOTUNE_CUDA=OFF >/dev/null
ninja -C build-cpu spotune spotune-store-tool >/dev/null
spotune=$PWD/build-cpu/spotune
work=$PWD/runs/bench-sharded
rm -rf "$work"
mkdir -p "$work"
"$spotune" init-model --preset "$preset" --seed 1 "$work/model" >/dev/null
scripts/make_demo_text.sh "$work/text.txt"
"$spotune" prepare-text "$work/text.txt" "$work/data" --val-fraction 0 >/dev/null
cat > "$work/run.yaml" <<YAML
run: {seed: 1}
model: {path: $work/model}
train: {mode: full, steps: 100000, seq_len: 64, micro_batch: 1, grad_accum: 4, lr: 1e-5}
data: {train: $work/data.train.h5}
log: {every: 1}
checkpoint: {every_steps: 0, every_minutes: 0, keep: 1, upload_deadline_s: 600,
             final_upload_timeout_s: 600}
runtime: {backend: cpu, threads: 1}
YAML

export SWIFT_S3_BASE=$work/swift
cleanup() { scripts/swift-s3.sh stop >/dev/null 2>&1 || true; }
trap cleanup EXIT
scripts/swift-s3.sh start --clean >/dev/null
export AWS_ACCESS_KEY_ID=test:tester AWS_SECRET_ACCESS_KEY=spotune-local-test-secret-7f3a AWS_REGION=us-east-1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
tool=(build-cpu/checkpoint/spotune-store-tool --endpoint http://127.0.0.1:28080 --path-style)
"${tool[@]}" mb s3://sharded-bench >/dev/null

# the process id of rank 0 of the run writing into dir
rank0_pid() {
  local p
  for p in $(pgrep -f "run.dir=$1 "); do
    if tr '\0' '\n' < "/proc/$p/environ" 2>/dev/null | grep -qx 'OMPI_COMM_WORLD_RANK=0'; then
      echo "$p"; return
    fi
  done
}

# one run: trains until its first step is logged, then SIGUSR1; prints a row
one() {
  local ranks=$1 layout=$2 name="r$1-$2"
  local dir=$work/$name
  mkdir -p "$dir"
  mpirun --oversubscribe -np "$ranks" \
    "$spotune" train "$work/run.yaml" --set run.dir="$dir" --set checkpoint.layout="$layout" \
    --set checkpoint.remote="s3://sharded-bench/$name" \
    --set checkpoint.endpoint=http://127.0.0.1:28080 --set checkpoint.addressing=path \
    > "$dir.log" 2>&1 &
  local pid=$!
  until grep -q '"event":"train"' "$dir/metrics.jsonl" 2>/dev/null; do
    if ! kill -0 "$pid" 2>/dev/null; then echo "$name: training ended early, see $dir.log" >&2; return 1; fi
    sleep 0.2
  done
  local r0 rss0=0 hwm
  r0=$(rank0_pid "$dir")
  kill -USR1 "$pid"
  while kill -0 "$r0" 2>/dev/null; do  # VmHWM: the peak so far; the last read is the run's
    hwm=$(awk '/^VmHWM/ {print $2}' "/proc/$r0/status" 2>/dev/null || true)
    [ -n "$hwm" ] && rss0=$hwm
    sleep 0.05
  done
  local rc=0
  wait "$pid" || rc=$?
  if [ "$rc" != 75 ]; then echo "$name: exit $rc (expected 75), see $dir.log" >&2; return 1; fi
  # a new machine: the run directory gone, the same command resumes from the store;
  # timed from its start to "resumed from" (the model's load included), then stopped again
  mv "$dir/metrics.jsonl" "$dir.metrics.jsonl"
  rm -rf "$dir"
  mkdir -p "$dir"
  local t0 t1 rss1=0
  r0=""
  t0=$(date +%s.%N)
  mpirun --oversubscribe -np "$ranks" \
    "$spotune" train "$work/run.yaml" --set run.dir="$dir" --set checkpoint.layout="$layout" \
    --set checkpoint.remote="s3://sharded-bench/$name" \
    --set checkpoint.endpoint=http://127.0.0.1:28080 --set checkpoint.addressing=path \
    > "$dir.resume.log" 2>&1 &
  pid=$!
  until grep -q "resumed from" "$dir.resume.log" 2>/dev/null; do
    if ! kill -0 "$pid" 2>/dev/null; then echo "$name: the resume ended early, see $dir.resume.log" >&2; return 1; fi
    if [ -z "$r0" ] || ! kill -0 "$r0" 2>/dev/null; then r0=$(rank0_pid "$dir"); fi
    if [ -n "$r0" ]; then
      hwm=$(awk '/^VmHWM/ {print $2}' "/proc/$r0/status" 2>/dev/null || true)
      if [ -n "$hwm" ]; then rss1=$hwm; fi
    fi
    sleep 0.05
  done
  t1=$(date +%s.%N)
  kill -USR1 "$pid"
  wait "$pid" || true
  local resume_s
  resume_s=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.2f", b - a }')
  awk -v name="$name" -v ranks="$ranks" -v layout="$layout" -v rss="$rss0" -v rs="$resume_s" -v rss1="$rss1" '
    /"event":"train"/ { if (match($0, /"step_s":[0-9.eE+-]+/)) step = substr($0, RSTART + 9, RLENGTH - 9) }
    /"event":"checkpoint",/ { if (match($0, /"stall_s":[0-9.eE+-]+/)) stall = substr($0, RSTART + 10, RLENGTH - 10) }
    /"event":"preemption"/ {
      match($0, /"to_commit_s":[0-9.eE+-]+/); c = substr($0, RSTART + 14, RLENGTH - 14)
      r = "null"; if (match($0, /"to_remote_s":[0-9.eE+-]+/)) r = substr($0, RSTART + 14, RLENGTH - 14)
      match($0, /"bytes":[0-9]+/); b = substr($0, RSTART + 8, RLENGTH - 8)
      match($0, /"bytes_per_rank":\[[0-9,]+\]/); per = substr($0, RSTART + 18, RLENGTH - 19)
      split(per, a, ","); mx = 0; for (i in a) { v = a[i] + 0; if (v > mx) mx = v }
      printf "%5d  %-9s %8.2f %8.3f %10.2f %12.2f %10.1f %14.1f %16.1f %9.2f %16.1f\n", ranks, layout, step, stall, c, r, b / 1048576, mx / 1048576, rss / 1024, rs, rss1 / 1024
    }' "$dir.metrics.jsonl"
}

printf "%5s  %-9s %8s %8s %10s %12s %10s %14s %16s %9s %16s\n" ranks layout "step s" "stall s" "commit s" "in store s" "MiB" "max MiB/rank" "rank 0 peak MiB" "resume s" "resume peak MiB"
for n in $ranks_list; do
  for layout in gathered sharded; do
    one "$n" "$layout"
  done
done
echo "(commit s, in store s: from SIGUSR1 to the checkpoint committed locally and to it complete"
echo " in the store, the step in progress when the signal came included; stall s: the longest"
echo " time one rank held training for it; rank 0 peak: its largest resident memory;"
echo " resume s: a new machine's start to \"resumed from\", loading the model included, the"
echo " gathered checkpoint pulled whole to rank 0, the sharded one read in ranges by every rank;"
echo " resume peak: rank 0's largest resident memory until then)"
