#!/usr/bin/env bash
# tests/test_gpu_profile.sh — scripts/gpu_profile.sh, the profile of the CUDA
# backend on a GPU machine, in a bundle-shaped folder of stand-ins:
#  1. without ncu: exit 77 and why, nothing measured;
#  2. with a stand-in ncu that prints real Nsight Compute output (the
#     fixtures: an H200's details of the dK/dV kernel, and an excerpt of the
#     per-kernel durations of a 7B LoRA step): the attention table (the
#     fixture's duration, registers, occupancy and three largest stalls, the
#     three kernels), the step's kernel shares (scripts/kernel_shares.py's
#     table), ncu asked for the right kernel, launch and metrics, everything
#     in $OUT/gpu_profile.md, exit 0;
#  3. --modules: attn_bench run with each module as SPOTUNE_CUDA_MODULE
#     (an absolute path) and its fused rows kept; a missing module a FAIL
#     line and exit 1; no usable GPU a SKIPPED line with attn_bench's
#     reason, exit 77; an ncu that fails: a FAIL row, exit 1;
#  4. --source: ncu's source view of each named kernel inside attn_bench,
#     summed by scripts/stall_lines.py (the fixture: an H100's wgmma
#     forward) into gpu_profile.md; a kernel whose ncu fails a FAIL line;
#  5. a bad argument: exit 2.
# usage: tests/test_gpu_profile.sh
set -uo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source=tests/check.sh
source "$here/tests/check.sh" # $tmp, check, has

b="$tmp/bundle"
mkdir -p "$b/bin" "$b/scripts"
cp "$here/scripts/gpu_profile.sh" "$b/"
cp "$here/scripts/kernel_shares.py" "$here/scripts/stall_lines.py" "$b/scripts/"
echo 'export PATH="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/bin:$PATH"' > "$b/env.sh"
cat > "$b/bin/attn_bench" <<'EOS'
#!/usr/bin/env bash
if [ -n "${FAKE_NO_GPU:-}" ]; then
    echo "attn_bench: runtime.backend: cuda requested but no CUDA device is usable: cudaGetDeviceCount: no CUDA-capable device"
    exit 77
fi
echo "device: stand-in"
echo "| $2 | fused    |     0.166 |     0.606 | module ${SPOTUNE_CUDA_MODULE:-none} |"
echo "| $2 | unfused  |     0.919 |     3.902 |"
EOS
cat > "$tmp/ncu" <<EOS
#!/usr/bin/env bash
echo "\$*" >> "$tmp/ncu.args"
[ -n "\${FAKE_NCU_FAIL:-}" ] && { echo "==ERROR== the profiler could not start"; exit 9; }
case "\$*" in
*--page\ source*) cat "$here/tests/fixtures/ncu_source_forward_wgmma.csv" ;;
*--csv*) cat "$here/tests/fixtures/ncu_step_durations.csv" ;;
*) cat "$here/tests/fixtures/ncu_dkdv_details.txt" ;;
esac
EOS
chmod +x "$b/gpu_profile.sh" "$b/bin/attn_bench" "$tmp/ncu"

# 1. no ncu
out=$(GPU_PROFILE_NCU="" OUT="$tmp/none" bash "$b/gpu_profile.sh" 2>&1)
rc=$?
check "no ncu: exit 77 (skipped)" $((rc != 77)) "exit $rc: $out"
has "$out" "skipped: no ncu (Nsight Compute)"
check "no ncu: says why" $? "$out"

# 2. attention and step
out=$(GPU_PROFILE_NCU="$tmp/ncu" OUT="$tmp/all" bash "$b/gpu_profile.sh" 2>&1)
rc=$?
md=$(cat "$tmp/all/gpu_profile.md" 2>/dev/null)
check "attention and step: exit 0" $((rc != 0)) "exit $rc: $out"
for k in flash_forward_kernel flash_dkdv_kernel flash_dq_stored_kernel flash_dq_kernel \
    flash_forward_wgmma_kernel flash_dkdv_wgmma_kernel flash_dq_stored_wgmma_kernel \
    "flash_forward_kernel<128, 0>" "flash_dkdv_kernel<128, 0>"; do
    has "$md" "| $k | 369.70 us | 250 | 12.35 % | Wait 2.19; Short Scoreboard 1.15; Barrier 0.79 |"
    check "attention: $k's row from ncu's details (duration, registers, occupancy, top stalls)" $? "$md"
done
args=$(cat "$tmp/ncu.args")
has "$args" "--kernel-name-base demangled -k regex:flash_dkdv_kernel<128, 0> --launch-skip 1" &&
    [ -f "$tmp/all/ncu_flash_dkdv_kernel_128__0_.txt" ]
check "attention: the registers variant by its full name (head dim 128), its own file" $? "$args"
has "$args" "-k regex:^flash_dkdv_kernel --launch-skip 1 --launch-count 1 $b/bin/attn_bench --shape 1,2048,32,32,128 --iters 1 --no-check" &&
    has "$args" "--clock-control none"
