#!/usr/bin/env bash
# gpu_check.sh — the one-shot check of spotune's CUDA backend on a GPU
# machine: run from the folder scripts/gpu_bundle.sh packs (copied there as
# gpu_check.sh), or from a build tree with --build. At most GPU_CHECK_BUDGET_S
# seconds of wall time (default 480, eight minutes: on an H200 everything
# but memcheck takes about 300 s, memcheck 130 s), enforced here: every step
# has its own time box, cut to what is left of the budget, and a step that
# cannot get at least 10 s is not started. Steps, most valuable first:
#
#   nvidia-smi (start)        GPU, driver, clocks, memory
#   CUDA op tests             test_cuda_ops: every op but RoPE and attention
#                             against the CPU backend; test_cuda_elementwise:
#                             the elementwise ops' vector paths bit for bit
#                             against their scalar kernels;
#                             test_cuda_attention: RoPE and attention, at the
#                             shapes of 7B, 8B (GQA), T 4096, the fused
#                             attention kernels on odd shapes (cuda_ops/flash_*)
#   layer test                test_cuda_layer: a decoder layer at the 7B shape,
#                             LoRA r 16 on all 7 projections, recompute none,
#                             attention and layer, against the CPU
#   model tests               test_cuda_model: HF fixtures one step (DoRA and
#                             QLoRA too), 50 LoRA steps and 8 each of QLoRA
#                             and DoRA of spotune train, against the CPU
#   NCCL and overlap tests    test_cuda_comm: grad_sync through a one-rank NCCL
#                             communicator, overlap on, the sharded collectives
#   bench small LoRA vs CPU   spotune bench, step 1 checked against the CPU
#   bench small full vs CPU   (both fail on a difference beyond tolerance)
#   bench 7B LoRA mb1         spotune bench llama-7b, seq 2048, r 16 all 7
#   HF PEFT 7B LoRA mb1       scripts/bench_hf_peft.py, same settings
#   attention workbench       attn_bench --iters 3 at its default shapes:
#                             fused against unfused attention, forward and
#                             backward, each checked against the CPU; the
#                             figure: the fused/unfused speedup at the 7B
#                             T 2048 shape (and the others), the fused
#                             backward with its stored dS against
#                             fused-recompute there, the forward and
#                             dK/dV by wgmma (fused-wgmma) against
#                             mma.sync there, cuDNN's (cudnn) against the
#                             fused kernels there, the worst error
#   elementwise workbench     elem_bench --iters 3: vector against scalar
#                             elementwise kernels; the figure: the
#                             geometric-mean vector/scalar speedup and
#                             whether the vector outputs are bit-identical
#                             (both tables follow the main one)
#   bench 13B LoRA mb1
#   bench 7B LoRA mb4
#   bench 7B LoRA mb8         retried with --recompute layer if it fails
#   bench 7B LoRA seq 8192    micro-batch 1: the fused attention keeps no
#                             T x T buffer, so the long sequence fits
#   bench small LoRA graphs   the small LoRA bench with --cuda-graphs on:
#                             each step one CUDA graph; FAIL when graphs
#                             were turned off (the reason) or never
#                             replayed; its speed against the eager row
#   bench 13B QLoRA mb1       --quantize nf4 --recompute layer: the 13B
#                             QLoRA run planned at 9.6 GiB (a 24 GB card);
#                             its peak memory and speed
#   spotune doctor            its GPU lines: devices, driver and runtime,
#                             ECC, clocks, bf16 GEMM TFLOP/s against the
#                             card's peak, device-memory copy GB/s, P2P
#                             between pairs, and with 2 GPUs or more (under
#                             mpirun, a rank per GPU) NCCL all-reduce bus
#                             bandwidth; each line a row of its own
#   HF PEFT 7B LoRA mb4       bench_hf_peft.py with the settings of the
#   HF PEFT 13B LoRA mb1      spotune rows 13, 12 and 15, each figure with
#   HF PEFT 7B LoRA seq 8192  spotune's ratio to it (after the doctor: the
#                             spotune rows and the checks come first)
#   bench 7B LoRA one by one  row 8 with SPOTUNE_LORA_BATCHED=0: each LoRA
#                             branch its own products, no batched group;
#                             row 8's speed against it says what batching
#                             the fused groups' LoRA gives
#   bench 7B seq 8192 dS      row 15 with SPOTUNE_CUDA_ATTENTION=fused-stored:
#                             the attention backward's dS stored in eleven
#                             chunks, where the default recomputes dQ; row
#                             15's speed against it says which is right
#   bench 7B attention wgmma  row 8 with SPOTUNE_CUDA_ATTENTION=fused-wgmma:
#                             the attention's kernels by Hopper warpgroup
#                             products; row 8's speed against it says
#                             whether they should be the default
#   bench 7B LoRA graphs      row 8 with --cuda-graphs on: each step one
#                             CUDA graph; its speed against row 8 says what
#                             the launches cost a 7B step (run 5: 116.8 ms
#                             of kernels in a 123.9 ms step); FAIL as row
#                             16's when graphs were turned off or never
#                             replayed
#   rank-r product workbench  mm_bench --iters 20: LoRA's rank-r products
#                             at the 7B shapes, the narrow ones (x A^T, dy
#                             B, dy^T xr, d(xr)^T x) by cuda_skinny.cu's
#                             kernels and the wide ones (xr B^T, d(xr) A)
#                             by cuda_wide.cu's, against cuBLASLt, each
#                             checked against the CPU; the figure:
#                             cuBLASLt's time over each kernel's, their
#                             geometric means, the worst error
#   bench 7B LoRA cuBLASLt    row 8 with SPOTUNE_CUDA_SKINNY=0 and
#                             SPOTUNE_CUDA_WIDE=0: LoRA's rank-r products
#                             by cuBLASLt; row 8's speed against it says
#                             what the kernels give a step
#   bench 7B attention cuDNN  row 8 with SPOTUNE_CUDA_ATTENTION=cudnn: the
#                             attention by cuDNN's fused attention
#                             (cuda_cudnn.cu; run right after the
#                             workbenches); row 8's speed against it says
#                             whether it should be the default; where cuDNN
#                             did not run, the figure says why
#   bench 7B cuDNN seq 8192   the same for row 15
#   bench small LoRA cuDNN    row 6 with it: the small model's step 1 by
#                             cuDNN's attention checked against the CPU
#   bench 7B cuDNN + graphs   row 28 with --cuda-graphs on: both opt-ins
#                             at once, against row 28
#   bench 13B cuDNN           row 12 with it
#   bench small packed cuDNN  row 30 on packed documents (--doc-len 300, as
#                             data.packing: documents gives them, the
#                             shipped configs' setting): cuDNN's ragged
#                             sequences, step 1 checked against the CPU
#   bench 7B packed           row 8 on packed documents (--doc-len 512), by
#                             the fused kernels
#   bench 7B packed cuDNN     the same by cuDNN's ragged sequences; row 34's
#                             speed against it says whether cuDNN should be
#                             the default for packed documents too (these
#                             three run right after row 30)
#   racecheck attention       compute-sanitizer --tool racecheck on the fused
#                             attention's tests (test_cuda_attention
#                             cuda_ops/flash_*, reduced shapes): shared-memory
#                             hazards in the hand-written cp.async and
#                             ldmatrix code; each hazard a FAIL
#   memcheck CUDA op tests    compute-sanitizer --tool memcheck on
#                             test_cuda_ops, test_cuda_elementwise and
#                             test_cuda_attention, reduced shapes; each error
#                             a row
#   nvidia-smi (end)
#
# Every bench fails on a step-1 loss that is not finite or is more than 1
# from what random weights give (ln(vocab) + 0.0002 hidden). MFU is given in
# two conventions: "honest", 4N per token for the frozen weights of LoRA, 6N
# for trainable weights (adapters included), plus attention; and the common
# 6N, 6 x every parameter per token. The Python peer runs with this machine's
# own LD_LIBRARY_PATH (the bundle's is for spotune's programs only); an
# import error is a FAIL row with its message.
#
# Without a usable CUDA device (spotune bench --probe-cuda says why) every GPU
# step is a SKIPPED row with that reason; the test programs still run and
# report their own skip. That is the dry run (tests/test_gpu_check.sh).
#
# Output: ONE table, a row for every step whatever happened (PASS, FAIL,
# TIMEOUT, SKIPPED, the time and the figure), printed at the end and written
# to $OUT/gpu_check_table.md (followed by the workbenches' own tables, when
# they ran), with $OUT/gpu_check.log (progress) and
# $OUT/gpu_check_outputs.tar.gz (every step's full output, nvidia-smi -q).
# Without OUT they stay in a temporary folder, named at the end.
#
# usage: gpu_check.sh [--build DIR] [--budget SECONDS] [--dry-run]
#   --build DIR       take spotune, the test programs and the workbenches
#                     (DIR/dev) from the build tree DIR (scripts and
#                     fixtures from this source tree)
#   --budget SECONDS  the wall-time budget (default $GPU_CHECK_BUDGET_S or 480)
#   --dry-run         hide every GPU (CUDA_VISIBLE_DEVICES=""): the whole
#                     script runs, every GPU step a SKIPPED row with its reason
#   --only KEYS       run only these steps (comma-separated: ops layer model
#                     comm small_lora small_full b7 hf7 attn_bench elem_bench
#                     b13 b7mb4 b7mb8 b7s8k graphs b13q doctor hf7mb4 hf13
#                     hf7s8k b7one b7s8ks b7wg b7graphs mm_bench b7cublas
#                     b7cudnn b7s8kcudnn small_cudnn b7cudnng b13cudnn
#                     small_pkcudnn b7pk b7pkcudnn racecheck memcheck), e.g.
#                     a rerun after a fix; the others are OMITTED rows, which
#                     count as neither failed nor skipped (nvidia-smi always runs)
# Environment: OUT, GPU_CHECK_BUDGET_S, GPU_CHECK_PYTHON (default python3),
#   GPU_CHECK_BOX_SCALE (multiplies every step's box; tests use it).
# Exit: 0 every step passed; 1 a step failed or timed out; 77 nothing failed
# but some step was skipped (no GPU, no budget left, no compute-sanitizer).
set -uo pipefail

