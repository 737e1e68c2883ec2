#!/usr/bin/env bash
# gpu_profile.sh — where the CUDA backend's time goes, on a GPU machine with
# Nsight Compute (ncu): run from the folder scripts/gpu_bundle.sh packs
# (copied there as gpu_profile.sh), or from a build tree with --build. Three
# parts, each optional:
#
#   attention   ncu on the fused attention's kernels (forward, dK/dV, dQ
#               from the stored dS, and dQ recomputing, from attn_bench's
#               fused-recompute version; at head dim 128 the forward and
#               dK/dV with their operands in registers too, from its
#               fused-regs version; the first three also by wgmma,
#               from its fused-wgmma version) inside attn_bench at one shape:
#               duration, registers, occupancy, warp stalls
#               (ncu_<kernel>.txt whole, a summary line each)
#   step        every kernel of one training step of spotune bench with its
#               duration (ncu --metrics gpu__time_duration.sum), summed by
#               kernel and by group (scripts/kernel_shares.py): ncu runs the
#               kernels one at a time with the caches flushed, so read the
#               shares, not the milliseconds
#   modules     attn_bench's fused rows with each of several builds of the
#               CUDA module (SPOTUNE_CUDA_MODULE), the same shapes and
#               inputs: how a kernel change compares, before and after, in
#               one call (build each libspotune_cuda.so here, copy them in)
#   source      ncu's source view of named attention kernels inside
#               attn_bench: the warp-stall samples of each SASS instruction,
#               summed by scripts/stall_lines.py into the top lines (where
#               the warps wait: a copy's wait, a product's, a barrier), with
#               src_<kernel>.csv whole
#
# usage: gpu_profile.sh [--build DIR] [--attention] [--step PRESET] [--modules A.so,B.so]
#                       [--source KERNEL,...] [--shape B,T,nh,nkv,hd] [--box SECONDS]
#   no part named: --attention --step llama-7b
#   --shape      the attention shape (default 1,2048,32,32,128: Llama-2-7B)
#   --box        each ncu run's time limit (default 120 s)
# Output: in $OUT (or a temporary folder, printed): the ncu files,
#   step.csv, and gpu_profile.md with every summary (also printed).
# Environment: OUT; GPU_PROFILE_NCU (the ncu to run; set and empty: none).
# Exit: 0 done; 1 a part failed; 2 usage; 77 no ncu, or attn_bench found
#   no usable GPU (nothing measured).
set -uo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
BUILD=""
PARTS=()
PRESET=llama-7b
MODULES=""
SOURCES=""
SHAPE=1,2048,32,32,128
BOX=120
while [ $# -gt 0 ]; do
    case "$1" in
    --build) BUILD=$(cd "$2" && pwd) || exit 2; shift 2 ;;
    --attention) PARTS+=(attention); shift ;;
    --step) PARTS+=(step); PRESET=$2; shift 2 ;;
    --modules) PARTS+=(modules); MODULES=$2; shift 2 ;;
    --source) PARTS+=(source); SOURCES=$2; shift 2 ;;
    --shape) SHAPE=$2; shift 2 ;;
    --box) BOX=$2; shift 2 ;;
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu_profile.sh: unknown argument '$1'" >&2; exit 2 ;;
    esac