check "attention: ncu on attn_bench's second launch of the kernel, clocks left alone" $? "$args"
has "$args" "--metrics gpu__time_duration.sum --csv --print-units base $b/bin/spotune bench --backend cuda --preset llama-7b --mode lora --micro-batch 1 --seq-len 2048 --steps 1 --warmup 0"
check "step: ncu's durations of one spotune bench step" $? "$args"
has "$md" "2 step(s) in the file; 1.831 ms of kernels a step" &&
    has "$md" "| flash_forward_kernel | 1 | 0.286 | 15.6% |" &&
    has "$md" "| cuBLAS / cuBLASLt products | 17 | 1.219 | 66.6% |"
check "step: kernel_shares.py's tables in gpu_profile.md" $? "$md"
has "$out" "| fused attention (flash_*) | 1 | 0.286 | 15.6% |"
check "step: the tables printed too" $? "$out"

# 3. modules, and failures
: > "$tmp/ncu.args"
touch "$tmp/a.so" "$tmp/b.so"
out=$(cd "$tmp" && GPU_PROFILE_NCU="" OUT="$tmp/mods" bash "$b/gpu_profile.sh" --modules a.so,b.so --shape 1,128,4,4,64 2>&1)
rc=$?
md=$(cat "$tmp/mods/gpu_profile.md" 2>/dev/null)
check "modules: exit 0, no ncu needed" $((rc != 0)) "exit $rc: $out"
has "$md" "| 1,128,4,4,64 | fused    |     0.166 |     0.606 | module $tmp/a.so |" &&
    has "$md" "| 1,128,4,4,64 | fused    |     0.166 |     0.606 | module $tmp/b.so |" &&
    ! has "$md" "unfused"
check "modules: attn_bench's fused row with each module (absolute path)" $? "$md"
out=$(GPU_PROFILE_NCU="" OUT="$tmp/mods2" bash "$b/gpu_profile.sh" --modules "$tmp/a.so,$tmp/absent.so" 2>&1)
rc=$?
has "$out" "FAIL: $tmp/absent.so: no such file" && [ $rc -eq 1 ]
check "modules: a missing module is a FAIL line, exit 1" $? "exit $rc: $out"
out=$(GPU_PROFILE_NCU="" FAKE_NO_GPU=1 OUT="$tmp/mods3" bash "$b/gpu_profile.sh" --modules "$tmp/a.so" 2>&1)
rc=$?
has "$out" "SKIPPED: attn_bench: runtime.backend: cuda requested but no CUDA device is usable" && [ $rc -eq 77 ]
check "modules: no usable GPU is SKIPPED with attn_bench's reason, exit 77" $? "exit $rc: $out"
out=$(GPU_PROFILE_NCU="$tmp/ncu" FAKE_NCU_FAIL=1 OUT="$tmp/fail" bash "$b/gpu_profile.sh" --attention 2>&1)
rc=$?
has "$out" "| flash_dq_kernel | FAIL (exit 9: ==ERROR== the profiler could not start) |" && [ $rc -eq 1 ]
check "attention: a failing ncu is a FAIL row naming its error, exit 1" $? "exit $rc: $out"

# 4. source
: > "$tmp/ncu.args"
out=$(GPU_PROFILE_NCU="$tmp/ncu" OUT="$tmp/src" bash "$b/gpu_profile.sh" --source flash_forward_wgmma_kernel,flash_dq_stored_kernel 2>&1)
rc=$?
md=$(cat "$tmp/src/gpu_profile.md" 2>/dev/null)
check "source: exit 0" $((rc != 0)) "exit $rc: $out"
args=$(cat "$tmp/ncu.args")
has "$args" "--section WarpStateStats --section SourceCounters --page source --print-source sass --csv -k regex:^flash_dq_stored_kernel --launch-skip 1 --launch-count 1 $b/bin/attn_bench --shape 1,2048,32,32,128" &&
    has "$args" "-k regex:^flash_forward_wgmma_kernel"
check "source: ncu's source view of each named kernel, at attn_bench's second launch" $? "$args"
has "$md" "| 0x15f0 | \`@!PT LDS RZ, [RZ]\` | 7539 | 31.8% | long_sb 7515, mio 11 |" &&
    [ "$(grep -c '^### void flash_forward_wgmma_kernel' <<<"$md")" = 2 ] &&
    [ -s "$tmp/src/src_flash_dq_stored_kernel.csv" ]
check "source: stall_lines.py's table for each kernel in gpu_profile.md, the CSV kept" $? "$md"
out=$(GPU_PROFILE_NCU="$tmp/ncu" FAKE_NCU_FAIL=1 OUT="$tmp/srcfail" bash "$b/gpu_profile.sh" --source flash_dq_kernel 2>&1)
rc=$?
has "$out" "FAIL: flash_dq_kernel: ncu exited 9: ==ERROR== the profiler could not start" && [ $rc -eq 1 ]
check "source: a failing ncu is a FAIL line naming the kernel and its error, exit 1" $? "exit $rc: $out"

# 5. usage
out=$(bash "$b/gpu_profile.sh" --bogus 2>&1)
rc=$?
check "an unknown argument: exit 2" $((rc != 2)) "exit $rc: $out"

echo "$fails failure(s)"
[ $fails -eq 0 ]