START=$(date +%s)
HERE=$(cd "$(dirname "$0")" && pwd)
BUILD=""
DRY=0
ONLY=""
BUDGET=${GPU_CHECK_BUDGET_S:-480}
PY=${GPU_CHECK_PYTHON:-python3}
SCALE=${GPU_CHECK_BOX_SCALE:-1}
RESERVE=15 # for nvidia-smi at the end, the table and the archive
MIN_STEP=10

while [ $# -gt 0 ]; do
    case "$1" in
    --build) BUILD=$(cd "$2" && pwd) || exit 2; shift 2 ;;
    --build=*) BUILD=$(cd "${1#*=}" && pwd) || exit 2; shift ;;
    --budget) BUDGET=$2; shift 2 ;;
    --budget=*) BUDGET=${1#*=}; shift ;;
    --dry-run) DRY=1; shift ;;
    --only) ONLY=$2; shift 2 ;;
    --only=*) ONLY=${1#*=}; shift ;;
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument '$1'" >&2; exit 2 ;;
    esac
done
case "$BUDGET" in ''|*[!0-9]*) echo "gpu_check.sh: the budget must be whole seconds" >&2; exit 2 ;; esac

if [ "$DRY" = 1 ]; then
    export CUDA_VISIBLE_DEVICES="" # CUDA then reports no device (or no driver)
fi

WORK=$(mktemp -d "${TMPDIR:-/tmp}/spotune-gpu-check-XXXXXX")
DEST=${OUT:-$WORK}
mkdir -p "$DEST" "$WORK/out"
LOG="$DEST/gpu_check.log"
TABLE="$DEST/gpu_check_table.md"
PARTS="$WORK/out"
: > "$LOG"

say() { echo "$*" | tee -a "$LOG"; }
elapsed() { echo $(($(date +%s) - START)); }
left() { echo $((BUDGET - RESERVE - $(elapsed))); }

# The machine's own library path, before the bundle's environment: for Python.
ORIG_LD_SET=${LD_LIBRARY_PATH+set}
ORIG_LD=${LD_LIBRARY_PATH-}

# ---- where the programs are ------------------------------------------------------------
if [ -n "$BUILD" ]; then
    SRC=$(cd "$HERE/.." && pwd)
    SPOTUNE="$BUILD/spotune"
    TESTS="$BUILD/tests"
    DEV="$BUILD/dev"
    HF_SCRIPT="$SRC/scripts/bench_hf_peft.py"
    BUILD_INFO="build tree $BUILD, source $(git -C "$SRC" rev-parse --short HEAD 2>/dev/null || echo unknown)"
else
    # shellcheck source=/dev/null
    if ! source "$HERE/env.sh"; then
        say "gpu_check: could not set up the bundle's environment ($HERE/env.sh)"
        exit 1
    fi
    SPOTUNE="$HERE/bin/spotune"
    TESTS="$HERE/bin"
    DEV="$HERE/bin"
    HF_SCRIPT="$HERE/scripts/bench_hf_peft.py"
    BUILD_INFO=$(sed -n '2,5p' "$HERE/BUILD.txt" 2>/dev/null | tr '\n' ';' | sed 's/;$//')
fi

