#!/usr/bin/env bash
# scripts/bench_comm.sh — communication benchmarks (not a test).
#
# Part 1: all-reduce. spotune-bench-allreduce under mpirun with 2 ranks (and
# 4, oversubscribed, with --np4): for sizes 1 KiB .. 256 MiB (x4 each step)
# the time of comm_allreduce and of plain MPI_Allreduce on the same buffer,
# algbw, busbw = algbw * 2(n-1)/n (nccl-tests' definition) and the ratio
# comm/MPI (above 1: comm is slower). With --device the same over
# comm_device_allreduce and plain ncclAllReduce (needs GPUs, one per rank).
#
# Part 2: training scaling, 1 vs 2 ranks, through `spotune bench` when the
# build has it; skipped with a note otherwise.
#
#   scripts/bench_comm.sh [--build DIR] [--np4] [--device] [--max BYTES] [--tcp]
#                         [--no-training]
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
build="$root/build" np4=0 device=0 max=$((256 << 20)) btl=() training=1
while [[ $# -gt 0 ]]; do
    case "$1" in
    --build) build="${2:?}"; shift 2 ;;
    --np4) np4=1; shift ;;
    --device) device=1; shift ;;
    --max) max="${2:?}"; shift 2 ;;
    --tcp) btl=(--mca btl tcp,self); shift ;;
    --no-training) training=0; shift ;;
    -h | --help) sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "bench_comm.sh: unknown option $1" >&2; exit 2 ;;
    esac
done

mpirun=(mpirun)
[[ $(id -u) -eq 0 ]] && mpirun+=(--allow-run-as-root)
[[ ${#btl[@]} -gt 0 ]] && mpirun+=("${btl[@]}")

# ---- part 1: all-reduce ------------------------------------------------------
bench="$build/spotune-bench-allreduce"
if [[ ! -x "$bench" ]]; then
    echo "bench_comm.sh: $bench not built (cmake -S . -B build -G Ninja && ninja -C build)" >&2
    exit 2
fi
echo "== all-reduce ($(hostname), $(nproc) cores)"
ranks=(2)
((np4)) && ranks+=(4)
for np in "${ranks[@]}"; do
    "${mpirun[@]}" --oversubscribe -np "$np" "$bench" --max "$max"
    echo
    if ((device)); then
        "${mpirun[@]}" -np "$np" --bind-to none "$bench" --max "$max" --device
        echo
    fi
done

# ---- part 2: training scaling ------------------------------------------------
# `spotune bench --preset small --steps 3 --json` prints one JSON object per
# mode (lora, full) with the whole job's throughput in "tokens_per_s".
((training)) || exit 0
echo "== training scaling (1 vs 2 ranks)"
spotune="$build/spotune"
if [[ ! -x "$spotune" ]] || ! "$spotune" bench --help >/dev/null 2>&1; then
    echo "training scaling: spotune bench not available yet"
    exit 0
fi

# "mode TOKENS_PER_S" per JSON line, sorted by mode.
tokens_per_s() {
    "${mpirun[@]}" --oversubscribe --bind-to none -np "$1" "$spotune" bench --preset small --steps 3 --warmup 1 \
        --micro-batch 4 --seq-len 256 --backend "${SPOTUNE_BENCH_BACKEND:-auto}" --json |
        sed -n 's/.*"mode":[[:space:]]*"\([a-z]*\)".*"tokens_per_s":[[:space:]]*\([-0-9.eE+]*\).*/\1 \2/p' |
        sort
}
one=$(tokens_per_s 1)
two=$(tokens_per_s 2)
if [[ -z "$one" || -z "$two" ]]; then
    echo "training scaling: spotune bench printed no tokens_per_s"
    exit 1
fi
join <(echo "$one") <(echo "$two") | awk '
    BEGIN { printf "%-6s %14s %14s %9s\n", "mode", "1 rank tok/s", "2 ranks tok/s", "ratio" }
    { printf "%-6s %14.1f %14.1f %8.2fx\n", $1, $2, $3, $3 / $2 }
    END { print "(ideal: 2.00x with a device per rank; 1.00x when 2 CPU ranks share the same cores)" }'
