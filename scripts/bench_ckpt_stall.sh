#!/usr/bin/env bash
# bench_ckpt_stall.sh — how long a checkpoint holds training, with pushing to
# an object store off and on. Trains the `small` preset (110M, LoRA r=16 on
# all 7 projections, 28 MB of trainable state) on the CPU with a checkpoint
# every 2 steps, three times: local checkpoints only, pushed to a file://
# bucket, and pushed to S3 (the local Swift server of scripts/swift-s3.sh,
# started here unless --no-s3). Reads the "checkpoint" records of
# metrics.jsonl and prints, per mode, the mean step time and the mean and
# largest stall (the time the step loop waits for the snapshot). A benchmark,
# not a test.
# usage: scripts/bench_ckpt_stall.sh [--steps N] [--mode lora|full] [--no-s3]
set -euo pipefail
cd "$(dirname "$0")/.."
steps=12 mode=lora s3=1
while [ $# -gt 0 ]; do
  case "$1" in
    --steps) steps=$2; shift 2 ;;
    --mode) mode=$2; shift 2 ;;
    --no-s3) s3=0; shift ;;
    *) echo "usage: scripts/bench_ckpt_stall.sh [--steps N] [--mode lora|full] [--no-s3]" >&2; exit 2 ;;
  esac
done
scripts/install-deps.sh >/dev/null
cmake -S . -B build-cpu -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSPOTUNE_CUDA=OFF >/dev/null
ninja -C build-cpu spotune >/dev/null
spotune=$PWD/build-cpu/spotune
work=runs/bench-stall
rm -rf "$work"
mkdir -p "$work"
"$spotune" init-model --preset small --seed 1 "$work/model" >/dev/null
scripts/make_demo_text.sh "$work/text.txt"
"$spotune" prepare-text "$work/text.txt" "$work/data" --val-fraction 0 >/dev/null
cat > "$work/run.yaml" <<YAML
run: {seed: 1}
model: {path: $work/model}
train: {mode: $mode, steps: $steps, seq_len: 128, micro_batch: 2, lr: 1e-4}
lora: {r: 16, alpha: 32, targets: [q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj]}
data: {train: $work/data.train.h5}
log: {every: 1000}
checkpoint: {every_steps: 2, every_minutes: 0, keep: 2, final_upload_timeout_s: 600}
runtime: {backend: cpu}
YAML

server_pid=""
cleanup() { if [ "$s3" = 1 ]; then SWIFT_S3_BASE=$PWD/$work/swift scripts/swift-s3.sh stop >/dev/null 2>&1 || true; fi; }
trap cleanup EXIT
modes=(local "file://$PWD/$work/bucket")
if [ "$s3" = 1 ]; then
  scripts/install-s3-test-deps.sh >/dev/null
  export SWIFT_S3_BASE=$PWD/$work/swift
  scripts/swift-s3.sh start --clean >/dev/null
  export AWS_ACCESS_KEY_ID=test:tester AWS_SECRET_ACCESS_KEY=spotune-local-test-secret-7f3a AWS_REGION=us-east-1
  build-cpu/checkpoint/spotune-store-tool --endpoint http://127.0.0.1:28080 --path-style mb s3://stall-bench >/dev/null 2>&1 ||
    { ninja -C build-cpu spotune-store-tool >/dev/null &&
      build-cpu/checkpoint/spotune-store-tool --endpoint http://127.0.0.1:28080 --path-style mb s3://stall-bench >/dev/null; }
  modes+=("s3://stall-bench/run")
fi

printf "%-34s %10s %12s %12s %6s\n" remote "step s" "mean stall s" "max stall s" ckpts
for m in "${modes[@]}"; do
  dir=$work/run-$(echo "$m" | tr -c 'a-z0-9' '_' | cut -c1-24)
  extra=()
  [ "$m" = local ] || extra=(--set checkpoint.remote="$m" --set checkpoint.endpoint=http://127.0.0.1:28080
                             --set checkpoint.addressing=path)
  "$spotune" train "$work/run.yaml" --set run.dir="$dir" "${extra[@]}" > "$dir.log" 2>&1
  awk -v name="$m" '
    /"event":"train"/ { if (match($0, /"step_s":[0-9.eE+-]+/)) { s += substr($0, RSTART + 9, RLENGTH - 9); n++ } }
    /"event":"checkpoint",/ { if (match($0, /"stall_s":[0-9.eE+-]+/)) { v = substr($0, RSTART + 10, RLENGTH - 10);
                              t += v; c++; if (v > mx) mx = v } }
    END { printf "%-34s %10.3f %12.4f %12.4f %6d\n", name, s / n, t / c, mx, c }' "$dir/metrics.jsonl"
done
echo "(stall: the step loop waits only for the host copy; writing and uploading run in the background)"