# ---- the rows --------------------------------------------------------------------------
# Every step is a row from the start, "not reached" until it runs, so no
# outcome can drop a row.
R_NAME=() R_RES=() R_SECS=() R_FIG=()
row_new() { # row_new NAME -> index in $ROW
    ROW=${#R_NAME[@]}
    R_NAME+=("$1") R_RES+=("SKIPPED") R_SECS+=("-") R_FIG+=("not reached: the ${BUDGET}s budget ran out")
}
# The table, written again whenever a row changes (so a run cut short, by
# its caller's time limit or the machine, still leaves the rows it reached);
# FINAL=1 for the last write.
FINAL=0
write_table() {
    {
        echo "spotune GPU check, $(date -u '+%Y-%m-%d'); GPU: ${GPU:-unknown}; $BUILD_INFO"
        if [ "$FINAL" = 1 ]; then
            echo "wall time ${TOTAL}s of a ${BUDGET}s budget; MFU honest: 4N/token for frozen weights, 6N for trainable ones, plus attention; 6N: 6 x every parameter per token"
        else
            echo "PARTIAL: the check was still running after $(elapsed)s of a ${BUDGET}s budget (this table is written again after each step)"
        fi
        echo
        echo "| # | step | result | s | figure |"
        echo "| ---: | --- | --- | ---: | --- |"
        for ((k = 0; k < ${#R_NAME[@]}; k++)); do
            echo "| $((k + 1)) | ${R_NAME[$k]} | ${R_RES[$k]} | ${R_SECS[$k]} | ${R_FIG[$k]} |"
        done
    } > "$TABLE.tmp" && mv "$TABLE.tmp" "$TABLE"
}
row_set() { # row_set INDEX RESULT SECS FIGURE
    R_RES[$1]=$2 R_SECS[$1]=$3
    R_FIG[$1]=$(printf '%s' "$4" | tr '\n|' ' /' | sed 's/  */ /g; s/ $//' | cut -c1-800)
    write_table
}

declare -A IDX
for s in smi_start ops layer model comm small_lora small_full b7 hf7 attn_bench elem_bench b13 b7mb4 b7mb8 b7s8k graphs b13q doctor \
    hf7mb4 hf13 hf7s8k b7one b7s8ks b7wg b7graphs mm_bench b7cublas b7cudnn b7s8kcudnn small_cudnn b7cudnng \
    b13cudnn small_pkcudnn b7pk b7pkcudnn racecheck memcheck smi_end; do
    case $s in
    smi_start) n="nvidia-smi (start): GPU, driver, clocks, memory" ;;
    ops) n="CUDA op tests (test_cuda_ops, test_cuda_elementwise, test_cuda_attention: real attention shapes)" ;;
    layer) n="layer test (test_cuda_layer: 7B layer, LoRA r16 x7, recompute none/attention/layer)" ;;
    model) n="model tests (test_cuda_model: HF fixtures incl. DoRA and QLoRA, LoRA/QLoRA/DoRA runs vs CPU)" ;;
    comm) n="NCCL and overlap tests (test_cuda_comm: one-rank NCCL, grad_sync, sharded collectives)" ;;
    small_lora) n="bench small LoRA mb1 seq 2048, step 1 vs CPU" ;;
    small_full) n="bench small full mb1 seq 2048, step 1 vs CPU" ;;
    b7) n="bench llama-7b LoRA r16 mb1 seq 2048" ;;
    hf7) n="HF PEFT llama-7b LoRA r16 mb1 seq 2048 (bench_hf_peft.py)" ;;
    attn_bench) n="attention workbench (attn_bench: fused vs unfused, fwd+bwd, vs CPU)" ;;
    elem_bench) n="elementwise workbench (elem_bench: vector vs scalar kernels, vs CPU)" ;;
    b13) n="bench llama-13b LoRA r16 mb1 seq 2048" ;;
    b7mb4) n="bench llama-7b LoRA r16 mb4 seq 2048" ;;
    b7mb8) n="bench llama-7b LoRA r16 mb8 seq 2048" ;;
    b7s8k) n="bench llama-7b LoRA r16 mb1 seq 8192" ;;
    graphs) n="bench small LoRA mb1 seq 2048, CUDA graphs (runtime.cuda_graphs)" ;;
    b13q) n="bench llama-13b QLoRA (NF4) r16 mb1 seq 2048, recompute layer" ;;
    doctor) n="spotune doctor: GPU lines (devices, ECC, clocks, bf16 GEMM, memory copy, P2P)" ;;
    hf7mb4) n="HF PEFT llama-7b LoRA r16 mb4 seq 2048 (bench_hf_peft.py)" ;;
    hf13) n="HF PEFT llama-13b LoRA r16 mb1 seq 2048 (bench_hf_peft.py)" ;;
    hf7s8k) n="HF PEFT llama-7b LoRA r16 mb1 seq 8192 (bench_hf_peft.py)" ;;
    b7one) n="bench llama-7b LoRA r16 mb1 seq 2048, LoRA one by one (SPOTUNE_LORA_BATCHED=0)" ;;
    b7s8ks) n="bench llama-7b LoRA r16 mb1 seq 8192, dS stored in chunks (SPOTUNE_CUDA_ATTENTION=fused-stored)" ;;
    b7wg) n="bench llama-7b LoRA r16 mb1 seq 2048, attention by wgmma (SPOTUNE_CUDA_ATTENTION=fused-wgmma)" ;;
    b7graphs) n="bench llama-7b LoRA r16 mb1 seq 2048, CUDA graphs (runtime.cuda_graphs)" ;;
    mm_bench) n="rank-r product workbench (mm_bench: LoRA's rank-r products, skinny and wide kernels vs cuBLASLt, vs CPU)" ;;
    b7cublas) n="bench llama-7b LoRA r16 mb1 seq 2048, rank-r products by cuBLASLt (SPOTUNE_CUDA_SKINNY=0 SPOTUNE_CUDA_WIDE=0)" ;;
    b7cudnn) n="bench llama-7b LoRA r16 mb1 seq 2048, attention by cuDNN (SPOTUNE_CUDA_ATTENTION=cudnn)" ;;
    b7s8kcudnn) n="bench llama-7b LoRA r16 mb1 seq 8192, attention by cuDNN (SPOTUNE_CUDA_ATTENTION=cudnn)" ;;
    small_cudnn) n="bench small LoRA mb1 seq 2048, attention by cuDNN (SPOTUNE_CUDA_ATTENTION=cudnn), step 1 vs CPU" ;;
    b7cudnng) n="bench llama-7b LoRA r16 mb1 seq 2048, attention by cuDNN and CUDA graphs" ;;
    b13cudnn) n="bench llama-13b LoRA r16 mb1 seq 2048, attention by cuDNN (SPOTUNE_CUDA_ATTENTION=cudnn)" ;;
    small_pkcudnn) n="bench small LoRA mb1 seq 2048, packed documents, attention by cuDNN (SPOTUNE_CUDA_ATTENTION=cudnn), step 1 vs CPU" ;;
    b7pk) n="bench llama-7b LoRA r16 mb1 seq 2048, packed documents" ;;
    b7pkcudnn) n="bench llama-7b LoRA r16 mb1 seq 2048, packed documents, attention by cuDNN (SPOTUNE_CUDA_ATTENTION=cudnn)" ;;
    racecheck) n="compute-sanitizer racecheck on the fused attention tests (reduced shapes)" ;;
    memcheck) n="compute-sanitizer memcheck on the CUDA op tests (reduced shapes)" ;;
    smi_end) n="nvidia-smi (end): GPU, driver, clocks, memory" ;;
    esac
    row_new "$n"
    IDX[$s]=$ROW
done
# --only: every key known; the rest OMITTED from the start
if [ -n "$ONLY" ]; then
    for k in ${ONLY//,/ }; do
        case $k in smi_start | smi_end) k="" ;; esac
        if [ -n "$k" ] && [ -z "${IDX[$k]:-}" ]; then
            echo "gpu_check.sh: --only: no step '$k' (the keys are in --help)" >&2
            exit 2
        fi
    done
    for k in "${!IDX[@]}"; do
        case ",$ONLY,smi_start,smi_end," in
        *",$k,"*) ;;
        *) R_RES[${IDX[$k]}]=OMITTED R_FIG[${IDX[$k]}]="not selected (--only $ONLY)" ;;
        esac
    done
fi
want() { # want KEY: whether the step KEY is to run
    [ -z "$ONLY" ] && return 0
    case ",$ONLY," in *",$1,"*) return 0 ;; esac
    return 1
}
write_table

# ---- running one step ---------------------------------------------------------------------
# step KEY BOX CMD...: runs CMD in $PARTS/KEY.out for at most min(BOX x SCALE,
# time left) seconds. Sets RC (124 timed out, 125 not started) and DT.
step() {
    local key=$1 box=$2
    shift 2
    local l limit
    l=$(left)
    limit=$(awk -v b="$box" -v s="$SCALE" 'BEGIN { printf "%d", b * s + 0.5 }')
    [ "$limit" -lt 1 ] && limit=1
    if [ "$l" -lt "$MIN_STEP" ] || [ "$l" -lt 1 ]; then
        RC=125 DT=0
        say "-- $key: not started, ${l}s of the budget left"
        return
    fi
    [ "$limit" -gt "$l" ] && limit=$l
    LIMIT=$limit
    local t0
    t0=$(date +%s)
    say "-- $key: $* (at most ${limit}s)"
    timeout -k 5 "$limit" "$@" > "$PARTS/$key.out" 2>&1
    RC=$?
    DT=$(($(date +%s) - t0))
    [ $RC -eq 137 ] && RC=124
    say "   exit $RC after ${DT}s"
}

# The last line that says what went wrong.
why_failed() {
    local f=$1 l
    l=$(grep -E "error|Error|ERROR|Assertion|FAIL|Traceback|No module|cannot|not found" "$f" |
        grep -v "^\[====\]" | tail -n 3 | tr '\n' ' ')
    [ -n "$l" ] || l=$(tail -n 2 "$f" | tr '\n' ' ')
    printf '%s' "$l"
}

# bash $EACH CMD... -- PROGRAM...: runs CMD PROGRAM --jobs 1 for each program
# in turn (CMD may be empty), so that one step runs several Criterion
# suites; exits with the first status that is neither 0 nor 77, else 77 when
# one was skipped, else 0.
EACH="$WORK/each.sh"
cat > "$EACH" <<'EOF_EACH'
cmd=()
while [ "$1" != -- ]; do cmd+=("$1"); shift; done
shift
rc=0
for p; do
    "${cmd[@]}" "$p" --jobs 1
    r=$?
    if [ $r -ne 0 ] && [ $r -ne 77 ]; then
        case $rc in 0 | 77) rc=$r ;; esac
    elif [ $r -eq 77 ] && [ $rc -eq 0 ]; then
        rc=77
    fi
done
exit $rc
EOF_EACH