done
case "$BOX" in ''|*[!0-9]*) echo "gpu_profile.sh: --box must be whole seconds" >&2; exit 2 ;; esac
[ ${#PARTS[@]} -eq 0 ] && PARTS=(attention step)

if [ -n "$BUILD" ]; then
    SPOTUNE="$BUILD/spotune" ATTN="$BUILD/dev/attn_bench"
    SHARES="$(cd "$HERE/.." && pwd)/scripts/kernel_shares.py"
    STALLS="$(cd "$HERE/.." && pwd)/scripts/stall_lines.py"
else
    # shellcheck source=/dev/null
    source "$HERE/env.sh" || { echo "gpu_profile.sh: could not set up the bundle's environment" >&2; exit 1; }
    SPOTUNE="$HERE/bin/spotune" ATTN="$HERE/bin/attn_bench" SHARES="$HERE/scripts/kernel_shares.py"
    STALLS="$HERE/scripts/stall_lines.py"
fi
if [ -n "${GPU_PROFILE_NCU+set}" ]; then # the tests: a stand-in, or "" for none
    NCU=$GPU_PROFILE_NCU
else
    NCU=$(command -v ncu 2>/dev/null || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
fi
need_ncu=0
for p in "${PARTS[@]}"; do [ "$p" != modules ] && need_ncu=1; done
if [ "$need_ncu" = 1 ] && [ -z "$NCU" ]; then
    echo "gpu_profile.sh: skipped: no ncu (Nsight Compute) on PATH, in /usr/local/cuda*/bin or /opt/nvidia/nsight-compute" >&2
    exit 77
fi
DEST=${OUT:-$(mktemp -d "${TMPDIR:-/tmp}/spotune-gpu-profile-XXXXXX")}
mkdir -p "$DEST"
MD="$DEST/gpu_profile.md"
: > "$MD"
say() { echo "$*" | tee -a "$MD"; }
FAILED=0 SKIPPED=0

# the value of an ncu details line ("    Duration   us   586.50" -> "586.50 us")
metric() { awk -v k="$1" 'index($0, k) && !seen { n = NF; print $n, $(n - 1); seen = 1 }' "$2"; }

for part in "${PARTS[@]}"; do
    case $part in
    attention)
        say "## the fused attention's kernels at $SHAPE (ncu)"
        say ""
        say "| kernel | duration | registers | achieved occupancy | top stalls (cycles an instruction) |"
        say "| --- | ---: | ---: | ---: | --- |"
        kernels=(flash_forward_kernel flash_dkdv_kernel flash_dq_stored_kernel flash_dq_kernel
            flash_forward_wgmma_kernel flash_dkdv_wgmma_kernel flash_dq_stored_wgmma_kernel)
        # head dim 128: the forward's and dK/dV's variants with their
        # operands in registers (template argument 0), by their full names
        [ "${SHAPE##*,}" = 128 ] && kernels+=("flash_forward_kernel<128, 0>" "flash_dkdv_kernel<128, 0>")
        for k in "${kernels[@]}"; do
            f="$DEST/ncu_$(printf '%s' "$k" | tr -c 'A-Za-z0-9_\n' '_').txt"
            case $k in
            *"<"*) sel=(--kernel-name-base demangled -k "regex:$k") ;;
            *) sel=(-k "regex:^$k") ;;
            esac
            # the second launch: the first is attn_bench's warm-up (of its
            # fused version; flash_dq_kernel runs in fused-recompute only,
            # the <128, 0> variants in fused-regs, the *_wgmma_kernel ones
            # in fused-wgmma on an sm_90 GPU only)
            timeout "$BOX" "$NCU" --clock-control none --section SpeedOfLight --section Occupancy \
                --section LaunchStats --section WarpStateStats --section SchedulerStats \
                --print-details all "${sel[@]}" --launch-skip 1 --launch-count 1 \
                "$ATTN" --shape "$SHAPE" --iters 1 --no-check > "$f" 2>&1
            rc=$?
            if [ $rc -ne 0 ] || ! grep -q "Duration" "$f"; then
                say "| $k | FAIL (exit $rc: $(grep -m1 -iE 'error|fail' "$f" | cut -c1-120)) | | | |"
                FAILED=1
                continue
            fi
            # "    Stall Short Scoreboard    inst    1.15": the three largest
            stalls=$(awk '/^ +Stall [A-Z]/ && !seen[$0]++ {
                    name = $2; for (i = 3; i <= NF - 2; i++) name = name " " $i
                    if (!(name in v)) v[name] = $NF }
                END { for (n in v) print v[n] "\t" n }' "$f" |
                sort -t$'\t' -k1,1gr | head -n 3 | awk -F'\t' '{ printf "%s%s %s", sep, $2, $1; sep = "; " }')
            say "| $k | $(metric Duration "$f") | $(metric "Registers Per Thread" "$f" | cut -d' ' -f1) | $(metric "Achieved Occupancy" "$f") | $stalls |"
        done
        say ""
        ;;
    step)
        say "## one $PRESET LoRA step, kernel by kernel (ncu; shares, the caches flushed between kernels)"
        say ""
        timeout $((BOX * 3)) "$NCU" --clock-control none --metrics gpu__time_duration.sum --csv \
            --print-units base "$SPOTUNE" bench --backend cuda --preset "$PRESET" --mode lora \
            --micro-batch 1 --seq-len 2048 --steps 1 --warmup 0 --lora-r 16 --recompute none \
            --json > "$DEST/step.csv" 2> "$DEST/step.err"
        rc=$?
        if [ $rc -ne 0 ]; then
            say "FAIL: ncu on spotune bench exited $rc: $(tail -n 2 "$DEST/step.err" | tr '\n' ' ')"
            FAILED=1
        elif ! python3 "$SHARES" "$DEST/step.csv" >> "$MD" 2> "$DEST/shares.err"; then
            say "FAIL: kernel_shares.py: $(cat "$DEST/shares.err")"
            FAILED=1
        else
            sed -n '/^## one/,$p' "$MD" | tail -n +3
        fi
        say ""
        ;;
    source)
        say "## where the warps wait, by instruction, at $SHAPE (ncu's source view)"
        say ""
        for k in ${SOURCES//,/ }; do
            f="$DEST/src_$k.csv"
            # the second launch, as above
            timeout "$BOX" "$NCU" --clock-control none --section WarpStateStats \
                --section SourceCounters --page source --print-source sass --csv \
                -k "regex:^$k" --launch-skip 1 --launch-count 1 \
                "$ATTN" --shape "$SHAPE" --iters 1 --no-check > "$f" 2>&1
            rc=$?
            if [ $rc -ne 0 ]; then
                say "FAIL: $k: ncu exited $rc: $(grep -m1 -iE 'error|fail' "$f" | cut -c1-120)"
                FAILED=1
            elif ! python3 "$STALLS" "$f" > "$DEST/stalls.out" 2>&1; then
                say "FAIL: $k: $(cat "$DEST/stalls.out")"
                FAILED=1
            else
                tee -a "$MD" < "$DEST/stalls.out"
            fi
            say ""
        done
        ;;
    modules)
        say "## attn_bench's fused rows with each CUDA module"
        say ""
        for mod in ${MODULES//,/ }; do
            if [ ! -f "$mod" ]; then
                say "FAIL: $mod: no such file"
                FAILED=1
                continue
            fi
            say "$mod ($(md5sum < "$mod" | cut -c1-8)):"
            SPOTUNE_CUDA_MODULE=$(cd "$(dirname "$mod")" && pwd)/$(basename "$mod") \
                timeout "$BOX" "$ATTN" --shape "$SHAPE" --iters 20 --no-check > "$DEST/modules.out" 2>&1
            rc=$?
            grep '| fused' "$DEST/modules.out" | tee -a "$MD"
            if [ $rc -eq 77 ]; then # no usable device: its reason
                say "SKIPPED: $(tail -n 1 "$DEST/modules.out")"
                SKIPPED=1
            elif [ $rc -ne 0 ]; then
                say "FAIL: attn_bench exited $rc: $(tail -n 1 "$DEST/modules.out")"
                FAILED=1
            fi
        done
        say ""
        ;;
    esac
done
echo "gpu_profile: $MD" >&2
[ $FAILED = 1 ] && exit 1
[ $SKIPPED = 1 ] && exit 77
exit 0
