#!/usr/bin/env bash
# gpu_check.sh — the GPU checks of spotune's CUDA backend, run from the
# folder scripts/gpu_bundle.sh packs (copied there as gpu_check.sh), on a
# machine with an NVIDIA GPU and the CUDA 13 runtime libraries:
#
#   1. test_cuda_ops     every CUDA op against the CPU backend
#   2. test_cuda_model   a model step CUDA vs CPU, 50 LoRA steps CUDA vs CPU
#   3. spotune bench     small (LoRA and full), llama-7b LoRA (r 16, all 7
#                        projections, seq 2048, micro-batch 1 and 8),
#                        llama-13b LoRA; random weights, bf16
#   4. HF PEFT           scripts/bench_hf_peft.py on the same GPU for the
#                        small preset (and llama-7b micro-batch 1 if time
#                        is left), when python3 imports torch, transformers
#                        and peft and torch sees the GPU
#
# then prints one table (tokens/s, step time, peak memory, MFU, ratio to HF
# PEFT). Every part has its own time limit and the whole run stays under
# GPU_CHECK_BUDGET_S (default 460 s); a part that fails or runs out of time
# is reported and the rest goes on. With $OUT set, three files are written
# there: gpu_check_table.md, gpu_check.log and gpu_check_outputs.tar.gz
# (every part's full output).
# Exit code: 0 when both test suites passed and every benchmark ran, 1 else.
set -uo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
cd "$HERE" || exit 1
BUDGET=${GPU_CHECK_BUDGET_S:-460}
START=$(date +%s)
WORK=$(mktemp -d "${TMPDIR:-/tmp}/spotune-gpu-check-XXXXXX")
DEST=${OUT:-$WORK}
mkdir -p "$DEST" "$WORK/out"
LOG="$DEST/gpu_check.log"
TABLE="$DEST/gpu_check_table.md"
PARTS="$WORK/out" # each part's output: NAME.out
: > "$LOG"
FAILED=0

say() { echo "$*" | tee -a "$LOG"; }
left() { echo $((BUDGET - ($(date +%s) - START))); }

# shellcheck source=/dev/null
if ! source ./env.sh; then
    say "gpu_check: could not set up the bundle's environment (env.sh)"
    exit 1
fi

# part NAME LIMIT_S MIN_S CMD...: runs CMD with at most min(LIMIT_S, time left)
# seconds; output in $PARTS/NAME.out; returns CMD's status (124: out of time,
# 125: skipped for lack of time).
part() {
    local name=$1 limit=$2 min=$3
    shift 3
    local l
    l=$(left)
    if [ "$l" -lt "$min" ]; then
        say "-- $name: skipped, ${l}s left of the ${BUDGET}s budget"
        return 125
    fi
    [ "$limit" -gt "$l" ] && limit=$l
    local t0 rc
    t0=$(date +%s)
    timeout -k 10 "$limit" "$@" > "$PARTS/$name.out" 2>&1
    rc=$?
    local dt=$(($(date +%s) - t0))
    if [ $rc -eq 0 ]; then
        say "-- $name: ok (${dt}s)"
    elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
        say "-- $name: TIMED OUT after ${limit}s"
    elif [ $rc -eq 77 ]; then
        say "-- $name: SKIPPED: $(tail -n 1 "$PARTS/$name.out")"
    else
        say "-- $name: FAILED (exit $rc, ${dt}s); last lines:"
        tail -n 15 "$PARTS/$name.out" | sed 's/^/   /' | tee -a "$LOG"
    fi
    return $rc
}

# ---- the machine ---------------------------------------------------------------------
GPU=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -1)
say "spotune GPU check, $(date -u '+%Y-%m-%d %H:%M UTC')"
say "GPU: ${GPU:-unknown (nvidia-smi failed)}"
sed -n '2,5p' BUILD.txt 2>/dev/null | sed 's/^/bundle /' | tee -a "$LOG"