# Criterion's synthesis lines in FILE, summed field by field ("Tested: 30 |
# Passing: 30 | Failing: 0 | Crashing: 0" for two suites of 21 and 9 tests).
synthesis() { # synthesis FILE
    grep -h "Synthesis" "$1" | sed 's/.*Synthesis: //' | awk -F' [|] ' '
        { for (f = 1; f <= NF; f++) {
              split($f, kv, ": "); k = kv[1]; gsub(/^ +| +$/, "", k)
              if (k == "") continue
              if (!(k in sum)) order[++n] = k
              sum[k] += kv[2] } }
        END { for (f = 1; f <= n; f++) printf "%s%s: %d", (f > 1 ? " | " : ""), order[f], sum[order[f]] }'
}

# Criterion suites as one step: PASS when they all exit 0, SKIPPED when one
# exits 77 (its reason) and none fails, FAIL or TIMEOUT else, with their
# synthesis summed as the figure.
suite() { # suite KEY BOX PROGRAM...
    local key=$1 box=$2 i=${IDX[$1]} syn fails prog
    shift 2
    for prog in "$@"; do
        if [ ! -x "$prog" ]; then
            row_set "$i" FAIL 0 "$prog is missing"
            return
        fi
    done
    step "$key" "$box" bash "$EACH" -- "$@"
    [ $RC -eq 125 ] && { row_set "$i" SKIPPED 0 "not started: the budget ran out"; return; }
    syn=$(synthesis "$PARTS/$key.out")
    fails=$(grep -hE "^\[(FAIL|CRASH)\]|\[----\].*(Assertion|rel err|differs|> )" "$PARTS/$key.out" |
        head -n 3 | tr '\n' ' ')
    case $RC in
    0) row_set "$i" PASS "$DT" "${syn:-passed}" ;;
    77) row_set "$i" SKIPPED "$DT" "$(grep -h "skipped" "$PARTS/$key.out" | tail -1)" ;;
    124) row_set "$i" TIMEOUT "$DT" "killed after ${LIMIT}s; ${syn:-no synthesis}; $fails" ;;
    *) row_set "$i" FAIL "$DT" "exit $RC; ${syn:-no synthesis}; ${fails:-$(why_failed "$PARTS/$key.out")}" ;;
    esac
}

jget() { # jget KEY JSON: a number or string field of a flat JSON object
    printf '%s' "$2" | sed -n "s/.*\"$1\": *\"\{0,1\}\([^,\"}]*\).*/\1/p"
}

declare -A BENCH # key -> its JSON line
bench_figure() { # bench_figure JSON
    local j=$1
    awk -v t="$(jget tokens_per_s "$j")" -v s="$(jget step_s "$j")" \
        -v p="$(jget peak_mem_bytes "$j")" -v m="$(jget mfu "$j")" -v m6="$(jget mfu_6n "$j")" \
        -v l="$(jget step1_loss "$j")" -v g="$(jget step1_grad_norm "$j")" \
        -v e="$(jget expected_loss "$j")" -v cl="$(jget cpu_step1_loss "$j")" \
        -v cg="$(jget cpu_step1_grad_norm "$j")" -v pt="$(jget profiled_step_ms "$j")" \
        -v sg="$(jget gemm "$j")" -v sl="$(jget lora "$j")" -v sa="$(jget attention "$j")" \
        -v se="$(jget elementwise "$j")" -v so="$(jget optimizer "$j")" \
        -v sc="$(jget communication "$j")" 'BEGIN {
        printf "%.0f tok/s, step %.3f s, peak %.1f GiB, MFU honest %s / 6N %s; step 1 loss %.4f (random weights: %.3f +- 1), grad norm %.4g",
            t, s, p / 2^30, (m >= 0 ? sprintf("%.1f%%", 100 * m) : "-"),
            (m6 >= 0 ? sprintf("%.1f%%", 100 * m6) : "-"), l, e, g
        if (cl != "") printf "; CPU step 1: loss %.4f, grad norm %.4g", cl, cg
        if (pt > 0) printf "; one step %.1f ms: GEMM %.0f%%, LoRA %.0f%%, attention %.0f%%, elementwise %.0f%%, optimizer %.0f%%, comm %.0f%%",
            pt, 100 * sg / pt, 100 * sl / pt, 100 * sa / pt, 100 * se / pt, 100 * so / pt, 100 * sc / pt }'
}

NO_GPU="" # why no CUDA device is usable, when none is
# one bench: VAR=value words it runs with, the row it is compared with, its
# further options (--doc-len N)
BENCH_ENV="" BENCH_VS="" BENCH_ARGS=""
bench() { # bench KEY BOX PRESET MODE MB STEPS [RECOMPUTE [SEQ [GRAPHS_VS]]]
    # MODE lora, full or qlora (LoRA on NF4 weights: --quantize nf4)
    # GRAPHS_VS: with --cuda-graphs on, against that eager row's tokens/s
    local key=$1 box=$2 preset=$3 mode=$4 mb=$5 steps=$6 rcm=${7:-none} seq=${8:-2048}
    local vs=${9:-} i=${IDX[$1]} json env_set=$BENCH_ENV env_vs=$BENCH_VS args_set=$BENCH_ARGS
    BENCH_ENV="" BENCH_VS="" BENCH_ARGS=""
    local extra=()
    [ -n "$vs" ] && extra=(--cuda-graphs on)
    # shellcheck disable=SC2206 # BENCH_ARGS's words, each an option or its value
    [ -n "$args_set" ] && extra+=($args_set)
    if [ "$mode" = qlora ]; then
        mode=lora
        extra+=(--quantize nf4)
    fi
    if [ -n "$NO_GPU" ]; then
        row_set "$i" SKIPPED 0 "$NO_GPU"
        return
    fi
    # shellcheck disable=SC2086 # BENCH_ENV's words, each a VAR=value
    step "$key" "$box" env $env_set "$SPOTUNE" bench --backend cuda \
        --preset "$preset" --mode "$mode" --micro-batch "$mb" --seq-len "$seq" --steps "$steps" \
        --warmup 1 --lora-r 16 --recompute "$rcm" --json "${extra[@]}"
    [ $RC -eq 125 ] && { row_set "$i" SKIPPED 0 "not started: the budget ran out"; return; }
    json=$(grep '^{' "$PARTS/$key.out" | tail -1)
    local note="" fell
    [ "$rcm" != none ] && note="recompute $rcm; "
    # asked for cuDNN's attention and not given it: the reason (cuda_cudnn.cu)
    fell=$(grep -m1 '^spotune: attention by cuDNN' "$PARTS/$key.out" | sed 's/^[^:]*: [^:]*: //')
    if [ -n "$env_vs" ] && [ $RC -eq 0 ]; then
        local other
        other=$(jget tokens_per_s "${BENCH[$env_vs]:-}")
        if [ -n "$other" ]; then
            note="${env_set:+$env_set; }row $((${IDX[$env_vs]} + 1)) is $(awk -v a="$other" \
                -v b="$(jget tokens_per_s "$json")" 'BEGIN { printf "%.3fx", a / b }') this; "
        else
            note="${env_set:+$env_set; }no row $((${IDX[$env_vs]} + 1)) to compare; "
        fi
    fi
    if [ -n "$vs" ] && [ $RC -eq 0 ]; then
        local off reps base upd
        off=$(jget graph_off "$json") reps=$(jget graph_replays "$json")
        base=$(jget tokens_per_s "${BENCH[$vs]:-}")
        upd=$(jget graph_update_replays "$json")
        note="graphs: ${reps:-no} step(s) replayed one ($(jget graph_ops "$json") ops)${upd:+, $upd update(s) replayed one}"
        [ -n "$base" ] && note="$note, $(awk -v a="$(jget tokens_per_s "$json")" -v b="$base" \
            'BEGIN { printf "%.2fx", a / b }') the eager row's tok/s"
        note="$note; "
        if [ -n "$off" ] || [ "${reps:-0}" = 0 ]; then
            row_set "$i" FAIL "$DT" "graphs ${off:+turned off: $off}${off:-never replayed}; $(bench_figure "$json")"
            return
        fi
    fi
    local dl=${args_set#*--doc-len }
    [ "$dl" != "$args_set" ] && note="packed documents of ~${dl%% *} tokens; $note"
    [ -n "$fell" ] && note="cuDNN DID NOT RUN: $fell; $note"
    case $RC in
    0) BENCH[$key]=$json; row_set "$i" PASS "$DT" "$note$(bench_figure "$json")" ;;
    124) # how far it got: bench's last progress line (stderr)
        local last
        last=$(grep '^bench: ' "$PARTS/$key.out" | tail -1)
        row_set "$i" TIMEOUT "$DT" "${note}killed after ${LIMIT}s${last:+; last: ${last#bench: }}" ;;
    *) row_set "$i" FAIL "$DT" "${note}exit $RC: $(why_failed "$PARTS/$key.out")${json:+; $(bench_figure "$json")}" ;;
    esac
}

