#!/usr/bin/env bash
# bench_store.sh — upload and download throughput of spotune's S3 client
# (spotune-store-tool) against awscli on the same files and the same server.
# A benchmark, not a test. Without --endpoint it starts a private local Swift
# (scripts/swift-s3.sh, on its own ports and directory) and stops it after.
#
# Usage: scripts/bench_store.sh [--endpoint URL] [--bucket NAME] [--sizes "64 256"]
#                               [--runs N] [--part-mb N] [--parallel N]
# Env:   BUILD_DIR (default build): where checkpoint/spotune-store-tool was built
#        with --endpoint: AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_REGION
# Needs: scripts/install-s3-test-deps.sh (Swift, awscli at /usr/bin/aws)
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(dirname "$HERE")
BUILD_DIR=${BUILD_DIR:-$ROOT/build}
TOOL=$BUILD_DIR/checkpoint/spotune-store-tool
AWS=/usr/bin/aws
ENDPOINT="" BUCKET=spotune-bench SIZES="64 256" RUNS=3 PART_MB=16 PARALLEL=4

while [ $# -gt 0 ]; do
  case $1 in
    --endpoint) ENDPOINT=$2; shift 2 ;;
    --bucket)   BUCKET=$2; shift 2 ;;
    --sizes)    SIZES=$2; shift 2 ;;
    --runs)     RUNS=$2; shift 2 ;;
    --part-mb)  PART_MB=$2; shift 2 ;;
    --parallel) PARALLEL=$2; shift 2 ;;
    -h|--help)  sed -n '2,12p' "$0"; exit 0 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done

[ -x "$TOOL" ] || { echo "build first: cmake -S . -B $BUILD_DIR && cmake --build $BUILD_DIR --target spotune-store-tool" >&2; exit 2; }
[ -x "$AWS" ] || { echo "awscli missing: scripts/install-s3-test-deps.sh" >&2; exit 2; }

WORK=$(mktemp -d /tmp/spotune-bench.XXXXXX)
SWIFT_BASE=""
cleanup() {
  if [ -n "$SWIFT_BASE" ]; then
    SWIFT_S3_BASE=$SWIFT_BASE SWIFT_S3_PORT=28380 SWIFT_S3_BACKEND_PORT=26310 \
      bash "$HERE/swift-s3.sh" stop || true
    rm -rf "$SWIFT_BASE"
  fi
  rm -rf "$WORK"
}
trap cleanup EXIT

if [ -z "$ENDPOINT" ]; then
  SWIFT_BASE=$(mktemp -d /tmp/spotune-bench-swift.XXXXXX)
  export SWIFT_S3_BASE=$SWIFT_BASE SWIFT_S3_PORT=28380 SWIFT_S3_BACKEND_PORT=26310
  bash "$HERE/swift-s3.sh" start >/dev/null
  ENDPOINT=http://127.0.0.1:28380
  export AWS_ACCESS_KEY_ID=test:tester AWS_SECRET_ACCESS_KEY=spotune-local-test-secret-7f3a AWS_REGION=us-east-1
fi
export AWS_DEFAULT_REGION=${AWS_REGION:-${AWS_DEFAULT_REGION:-us-east-1}}
export AWS_EC2_METADATA_DISABLED=true AWS_PAGER=""

ST=("$TOOL" --endpoint "$ENDPOINT" --part-mb "$PART_MB" --parallel "$PARALLEL")
AW=("$AWS" --endpoint-url "$ENDPOINT" s3 cp --only-show-errors --no-progress)
"${ST[@]}" mb "s3://$BUCKET"

# best of RUNS wall-clock seconds of a command
best_of() {
  local best="" t0 t1 d
  for _ in $(seq "$RUNS"); do
    t0=$(date +%s.%N); "$@" >/dev/null; t1=$(date +%s.%N)
    d=$(echo "$t1 - $t0" | bc -l)
    if [ -z "$best" ] || [ "$(echo "$d < $best" | bc -l)" = 1 ]; then best=$d; fi
  done
  echo "$best"
}

rate() { echo "scale=1; $1 / $2" | bc -l; }

echo "endpoint $ENDPOINT, part ${PART_MB} MiB, $PARALLEL connections (spotune), best of $RUNS"
echo "awscli: $($AWS --version 2>&1 | cut -d' ' -f1) (times include its ~1 s start-up)"
printf '%-8s %-9s %14s %14s %16s\n' size op "spotune MiB/s" "awscli MiB/s" "spotune/awscli"
for mb in $SIZES; do
  f=$WORK/f$mb
  head -c "${mb}M" /dev/urandom > "$f"
  up_s=$(best_of "${ST[@]}" put "s3://$BUCKET" "sp/f$mb" "$f")
  up_a=$(best_of "${AW[@]}" "$f" "s3://$BUCKET/aw/f$mb")
  dn_s=$(best_of "${ST[@]}" get "s3://$BUCKET" "sp/f$mb" "$WORK/g")
  cmp -s "$f" "$WORK/g" || { echo "spotune download of f$mb differs" >&2; exit 1; }
  rm -f "$WORK/g"
  dn_a=$(best_of "${AW[@]}" "s3://$BUCKET/aw/f$mb" "$WORK/g")
  cmp -s "$f" "$WORK/g" || { echo "awscli download of f$mb differs" >&2; exit 1; }
  for op in upload download; do
    if [ $op = upload ]; then s=$up_s a=$up_a; else s=$dn_s a=$dn_a; fi
    printf '%-8s %-9s %14s %14s %15sx\n' "${mb}MiB" $op "$(rate "$mb" "$s")" "$(rate "$mb" "$a")" \
      "$(echo "scale=2; $a / $s" | bc -l)"
  done
  "${ST[@]}" rm "s3://$BUCKET" "sp/f$mb" "aw/f$mb"
  rm -f "$f" "$WORK/g"
done