# ---- 1-2: the test suites ------------------------------------------------------------
tests_ok=1
for t in test_cuda_ops:150 test_cuda_model:240; do
    name=${t%%:*} limit=${t##*:}
    part "$name" "$limit" 30 "bin/$name" --jobs 1
    rc=$?
    grep -h "Synthesis" "$PARTS/$name.out" | sed "s/^/   /" | tee -a "$LOG"
    grep -h "gradient cosine\|LoRA steps" "$PARTS/$name.out" | sed "s/^/   /" | tee -a "$LOG"
    [ $rc -eq 0 ] || tests_ok=0
done
[ $tests_ok -eq 1 ] || FAILED=1

# ---- 3: spotune bench ------------------------------------------------------------------
ROWS=() # "label|preset|mode|mb|recompute|json"

jget() { # jget KEY JSON: a number or string field of a flat JSON object
    printf '%s' "$2" | sed -n "s/.*\"$1\": *\"\{0,1\}\([^,\"}]*\).*/\1/p"
}

bench() { # bench LABEL LIMIT PRESET MODE MB RECOMPUTE [STEPS]
    local label=$1 limit=$2 preset=$3 mode=$4 mb=$5 rc_mode=$6 steps=${7:-5}
    local name="bench-$preset-$mode-mb$mb-$rc_mode"
    part "$name" "$limit" 40 spotune bench --backend cuda --preset "$preset" --mode "$mode" \
        --micro-batch "$mb" --seq-len 2048 --steps "$steps" --warmup 1 --lora-r 16 \
        --recompute "$rc_mode" --json
    local rc=$? json
    json=$(grep '^{' "$PARTS/$name.out" | tail -1)
    if [ $rc -eq 0 ] && [ -n "$json" ]; then
        ROWS+=("$label|$preset|$mode|$mb|$rc_mode|$json")
        return 0
    fi
    return 1
}

bench "small LoRA mb1" 60 small lora 1 none 10 || FAILED=1
bench "small full mb1" 60 small full 1 none 10 || FAILED=1
bench "7B LoRA mb1" 90 llama-7b lora 1 none || FAILED=1
if ! bench "7B LoRA mb8" 120 llama-7b lora 8 none; then
    say "   retrying llama-7b micro-batch 8 with --recompute layer"
    bench "7B LoRA mb8" 150 llama-7b lora 8 layer || FAILED=1
fi
bench "13B LoRA mb1" 120 llama-13b lora 1 none || FAILED=1

# ---- 4: Hugging Face PEFT on the same GPU -------------------------------------------------
declare -A HF # "preset|mode|mb" -> tokens_per_s|step_s|peak
hf_bench() { # hf_bench PRESET MODE MB LIMIT
    local preset=$1 mode=$2 mb=$3 limit=$4 dir="$WORK/model-$1"
    if [ ! -f "$dir/config.json" ]; then
        part "init-$preset" 240 60 spotune init-model --preset "$preset" --seed 1 --dtype bf16 "$dir" ||
            return 1
    fi
    local name="hf-$preset-$mode-mb$mb"
    part "$name" "$limit" 60 env PYTHONUNBUFFERED=1 python3 scripts/bench_hf_peft.py --model "$dir" \
        --mode "$mode" --micro-batch "$mb" --seq-len 2048 --steps 5 --warmup 1 --lora-r 16 \
        --device cuda --dtype bfloat16 || return 1
    local json
    json=$(grep '^{' "$PARTS/$name.out" | tail -1)
    [ -n "$json" ] || return 1
    HF["$preset|$mode|$mb"]="$(jget tokens_per_s "$json")|$(jget step_s "$json")|$(jget peak_mem_bytes "$json")"
}

if python3 -c 'import torch, transformers, peft, sys; sys.exit(0 if torch.cuda.is_available() else 1)' \
    > /dev/null 2>&1; then
    hf_bench small lora 1 120
    hf_bench small full 1 120
    if [ "$(left)" -gt 200 ]; then
        hf_bench llama-7b lora 1 150
    else
        say "-- HF PEFT llama-7b: skipped, $(left)s left"
    fi
    rm -rf "$WORK"/model-*
else
    say "-- HF PEFT: skipped (python3 cannot import torch, transformers and peft, or torch sees no GPU)"
fi

# ---- the table -------------------------------------------------------------------------------
{
    echo "| run | tokens/s | step s | peak GiB | MFU | vs HF PEFT |"
    echo "| --- | ---: | ---: | ---: | ---: | ---: |"
    for r in ${ROWS[@]+"${ROWS[@]}"}; do
        IFS='|' read -r label preset mode mb rcm json <<< "$r"
        tps=$(jget tokens_per_s "$json")
        step=$(jget step_s "$json")
        peak=$(jget peak_mem_bytes "$json")
        mfu=$(jget mfu "$json")
        hf=${HF["$preset|$mode|$mb"]:-}
        ratio="-"
        if [ -n "$hf" ]; then
            ratio=$(awk -v a="$tps" -v b="${hf%%|*}" 'BEGIN { if (b > 0) printf "%.2fx", a / b; else print "-" }')
        fi
        [ "$rcm" != none ] && label="$label (recompute $rcm)"
        awk -v l="spotune $label" -v t="$tps" -v s="$step" -v p="$peak" -v m="$mfu" -v r="$ratio" \
            'BEGIN { printf "| %s | %.0f | %.3f | %.1f | %s | %s |\n", l, t, s, p / 2^30,
                     (m >= 0 ? sprintf("%.1f%%", 100 * m) : "-"), r }'
        if [ -n "$hf" ]; then
            IFS='|' read -r htps hstep hpeak <<< "$hf"
            awk -v l="HF PEFT $preset $mode mb$mb" -v t="$htps" -v s="$hstep" -v p="$hpeak" \
                -v m="$mfu" -v ours="$tps" \
                'BEGIN { printf "| %s | %.0f | %.3f | %.1f | %s | 1.00x |\n", l, t, s, p / 2^30,
                         (m >= 0 && ours > 0 ? sprintf("%.1f%%", 100 * m * t / ours) : "-") }'
        fi
    done
} > "$TABLE.tmp"
say ""
say "GPU: ${GPU:-unknown}; seq_len 2048, LoRA r 16 on all 7 projections, bf16; MFU from"
say "spotune's FLOPs per token (HF PEFT's MFU: the same FLOPs at its tokens/s)"
tee -a "$LOG" < "$TABLE.tmp"
{
    echo "GPU: ${GPU:-unknown}, $(date -u '+%Y-%m-%d')"
    echo
    cat "$TABLE.tmp"
} > "$TABLE"
rm -f "$TABLE.tmp"
say ""
if [ -n "${OUT:-}" ]; then
    tar -C "$WORK" -czf "$OUT/gpu_check_outputs.tar.gz" out
    rm -rf "$WORK"
fi
say "total $(($(date +%s) - START))s; tests $([ $tests_ok -eq 1 ] && echo passed || echo FAILED);" \
    "table, log and outputs in ${OUT:-$WORK}"
exit $FAILED