smi() { # smi KEY
    local key=$1 i=${IDX[$1]}
    if [ "$DRY" = 1 ]; then
        row_set "$i" SKIPPED 0 "dry run: the GPUs are hidden, nvidia-smi is not asked"
        return
    fi
    if ! command -v nvidia-smi >/dev/null 2>&1; then
        row_set "$i" SKIPPED 0 "nvidia-smi not found"
        return
    fi
    step "$key" 20 nvidia-smi \
        --query-gpu=name,driver_version,pstate,clocks.sm,clocks.mem,clocks.max.sm,memory.used,memory.total,temperature.gpu,power.draw \
        --format=csv
    [ $RC -eq 125 ] && { row_set "$i" SKIPPED 0 "not started: the budget ran out"; return; }
    timeout 20 nvidia-smi -q > "$PARTS/$key-q.out" 2>&1
    case $RC in
    0) row_set "$i" PASS "$DT" "$(sed -n '2,$p' "$PARTS/$key.out" | head -n 2 | tr '\n' ' ')" ;;
    124) row_set "$i" TIMEOUT "$DT" "nvidia-smi hung" ;;
    *) row_set "$i" FAIL "$DT" "exit $RC: $(tail -n 2 "$PARTS/$key.out" | tr '\n' ' ')" ;;
    esac
}

# ---- the kernel workbenches ---------------------------------------------------------------
# Their Markdown tables (kernels/cuda/dev/README.md): a row per shape and
# version (attn_bench) or shape, op and version (elem_bench), the last
# column ok, FAIL or "not checked".
wb_trim='function trim(x) { gsub(/^ +| +$/, "", x); return x }'

# attn_bench's figure: fused/unfused forward+backward at the 7B T 2048 shape,
# the fused backward's speedup from its stored dS (fused against
# fused-recompute), from the operands staged in shared memory (fused
# against fused-regs) and from warpgroup products (fused-wgmma against fused:
# its forward and dK/dV kernels), then the other shapes, the worst error,
# the rows' checks.
# shellcheck disable=SC2317 # called through workbench
attn_figure() { # attn_figure FILE
    awk -F'|' "$wb_trim"'
    $0 ~ /^\| *[0-9]+(,[0-9]+)+ *\|/ {
        sh = trim($2); v = trim($3); ver = v; sub(/ .*/, "", ver); st = trim($(NF - 1))
        n++; if (st == "ok") ok++; else if (st == "FAIL") bad++
        if (v ~ /fallback/) fb++
        if (!(sh in seen)) { seen[sh] = 1; order[++ns] = sh }
        f[sh, ver] = trim($4) + 0; b[sh, ver] = trim($5) + 0; tf[sh, ver] = trim($6) "/" trim($7)
        note[sh, ver] = v
        split(trim($8), e, / +/)
        if (e[2] !~ /^[0-9.]+e[-+][0-9]+$/) { nan = nan (nan == "" ? "" : ", ") sh " " v }
        else if (wn == "" || e[2] + 0 > worst) { worst = e[2] + 0; wn = e[1] " at " sh " " v }
    }
    function speedup(sh) {
        if (f[sh, "fused"] + b[sh, "fused"] <= 0 || f[sh, "unfused"] + b[sh, "unfused"] <= 0) return "-"
        return sprintf("%.2fx", (f[sh, "unfused"] + b[sh, "unfused"]) / (f[sh, "fused"] + b[sh, "fused"]))
    }
    END {
        if (n == 0) { printf "no table rows"; exit }
        k = "1,2048,32,32,128"; sep = ""
        if (k in seen) {
            printf "fused/unfused fwd+bwd at 7B T 2048 (%s): %s (", k, speedup(k)
            if ((k, "fused") in f)
                printf "fused %.3f+%.3f ms, %s TFLOP/s%s%s", f[k, "fused"], b[k, "fused"], tf[k, "fused"],
                    (note[k, "fused"] ~ /fallback/ ? ", fell back" : ""), ((k, "unfused") in f ? "; " : "")
            if ((k, "unfused") in f) printf "unfused %.3f+%.3f ms", f[k, "unfused"], b[k, "unfused"]
            printf ")"
            r = "fused-recompute"
            if ((k, "fused") in b && (k, r) in b && b[k, "fused"] > 0)
                printf "; bwd with stored dS %.3f ms, recomputing dQ %.3f ms (%.2fx)", b[k, "fused"], b[k, r], b[k, r] / b[k, "fused"]
            r = "fused-regs"
            if ((k, "fused") in f && (k, r) in f && f[k, "fused"] > 0 && b[k, "fused"] > 0)
                printf "; operands staged fwd %.3f, bwd %.3f ms, in registers %.3f, %.3f (%.2fx, %.2fx)", f[k, "fused"], b[k, "fused"], f[k, r], b[k, r], f[k, r] / f[k, "fused"], b[k, r] / b[k, "fused"]
            w = "fused-wgmma"
            if ((k, w) in f && note[k, w] ~ /mma\.sync/) printf "; wgmma: not run (not sm_90)"
            else if ((k, "fused") in f && (k, w) in f && f[k, w] > 0 && b[k, w] > 0)
                printf "; wgmma fwd %.3f, bwd %.3f ms against mma.sync %.3f, %.3f (%.2fx, %.2fx)", f[k, w], b[k, w], f[k, "fused"], b[k, "fused"], f[k, "fused"] / f[k, w], b[k, "fused"] / b[k, w]
            w = "cudnn"
            if ((k, w) in f && note[k, w] ~ /did not run/) printf "; cuDNN: NOT RUN (fused)"
            else if ((k, "fused") in f && (k, w) in f && f[k, w] > 0 && b[k, w] > 0)
                printf "; cuDNN fwd %.3f, bwd %.3f ms against fused %.3f, %.3f (%.2fx, %.2fx)", f[k, w], b[k, w], f[k, "fused"], b[k, "fused"], f[k, "fused"] / f[k, w], b[k, "fused"] / b[k, w]
            sep = "; other shapes: "
        } else sep = "fused/unfused fwd+bwd: "
        for (i = 1; i <= ns; i++) if (order[i] != k) { printf "%s%s %s", sep, order[i], speedup(order[i]); sep = ", " }
        if (wn != "") printf "; worst rel err %.2e (%s)", worst, wn
        if (nan != "") printf "; error not a number: %s", nan
        printf "; %d rows: %d ok, %d FAIL", n, ok, bad
        if (n - ok - bad) printf ", %d not checked", n - ok - bad
        if (fb) printf ", %d fallback", fb
    }' "$1"
}

# elem_bench's figure: the geometric-mean vector/scalar speedup over the
# op-shapes the vector path takes, whether the vector outputs are bit for
# bit the scalar ones, the worst error, the rows' checks.
# shellcheck disable=SC2317 # called through workbench
elem_figure() { # elem_figure FILE
    awk -F'|' "$wb_trim"'
    $0 ~ /^\| *[0-9]+ x [0-9]+ *\|/ {
        sh = trim($2); op = trim($3); v = trim($4); ms = trim($5) + 0; st = trim($(NF - 1))
        n++; if (st == "ok") ok++; else if (st == "FAIL") bad++
        e = trim($7)
        if (e !~ /^[0-9.]+e[-+][0-9]+$/) nan++
        else if (e + 0 > worst) worst = e + 0
        if (v == "scalar") { sms[sh, op] = ms; next }
        same = trim($8)
        if (same == "yes") yes++
        else { no++; if (no <= 3) nolist = nolist (no > 1 ? ", " : "") op " " sh }
        if (v ~ /fallback/) { fb++; next }
        if (sms[sh, op] > 0 && ms > 0) {
            r = sms[sh, op] / ms; lsum += log(r); nr++
            if (nr == 1 || r < rmin) { rmin = r; wmin = op " " sh }
            if (nr == 1 || r > rmax) { rmax = r; wmax = op " " sh }
        }
    }
    END {
        if (n == 0) { printf "no table rows"; exit }
        if (nr) printf "vector/scalar geometric-mean speedup %.2fx over %d op-shapes (from %.2fx, %s, to %.2fx, %s)",
            exp(lsum / nr), nr, rmin, wmin, rmax, wmax
        else printf "no vector/scalar speedup (no timed vector row)"
        if (fb) printf "; %d vector rows fell back (not counted)", fb
        if (no == 0 && yes > 0) printf "; bit-identical to scalar (%d vector rows)", yes
        else printf "; NOT bit-identical: %d of %d vector rows differ (%s%s)", no, yes + no, nolist, (no > 3 ? ", ..." : "")
        printf "; worst rel err %.2e", worst
        if (nan) printf " (%d not a number)", nan
        printf "; %d rows: %d ok, %d FAIL", n, ok, bad
        if (n - ok - bad) printf ", %d not checked", n - ok - bad
    }' "$1"
}

# mm_bench's figure: its summary lines (cuBLASLt's time over the skinny
# kernels', then over the wide kernel's, each product and the geometric
# mean), the worst error, the rows' checks.
# shellcheck disable=SC2317 # called through workbench
mm_figure() { # mm_figure FILE
    awk -F'|' "$wb_trim"'
    $0 ~ /^\| *[a-zA-Z_]+ *\| *[0-9]+,[0-9]+,[0-9]+ x [0-9]+ *\|/ {
        n++; st = trim($(NF - 1)); if (st == "ok") ok++; else if (st == "FAIL") bad++
        e = trim($8); sub(/^\(no check\) /, "", e)
        if (e !~ /^[0-9.]+e[-+][0-9]+$/) nan++
        else if (e + 0 > worst) { worst = e + 0; wn = trim($2) " " trim($5) }
    }
    /^cuBLASLt time \/ skinny time:/ { sub(/^cuBLASLt time \/ skinny time: */, ""); ratio = $0 }
    /^cuBLASLt time \/ wide time:/ { sub(/^cuBLASLt time \/ wide time: */, ""); wratio = $0 }
    END {
        if (n == 0) { printf "no table rows"; exit }
        if (ratio != "") printf "cuBLASLt time / skinny kernel time: %s", ratio
        else printf "no cuBLASLt/skinny ratio"
        if (wratio != "") printf "; cuBLASLt time / wide kernel time: %s", wratio
        else printf "; no cuBLASLt/wide ratio"
        if (wn != "") printf "; worst rel err %.2e (%s)", worst, wn
        if (nan) printf " (%d not a number)", nan
        printf "; %d rows: %d ok, %d FAIL", n, ok, bad
        if (n - ok - bad) printf ", %d not checked", n - ok - bad
    }' "$1"
}

# The FAIL rows of a workbench table, named by their columns but the timings.
wb_fails() { # wb_fails FILE
    awk -F'|' "$wb_trim"'
    /^\|/ && !hdr { for (c = 2; c < NF; c++) h[c] = trim($c); hdr = 1; next }
    /^\|/ && trim($(NF - 1)) == "FAIL" {
        d = ""
        for (c = 2; c < NF - 1; c++) {
            if (h[c] ~ /ms|TFLOP|GB|^us$/) continue
            x = trim($c); gsub(/  +/, " ", x)
            d = d (d == "" ? "" : " ") (h[c] ~ /err|scalar/ ? h[c] " " : "") x
        }
        if (++n <= 3) s = s (n > 1 ? "; " : "") d
    }
    END { if (n) printf "%d FAIL row%s: %s%s", n, (n > 1 ? "s" : ""), s, (n > 3 ? "; ..." : "") }' "$1"
}

# A workbench as one step: PASS when it exits 0 (its table's figure), FAIL
# with its FAIL rows and messages on any other exit, SKIPPED when it exits
# 77 (its reason) or without a GPU, TIMEOUT. Its table goes after the main
# one in gpu_check_table.md; its whole output is KEY.out in the outputs.
WB_RAN=() # the keys whose table is appended
declare -A WB_CMD
workbench() { # workbench KEY BOX FIGURE_FUNCTION PROGRAM ARGS...
    local key=$1 box=$2 figfn=$3 prog=$4 i=${IDX[$1]} name fig fails msgs
    shift 3
    name=$(basename "$prog")
    if [ -n "$NO_GPU" ]; then
        row_set "$i" SKIPPED 0 "$NO_GPU"
        return
    fi
    if [ ! -x "$prog" ]; then
        row_set "$i" FAIL 0 "$prog is missing (a build with SPOTUNE_KERNEL_BENCH=OFF?)"
        return
    fi
    step "$key" "$box" "$@"
    [ $RC -eq 125 ] && { row_set "$i" SKIPPED 0 "not started: the budget ran out"; return; }
    shift
    WB_CMD[$key]="$name $*"
    grep -q '^|' "$PARTS/$key.out" && WB_RAN+=("$key")
    fig=$("$figfn" "$PARTS/$key.out")
    fails=$(wb_fails "$PARTS/$key.out")
    msgs=$(grep -h "^$name: " "$PARTS/$key.out" | tail -n 2 | tr '\n' ' ')
    case $RC in
    0) row_set "$i" PASS "$DT" "$fig" ;;
    77) row_set "$i" SKIPPED "$DT" "${msgs:-exit 77: $(tail -n 1 "$PARTS/$key.out")}" ;;
    124) row_set "$i" TIMEOUT "$DT" "killed after ${LIMIT}s; so far: $fig" ;;
    *)
        [ -n "$fails$msgs" ] || msgs=$(why_failed "$PARTS/$key.out")
        row_set "$i" FAIL "$DT" "exit $RC: ${fails}${fails:+${msgs:+; }}${msgs}; $fig"
        ;;
    esac
}

# ---- the run ----------------------------------------------------------------------------
say "spotune GPU check, $(date -u '+%Y-%m-%d %H:%M UTC'), budget ${BUDGET}s$([ "$DRY" = 1 ] && echo ", dry run: CUDA_VISIBLE_DEVICES=\"\"")"
say "programs: $BUILD_INFO"
smi smi_start
GPU=$(sed -n '2p' "$PARTS/smi_start.out" 2>/dev/null | cut -d, -f1,2)

if ! "$SPOTUNE" bench --probe-cuda > "$PARTS/probe.out" 2>&1; then
    NO_GPU=$(sed -n 's/^spotune: error: //p' "$PARTS/probe.out" | tail -1)
    [ -n "$NO_GPU" ] || NO_GPU="spotune bench --probe-cuda failed: $(tail -n 1 "$PARTS/probe.out")"
fi
say "CUDA: $(if [ -n "$NO_GPU" ]; then echo "$NO_GPU"; else cat "$PARTS/probe.out"; fi)"

# the CUDA op tests: every op, the elementwise vector paths, then RoPE and attention
OP_TESTS=("$TESTS/test_cuda_ops" "$TESTS/test_cuda_elementwise" "$TESTS/test_cuda_attention")
want ops && suite ops 120 "${OP_TESTS[@]}"
want layer && suite layer 90 "$TESTS/test_cuda_layer"
want model && suite model 90 "$TESTS/test_cuda_model"
want comm && suite comm 45 "$TESTS/test_cuda_comm"
want small_lora && bench small_lora 45 small lora 1 10
want small_full && bench small_full 45 small full 1 10
want b7 && bench b7 60 llama-7b lora 1 5

# HF PEFT on the same GPU, with this machine's own library path: hf KEY BOX
# PRESET MB SEQ OURS (OURS: the spotune bench row of the same settings,
# whose tokens/s the figure divides by HF's)
hf() {
    local key=$1 box=$2 preset=$3 mb=$4 seq=$5 ours_key=$6 i=${IDX[$1]} json ours fig
    if [ -n "$NO_GPU" ]; then
        row_set "$i" SKIPPED 0 "$NO_GPU"
        return
    fi
    if [ "$ORIG_LD_SET" = set ]; then PYENV=(env "LD_LIBRARY_PATH=$ORIG_LD"); else PYENV=(env -u LD_LIBRARY_PATH); fi
    step "$key" "$box" "${PYENV[@]}" PYTHONUNBUFFERED=1 "$PY" "$HF_SCRIPT" --preset "$preset" --mode lora \
        --micro-batch "$mb" --seq-len "$seq" --steps 5 --warmup 1 --lora-r 16 --device cuda \
        --dtype bfloat16
    json=$(grep '^{' "$PARTS/$key.out" | tail -1)
    case $RC in
    125) row_set "$i" SKIPPED 0 "not started: the budget ran out" ;;
    124) row_set "$i" TIMEOUT "$DT" "killed after ${LIMIT}s" ;;
    0)
        ours=${BENCH[$ours_key]:-}
        fig=$(awk -v t="$(jget tokens_per_s "$json")" -v s="$(jget step_s "$json")" \
            -v p="$(jget peak_mem_bytes "$json")" -v l="$(jget step1_loss "$json")" \
            -v tv="$(jget torch "$json")" -v pv="$(jget peft "$json")" \
            -v ot="$(jget tokens_per_s "$ours")" -v om="$(jget mfu "$ours")" \
            -v om6="$(jget mfu_6n "$ours")" -v row="$((${IDX[$ours_key]} + 1))" 'BEGIN {
            printf "%.0f tok/s, step %.3f s, peak %.1f GiB", t, s, p / 2^30
            if (ot > 0 && om >= 0) printf ", MFU honest %.1f%% / 6N %.1f%% (spotune'"'"'s FLOPs per token)", 100 * om * t / ot, 100 * om6 * t / ot
            if (ot > 0) printf "; spotune (row %d) is %.2fx this", row, ot / t
            else printf "; no spotune row %d to compare", row
            printf "; step 1 loss %.4f; torch %s, peft %s", l, tv, pv }')
        row_set "$i" PASS "$DT" "$fig"
        ;;
    *) row_set "$i" FAIL "$DT" "exit $RC: $(why_failed "$PARTS/$key.out")" ;;
    esac
}
want hf7 && hf hf7 90 llama-7b 1 2048 b7

# the kernel workbenches: attention versions, then elementwise versions
# (75 s: cuDNN's row builds its graphs, and may compile its kernels, first)
want attn_bench && workbench attn_bench 75 attn_figure "$DEV/attn_bench" --iters 3
want elem_bench && workbench elem_bench 30 elem_figure "$DEV/elem_bench" --iters 3
# row 8 with the attention by cuDNN (docs/cuda.md, "Attention by cuDNN"; not
# yet the default): early, as the largest change a lease can measure
if want b7cudnn; then
    BENCH_ENV=SPOTUNE_CUDA_ATTENTION=cudnn BENCH_VS=b7
    bench b7cudnn 60 llama-7b lora 1 5
fi
# the same with each step one CUDA graph: both opt-ins together
if want b7cudnng; then
    BENCH_ENV=SPOTUNE_CUDA_ATTENTION=cudnn
    bench b7cudnng 60 llama-7b lora 1 5 none 2048 b7cudnn
fi
# and a whole small training step by it, step 1 checked against the CPU
if want small_cudnn; then
    BENCH_ENV=SPOTUNE_CUDA_ATTENTION=cudnn BENCH_VS=small_lora
    bench small_cudnn 45 small lora 1 10
fi
# packed documents (data.packing: documents, the shipped configs'): the
# small step by cuDNN's ragged sequences against the CPU, then 7B by the
# fused kernels and by cuDNN
if want small_pkcudnn; then
    BENCH_ENV=SPOTUNE_CUDA_ATTENTION=cudnn BENCH_ARGS="--doc-len 300"
    bench small_pkcudnn 45 small lora 1 10
fi
if want b7pk; then
    BENCH_VS=b7 BENCH_ARGS="--doc-len 512"
    bench b7pk 60 llama-7b lora 1 5
fi
if want b7pkcudnn; then
    BENCH_ENV=SPOTUNE_CUDA_ATTENTION=cudnn BENCH_VS=b7pk BENCH_ARGS="--doc-len 512"
    bench b7pkcudnn 60 llama-7b lora 1 5
fi

want b13 && bench b13 75 llama-13b lora 1 5
if want b13cudnn; then
    BENCH_ENV=SPOTUNE_CUDA_ATTENTION=cudnn BENCH_VS=b13
    bench b13cudnn 75 llama-13b lora 1 5
fi
want b7mb4 && bench b7mb4 45 llama-7b lora 4 5
want b7mb8 && bench b7mb8 90 llama-7b lora 8 5
if [ "${R_RES[${IDX[b7mb8]}]}" = FAIL ] && [ "$(left)" -ge 60 ]; then
    say "   llama-7b micro-batch 8 failed: again with --recompute layer"
    mv "$PARTS/b7mb8.out" "$PARTS/b7mb8-recompute-none.out"
    first=${R_FIG[${IDX[b7mb8]}]}
    bench b7mb8 90 llama-7b lora 8 5 layer
    R_FIG[${IDX[b7mb8]}]="${R_FIG[${IDX[b7mb8]}]}; recompute none had failed: ${first:0:150}"
fi
want b7s8k && bench b7s8k 60 llama-7b lora 1 3 none 8192
if want b7s8kcudnn; then
    BENCH_ENV=SPOTUNE_CUDA_ATTENTION=cudnn BENCH_VS=b7s8k
    bench b7s8kcudnn 60 llama-7b lora 1 3 none 8192
fi
want graphs && bench graphs 45 small lora 1 10 none 2048 small_lora
want b13q && bench b13q 75 llama-13b qlora 1 3 layer

# spotune doctor: its GPU lines, each a row of its own (a SKIPPED one is named
# in the doctor's row, not a row: one GPU has no pairs, one rank no NCCL test)
i=${IDX[doctor]}
if ! want doctor; then
    :
elif [ -n "$NO_GPU" ]; then
    row_set "$i" SKIPPED 0 "$NO_GPU"
else
    # with two GPUs or more and mpirun, a rank per GPU: the NCCL line too
    NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
    if [ "${NGPU:-0}" -ge 2 ] && command -v mpirun >/dev/null 2>&1; then
        step doctor 90 env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
            mpirun -np "$NGPU" "$SPOTUNE" doctor --cloud none --io-mib 16
    else
        step doctor 60 "$SPOTUNE" doctor --cloud none --io-mib 16
    fi
    case $RC in
    125) row_set "$i" SKIPPED 0 "not started: the budget ran out" ;;
    124) row_set "$i" TIMEOUT "$DT" "killed after ${LIMIT}s" ;;
    0 | 1)
        gpu_lines=$(grep -E '^(PASS|WARN|FAIL|SKIPPED) +gpu' "$PARTS/doctor.out")
        gpu_fail=$(grep -cE '^FAIL +gpu' <<<"$gpu_lines")
        skipped=$(awk '$1 == "SKIPPED" { printf "%s%s", s, $2; s = ", " }' <<<"$gpu_lines")
        summary="$(grep -cE '^(PASS|WARN|FAIL)' <<<"$gpu_lines") GPU lines, $gpu_fail FAIL${skipped:+; skipped: $skipped}; $(tail -n 1 "$PARTS/doctor.out")"
        if [ -z "$gpu_lines" ]; then
            row_set "$i" FAIL "$DT" "exit $RC, no GPU line: $(why_failed "$PARTS/doctor.out")"
        elif [ "$gpu_fail" -gt 0 ]; then
            row_set "$i" FAIL "$DT" "$summary"
        else
            row_set "$i" PASS "$DT" "$summary"
        fi
        while read -r st name fig; do
            case $st in PASS | WARN | FAIL) ;; *) continue ;; esac
            row_new "doctor $name"
            row_set "$ROW" "$st" "-" "$fig"
        done <<<"$gpu_lines"
        ;;
    *) row_set "$i" FAIL "$DT" "exit $RC: $(why_failed "$PARTS/doctor.out")" ;;
    esac
fi

# HF PEFT at the other settings the issue's table compares (after the
# checks: a short budget spends itself on spotune first)
want hf7mb4 && hf hf7mb4 60 llama-7b 4 2048 b7mb4
want hf13 && hf hf13 90 llama-13b 1 2048 b13
want hf7s8k && hf hf7s8k 75 llama-7b 1 8192 b7s8k
# row 8 with each LoRA branch on its own: what batching gives
if want b7one; then
    BENCH_ENV=SPOTUNE_LORA_BATCHED=0 BENCH_VS=b7
    bench b7one 60 llama-7b lora 1 5
fi
# row 15 with the attention's dS stored in chunks: whether recomputing dQ
# there (the default at seq 8192) is the faster choice
if want b7s8ks; then
    BENCH_ENV=SPOTUNE_CUDA_ATTENTION=fused-stored BENCH_VS=b7s8k
    bench b7s8ks 60 llama-7b lora 1 3 none 8192
fi
# row 8 with the attention's forward, dK/dV and dQ kernels by wgmma: what
# they give a step (docs/cuda.md, "The wgmma kernels"; not yet the default)
if want b7wg; then
    BENCH_ENV=SPOTUNE_CUDA_ATTENTION=fused-wgmma BENCH_VS=b7
    bench b7wg 60 llama-7b lora 1 5
fi
# row 8 with each step one CUDA graph: what the launches cost a 7B step
want b7graphs && bench b7graphs 60 llama-7b lora 1 5 none 2048 b7
# LoRA's narrow products by the skinny kernel against cuBLASLt, alone and
# in a 7B step (docs/cuda.md, "Narrow products")
want mm_bench && workbench mm_bench 30 mm_figure "$DEV/mm_bench" --iters 20
if want b7cublas; then
    BENCH_ENV="SPOTUNE_CUDA_SKINNY=0 SPOTUNE_CUDA_WIDE=0" BENCH_VS=b7
    bench b7cublas 60 llama-7b lora 1 5
fi

SAN=$(command -v compute-sanitizer 2>/dev/null || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
san_ready() { # san_ready KEY: 0 when compute-sanitizer step KEY is to run, else its row set
    local i=${IDX[$1]}
    want "$1" || return 1
    if [ -n "$NO_GPU" ]; then
        row_set "$i" SKIPPED 0 "$NO_GPU"
    elif [ -z "$SAN" ]; then
        row_set "$i" SKIPPED 0 "compute-sanitizer not found (PATH, /usr/local/cuda*/bin)"
    else
        return 0
    fi
    return 1
}
# compute-sanitizer's racecheck on the fused attention's own tests (their
# staged tiles, double buffers and barriers), the odd shapes and packed
# documents; "RACECHECK SUMMARY: N hazards displayed (E errors, W warnings)"
# per test process
i=${IDX[racecheck]}
if san_ready racecheck; then
    step racecheck 60 env SPOTUNE_TEST_SHAPES=reduced "$SAN" --tool racecheck --error-exitcode 3 \
        "$TESTS/test_cuda_attention" --jobs 1 --filter 'cuda_ops/flash*'
    nhz=$(sed -n 's/.*RACECHECK SUMMARY: \([0-9][0-9]*\) hazard.*/\1/p' "$PARTS/racecheck.out" |
        awk '{ s += $1 } END { print s + 0 }')
    first=$(grep -m1 -E '^========= (Error|Warning): ' "$PARTS/racecheck.out" | cut -c11-200)
    syn=$(synthesis "$PARTS/racecheck.out")
    case $RC in
    125) row_set "$i" SKIPPED 0 "not started: the budget ran out" ;;
    0) row_set "$i" PASS "$DT" "$nhz hazards; ${syn:-}" ;;
    124) row_set "$i" TIMEOUT "$DT" "killed after ${LIMIT}s; $nhz hazards so far${first:+: $first}" ;;
    *) row_set "$i" FAIL "$DT" "exit $RC, $nhz hazards${first:+: $first}; ${syn:-}" ;;
    esac
fi

# compute-sanitizer's memcheck with what is left
i=${IDX[memcheck]}
if ! san_ready memcheck; then
    :
elif [ "$(left)" -lt 30 ]; then
    row_set "$i" SKIPPED 0 "not started: $(left)s of the budget left, 30 s needed"
else
    # --report-api-errors no: the tests fail some CUDA calls on purpose (a
    # 256 TiB cudaMalloc, a synchronisation inside a capture); memory errors
    # are what this row is for
    # the fused attention first (the hand-written shared-memory and
    # cp.async code), then the elementwise kernels, then every other op:
    # a run cut short has checked the likeliest first (on an H200 the three
    # took more than 83 s together)
    MEM_TESTS=("$TESTS/test_cuda_attention" "$TESTS/test_cuda_elementwise" "$TESTS/test_cuda_ops")
    step memcheck "$(left)" env SPOTUNE_TEST_SHAPES=reduced bash "$EACH" "$SAN" --tool memcheck \
        --report-api-errors no --error-exitcode 3 -- "${MEM_TESTS[@]}"
    nerr=$(sed -n 's/.*ERROR SUMMARY: \([0-9][0-9]*\) error.*/\1/p' "$PARTS/memcheck.out" |
        awk '{ s += $1 } END { print s + 0 }')
    ndone=$(grep -c 'ERROR SUMMARY:' "$PARTS/memcheck.out")
    syn=$(synthesis "$PARTS/memcheck.out")
    case $RC in
    0) row_set "$i" PASS "$DT" "0 errors; ${syn:-}" ;;
    124) row_set "$i" TIMEOUT "$DT" "killed after ${LIMIT}s; $nerr errors so far, $ndone of 3 programs finished (attention, elementwise, ops, in that order)" ;;
    *) row_set "$i" FAIL "$DT" "exit $RC, $nerr errors; ${syn:-}" ;;
    esac
    # each kind of error found, a row of its own
    # ("========= Invalid __global__ read of size 4 bytes" and the kernel on
    # the next "=========     at NAME+0x..." line)
    awk '/^========= [A-Z]/ && !/ERROR SUMMARY|COMPUTE-SANITIZER/ {
             if (what != "") n[what]++
             what = substr($0, 11); next }
         /^=========  +at / && what != "" {
             k = $0; sub(/^=========  +at /, "", k); sub(/\+0x[0-9a-f]+.*/, "", k)
             n[what " in " k]++; what = ""; next }
         END { if (what != "") n[what]++; for (w in n) printf "%d\t%s\n", n[w], w }' \
        "$PARTS/memcheck.out" | sort -rn | head -n 10 > "$WORK/memcheck-kinds"
    while IFS=$'\t' read -r count what; do
        row_new "memcheck error: $what"
        row_set "$ROW" FAIL "-" "$count occurrences (see memcheck.out)"
    done < "$WORK/memcheck-kinds"
fi

RESERVE=0
smi smi_end

# ---- the table ------------------------------------------------------------------------------
TOTAL=$(elapsed)
FINAL=1
write_table
# the workbenches' own tables after it
for key in ${WB_RAN[@]+"${WB_RAN[@]}"}; do
    {
        echo
        echo "${R_NAME[${IDX[$key]}]%% (*}: \`${WB_CMD[$key]}\` (${R_RES[${IDX[$key]}]}; full output: out/$key.out in the outputs)"
        echo
        awk '/^device:/ { print; print ""; next } /^\|/' "$PARTS/$key.out"
    } >> "$TABLE"
done
say ""
tee -a "$LOG" < "$TABLE"
say ""

FAILED=0 SKIPPED=0
for r in "${R_RES[@]}"; do
    case $r in FAIL|TIMEOUT) FAILED=1 ;; SKIPPED) SKIPPED=1 ;; esac
done
if [ -n "${OUT:-}" ]; then
    tar -C "$WORK" -czf "$OUT/gpu_check_outputs.tar.gz" out
    rm -rf "$WORK"
fi
say "total $(elapsed)s; table, log and outputs in $DEST"
[ $FAILED -eq 1 ] && exit 1
[ $SKIPPED -eq 1 ] && exit 77
exit 0
