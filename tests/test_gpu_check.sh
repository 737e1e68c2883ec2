#!/usr/bin/env bash
# tests/test_gpu_check.sh — scripts/gpu_check.sh, the one-shot GPU check:
#  1. its dry run on this build (--dry-run hides every GPU, so this is a dry
#     run on a GPU machine too): the table has all 38 rows, every GPU step is
#     SKIPPED with its reason (the CUDA error, or the build without CUDA),
#     the two kernel workbenches' rows too, the test programs report their
#     own skip, exit 77, and it takes under a minute;
#  2. with stand-in programs in a bundle-shaped folder (env.sh that sets the
#     bundle's LD_LIBRARY_PATH, bin/, a fake nvidia-smi and compute-sanitizer
#     on PATH, a python whose torch import fails): PASS, FAIL, TIMEOUT and
#     SKIPPED rows with their figures, a bench whose step-1 check fails, the
#     7B micro-batch 8 retried with --recompute layer, both MFU conventions,
#     the Python peer run with the machine's library path (not the
#     bundle's) and its import error as a FAIL row with the message,
#     nvidia-smi at start and end, spotune doctor's GPU lines as rows (a
#     WARN among them; its SKIPPED lines named in its row), memcheck errors
#     as rows, the kernel workbenches (attn_bench, elem_bench, mm_bench: stand-ins
#     printing tables like theirs) as PASS rows with the figures derived
#     from their tables, and their tables after the main one, the table in
#     $OUT/gpu_check_table.md, exit 1; the workbenches again as FAIL rows
#     (exit 1, a FAIL row each), then as TIMEOUT (a hung one) and SKIPPED
#     (one that exits 77);
#     --only runs the chosen steps, the rest OMITTED rows (exit 0), and
#     refuses an unknown key;
#  3. the budget enforced: a step that hangs is cut at what is left of a
#     30 s budget, every later step is a "not started" row, and the whole
#     run stays within the budget;
#  4. a run killed from outside mid-way leaves the table of the rows it
#     reached in $OUT, marked PARTIAL (the table is written after each step).
# usage: tests/test_gpu_check.sh BUILD_DIR
set -uo pipefail
build=$(cd "$1" && pwd)
here=$(cd "$(dirname "$0")/.." && pwd)
check_sh="$here/scripts/gpu_check.sh"
# shellcheck source=tests/check.sh
source "$here/tests/check.sh" # $tmp, check, has
row() { grep -E "^\| $2 \|" <<<"$1"; } # row TABLE N

# ---- 1. the dry run on the real programs --------------------------------------------------
# (a stand-in nvidia-smi on PATH: a dry run must not ask it)
mkdir -p "$tmp/path"
cat > "$tmp/path/nvidia-smi" <<'EOF'
#!/usr/bin/env bash
if [ "${1:-}" = -q ]; then echo "Driver Version : 570.86.15"; exit 0; fi
echo "name, driver_version, pstate, clocks.current.sm [MHz], clocks.current.memory [MHz], clocks.max.sm [MHz], memory.used [MiB], memory.total [MiB], temperature.gpu, power.draw [W]"
echo "NVIDIA H200, 570.86.15, P0, 1980 MHz, 3201 MHz, 1980 MHz, 1 MiB, 143771 MiB, 31, 75.00 W"
EOF
chmod +x "$tmp/path/nvidia-smi"
t0=$(date +%s)
out=$(OUT="$tmp/dry" PATH="$tmp/path:/usr/bin:/bin" bash "$check_sh" --build "$build" --dry-run 2>&1)
rc=$?
dt=$(($(date +%s) - t0))
table=$(cat "$tmp/dry/gpu_check_table.md" 2>/dev/null)
check "dry run exits 77 (skipped, not passed)" $((rc != 77)) "exit $rc: $out"
check "dry run under a minute" $((dt >= 60)) "${dt}s"
n=$(grep -cE '^\| [0-9]+ \|' <<<"$table")
check "dry run: the table has the 38 rows" $((n != 38)) "$table"
bad=$(grep -E '^\| [0-9]+ \|' <<<"$table" | grep -v '| SKIPPED |')
check "dry run: every row SKIPPED" $((${#bad} != 0)) "$bad"
for k in 2 3 4 5; do
    r=$(row "$table" $k)
    has "$r" "skipped: no usable CUDA device: " &&
        { has "$r" "cudaGetDeviceCount: " || has "$r" "built without the CUDA backend"; }
    check "dry run: test row $k skipped by the program itself, naming why" $? "$r"
done
for k in 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22; do
    r=$(row "$table" $k)
    has "$r" "no usable CUDA device: "
    check "dry run: GPU row $k skipped with the reason" $? "$r"
done
has "$(row "$table" 10)" "| attention workbench (attn_bench" &&
    has "$(row "$table" 11)" "| elementwise workbench (elem_bench"
check "dry run: rows 10 and 11 are the kernel workbenches" $? "$table"
! has "$table" "full output: out/"
check "dry run: no workbench table after the main one" $? "$table"
has "$(row "$table" 1)" "dry run: the GPUs are hidden" && has "$(row "$table" 38)" "dry run: the GPUs are hidden"
check "dry run: nvidia-smi rows at start and end" $? "$table"
has "$out" "| # | step | result | s | figure |" && [ "$(grep -c '| # | step |' <<<"$out")" -eq 1 ]
check "dry run: one table printed" $? "$out"
list=$(tar -tzf "$tmp/dry/gpu_check_outputs.tar.gz" 2>&1) # (no grep -q in a pipe: SIGPIPE)
[ -s "$tmp/dry/gpu_check.log" ] && has "$list" "out/ops.out"
check "dry run: log and outputs written to OUT" $? "$(ls -l "$tmp/dry")"

# ---- 2. stand-ins: every kind of row --------------------------------------------------------
bundle="$tmp/bundle"
mkdir -p "$bundle/bin" "$bundle/scripts" "$tmp/path"
cp "$check_sh" "$bundle/gpu_check.sh"
echo "# the bench peer (a stand-in: the fake python ignores it)" > "$bundle/scripts/bench_hf_peft.py"
printf 'spotune GPU bundle\ncommit: fake\n' > "$bundle/BUILD.txt"
cat > "$bundle/env.sh" <<'EOF'
SPOTUNE_BUNDLE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export LD_LIBRARY_PATH="$SPOTUNE_BUNDLE/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PATH="$SPOTUNE_BUNDLE/bin:$PATH"
EOF
cat > "$bundle/bin/spotune" <<'EOF'
#!/usr/bin/env bash
# stand-in for spotune bench
args="$*"
json() { # json TOKS MFU MFU6 LOSS CHECK [CPU_LOSS]
    printf '{"preset":"x","backend":"cuda","step_s":%s,"tokens_per_s":%s,"mfu":%s,"mfu_6n":%s,"flops_per_token":4.0e10,"flops_per_token_6n":4.0e10,"peak_mem_bytes":16106127360.0,"step1_loss":%s,"step1_grad_norm":1.25,"expected_loss":11.19,"check":"%s","loss_check":"step-1 loss within"%s}\n' \
        "$(awk -v t="$1" 'BEGIN { print 2048 / t }')" "$1" "$2" "$3" "$4" "$5" \
        "${6:+,\"cpu_step1_loss\":$6,\"cpu_step1_grad_norm\":1.26,\"cpu_check\":\"ok\"}"
}
case "$args" in
*--probe-cuda*) echo "cuda: 1 CUDA device"; exit 0 ;;
*"--preset small --mode lora"*"--doc-len 300"*) json 55000 0.22 0.26 10.52 ok 10.521 ;;
*"--preset small --mode lora"*"--cuda-graphs on"*)
    if [ "${FAKE_GRAPHS:-}" = off ]; then
        json 50000 0.20 0.24 10.52 ok 10.521 |
            sed 's/}$/,"cuda_graphs":true,"graph_replays":0,"graph_off":"capture failed: cudaStreamEndCapture: operation not permitted when stream is capturing"}/'
    else
        json 65000 0.26 0.31 10.52 ok 10.521 |
            sed 's/}$/,"cuda_graphs":true,"graph_replays":9,"graph_ops":871,"graph_update_replays":9,"graph_update_ops":3,"graph_off":""}/'
    fi ;;
*"--preset small --mode lora"*) json 52000 0.21 0.25 10.52 ok 10.521 ;;
*"--preset small --mode full"*)
    json 30000 0.30 0.31 10.52 fail 10.91
    echo "spotune: error: bench small full on cuda: step 1 vs the cpu backend: loss 10.52 vs 10.91 (relative difference 3.6e-02, tolerance 5.0e-03)" >&2
    exit 1 ;;
*"--preset llama-7b --mode lora --micro-batch 1 "*"--doc-len 512"*)
    if [ "${SPOTUNE_CUDA_ATTENTION:-}" = cudnn ]; then json 3960 0.50 0.51 11.20 ok; else json 3600 0.45 0.46 11.20 ok; fi ;;
*"--preset llama-7b --mode lora --micro-batch 1 "*"--cuda-graphs on"*)
    json 3465 0.46 0.47 11.20 ok |
        sed 's/}$/,"cuda_graphs":true,"graph_replays":4,"graph_ops":1500,"graph_update_replays":4,"graph_update_ops":3,"graph_off":""}/' ;;
*"--preset llama-7b --mode lora --micro-batch 1 "*)
    if [ "${SPOTUNE_LORA_BATCHED:-}" = 0 ]; then json 3000 0.40 0.41 11.20 ok; exit 0; fi
    if [ "${SPOTUNE_CUDA_ATTENTION:-}" = fused-stored ]; then json 3000 0.40 0.41 11.20 ok; exit 0; fi
    if [ "${SPOTUNE_CUDA_ATTENTION:-}" = fused-wgmma ]; then json 3630 0.40 0.41 11.20 ok; exit 0; fi
    if [ "${SPOTUNE_CUDA_SKINNY:-}" = 0 ] && [ "${SPOTUNE_CUDA_WIDE:-}" = 0 ]; then json 3000 0.40 0.41 11.20 ok; exit 0; fi
    if [ "${SPOTUNE_CUDA_ATTENTION:-}" = cudnn ]; then
        case "$args" in
        *"--seq-len 8192"*) json 3960 0.50 0.51 11.20 ok ;;
        *) echo "spotune: attention by cuDNN (SPOTUNE_CUDA_ATTENTION=cudnn): libcudnn.so.9 not found (libcudnn.so.9: cannot open shared object file); the fused kernels run instead" >&2
           json 3300 0.44 0.45 11.20 ok ;;
        esac
        exit 0
    fi
    json 3300 0.4417 0.4523 11.20 ok |
        sed 's/}$/,"split_ms":{"gemm":80.0,"lora":20.0,"attention":40.0,"elementwise":40.0,"optimizer":10.0,"communication":10.0},"profiled_step_ms":200.0}/' ;;
*"--preset llama-13b"*"--recompute layer"*"--quantize nf4"*)
    json 1200 0.30 0.35 11.40 ok | sed 's/"peak_mem_bytes":[0-9.]*/"peak_mem_bytes":9771221811.0/' ;;
*"--preset llama-13b"*)
    if [ "${SPOTUNE_CUDA_ATTENTION:-}" = cudnn ]; then json 1900 0.50 0.51 11.40 ok; exit 0; fi
    echo "bench: building llama-13b (lora, random weights)..." >&2
    echo "bench: built in 31.4 s" >&2; sleep 1000 ;;
*"--preset llama-7b --mode lora --micro-batch 4 "*) json 3600 0.48 0.49 11.20 ok ;;
*"--micro-batch 8"*"--recompute none"*)
    echo "spotune: error: cuda backend: device 0 (NVIDIA H200): cudaMalloc of 268435456 bytes: out of memory" >&2
    exit 1 ;;
*"--micro-batch 8"*"--recompute layer"*) json 3000 0.40 0.41 11.21 ok ;;
doctor*)
    echo "spotune doctor 9.9.9 on gpu-host: 1 rank on 1 host (gpu-host)"
    echo "PASS    host.cpu             64 online cores  (expected: >= 4 cores)"
    echo "PASS    gpu0.device          NVIDIA H200 (sm_90, 132 SMs, PCI 0000:19:00), 139.8 GiB (139.2 GiB free); driver CUDA 12.8 / 570.86.15, runtime 13.0  (expected: driver >= the CUDA runtime spotune was built with)"
    echo "WARN    gpu0.gemm_bf16       512 TFLOP/s, 52% of peak (8192^3, fp32 accumulation)  (expected: >= 70% of H200's 989 TFLOP/s dense bf16 peak)"
    echo "SKIPPED gpu.p2p              one GPU: no pairs"
    echo "SKIPPED gpu.nccl_allreduce   one rank: run it under mpirun"
    echo "3 PASS, 1 WARN, 0 FAIL, 2 SKIPPED: ready"
    exit 0 ;;
*) echo "unexpected: $args" >&2; exit 9 ;;
esac
EOF
cat > "$bundle/bin/test_cuda_ops" <<'EOF'
#!/usr/bin/env bash
[ "${FAKE_MODE:-}" = hang ] && exec sleep 1000
echo "[====] Synthesis: Tested: 21 | Passing: 21 | Failing: 0 | Crashing: 0 " >&2
EOF
cat > "$bundle/bin/test_cuda_elementwise" <<'EOF'
#!/usr/bin/env bash
echo "[====] Synthesis: Tested: 9 | Passing: 9 | Failing: 0 | Crashing: 0 " >&2
EOF
cat > "$bundle/bin/test_cuda_attention" <<'EOF'
#!/usr/bin/env bash
echo "[====] Synthesis: Tested: 9 | Passing: 9 | Failing: 0 | Crashing: 0 " >&2
EOF
cat > "$bundle/bin/test_cuda_layer" <<'EOF'
#!/usr/bin/env bash
echo "[----] test_cuda_layer.c:180: Assertion Failed" >&2
echo "[----]   recompute layer: input gradient (d loss / d layer input): relative RMS error 0.412 > 0.03" >&2
echo "[FAIL] cuda_layer::decoder_layer: (12.00s)" >&2
echo "[====] Synthesis: Tested: 1 | Passing: 0 | Failing: 1 | Crashing: 0 " >&2
exit 1
EOF
cat > "$bundle/bin/test_cuda_model" <<'EOF'
#!/usr/bin/env bash
echo "skipped: no usable CUDA device: cudaGetDeviceCount: no CUDA-capable device is detected (cudaErrorNoDevice)"
exit 77
EOF
cat > "$bundle/bin/test_cuda_comm" <<'EOF'
#!/usr/bin/env bash
echo "[====] Synthesis: Tested: 3 | Passing: 3 | Failing: 0 | Crashing: 0 " >&2
EOF
# the kernel workbenches: tables as theirs (kernels/cuda/dev); FAKE_WB=fail:
# a FAIL row and exit 1; FAKE_WB=other: attn_bench hangs after one row,
# elem_bench exits 77 as without a device
cat > "$bundle/bin/attn_bench" <<'EOF'
#!/usr/bin/env bash
[ "$*" = "--iters 3" ] || { echo "usage: attn_bench [--shape B,T,nh,nkv,hd]... [--iters N]" >&2; exit 2; }
echo "device: NVIDIA H200; 3 iterations; no packing"
echo
echo "| B,T,nh,nkv,hd | version | fwd ms | bwd ms | fwd TFLOP/s | bwd TFLOP/s | worst rel err | check |"
echo "|---|---|---|---|---|---|---|---|"
echo "| 1,2048,32,32,128 | fused    |     0.500 |     1.500 |   275.0 |   229.1 | dq  3.10e-03 | ok |"
[ "${FAKE_WB:-}" = other ] && exec sleep 1000
echo "| 1,2048,32,32,128 | fused-regs |     0.550 |     1.650 |   250.0 |   208.3 | dq  3.10e-03 | ok |"
echo "| 1,2048,32,32,128 | fused-recompute |     0.500 |     1.800 |   275.0 |   190.9 | dq  3.10e-03 | ok |"
echo "| 1,2048,32,32,128 | fused-wgmma |     0.250 |     1.200 |   550.0 |   286.4 | dq  3.10e-03 | ok |"
echo "| 1,2048,32,32,128 | unfused  |     1.000 |     3.000 |   137.4 |   114.5 | out 2.00e-03 | ok |"
echo "| 1,2048,32,32,128 | cudnn    |     0.250 |     0.750 |   550.0 |   458.2 | dq  3.00e-03 | ok |"
echo "| 1,2048,32,8,128 | cudnn    (fused: cuDNN did not run it, stderr says why) |     0.500 |     1.500 |   275.0 |   229.1 | dq  3.20e-03 | ok |"
echo "| 1,2048,32,8,128 | fused    |     0.500 |     1.500 |   275.0 |   229.1 | dq  3.20e-03 | ok |"
if [ "${FAKE_WB:-}" = fail ]; then
    echo "| 1,2048,32,8,128 | unfused  |     1.500 |     3.500 |    91.6 |    98.2 | dq  2.50e-02 | FAIL |"
else
    echo "| 1,2048,32,8,128 | unfused  |     1.500 |     3.500 |    91.6 |    98.2 | dq  2.50e-03 | ok |"
fi
echo "| 1,4096,32,8,64 | fused    |     1.000 |     3.000 |   275.0 |   229.1 | dk  4.00e-03 | ok |"
echo "| 1,4096,32,8,64 | unfused  |     3.000 |     9.000 |    91.6 |    76.4 | dk  4.50e-03 | ok |"
echo "| 2,1031,8,2,64 | fused    fallback |     0.200 |     0.600 |    22.2 |    18.5 | dv  1.00e-03 | ok |"
echo "| 2,1031,8,2,64 | unfused  |     0.200 |     0.600 |    22.2 |    18.5 | dv  1.00e-03 | ok |"
[ "${FAKE_WB:-}" = fail ] && exit 1
exit 0
EOF
cat > "$bundle/bin/elem_bench" <<'EOF'
#!/usr/bin/env bash
[ "$*" = "--iters 3" ] || { echo "usage: elem_bench [--shape ROWS,COLS]... [--iters N]" >&2; exit 2; }
if [ "${FAKE_WB:-}" = other ]; then
    echo "elem_bench: runtime.backend: cuda requested but no CUDA device is usable: cudaGetDeviceCount: no CUDA-capable device is detected (cudaErrorNoDevice)" >&2
    exit 77
fi
same=yes check=ok
[ "${FAKE_WB:-}" = fail ] && same=NO check=FAIL
echo "device: NVIDIA H200; activations bf16; 3 iterations"
echo
echo "| rows x cols | op | version | ms | GB/s | worst rel err | = scalar | check |"
echo "|---|---|---|---|---|---|---|---|"
echo "| 2048 x 4096 | add         | scalar |    0.040 |  1258.3 | 1.95e-03 | -   | ok |"
echo "| 2048 x 4096 | add         | vector |    0.020 |  2516.6 | 1.95e-03 | $same | $check |"
echo "| 2048 x 4096 | rmsnorm_fwd | scalar |    0.080 |   419.4 | 3.00e-03 | -   | ok |"
echo "| 2048 x 4096 | rmsnorm_fwd | vector |    0.010 |  3355.4 | 3.00e-03 | yes | ok |"
echo "| 1031 x 4103 | add         | scalar |    0.030 |   846.0 | 1.90e-03 | -   | ok |"
echo "| 1031 x 4103 | add         | vector fallback |    0.030 |   846.0 | 1.90e-03 | yes | ok |"
[ "${FAKE_WB:-}" = fail ] && { echo "elem_bench: 1 row failed" >&2; exit 1; }
exit 0
EOF
cat > "$bundle/bin/mm_bench" <<'EOF'
#!/usr/bin/env bash
[ "$*" = "--iters 20" ] || { echo "usage: mm_bench [--rows N] [--iters N] [--splits A,B,...] [--no-check]" >&2; exit 2; }
check=ok err=3.10e-03
[ "${FAKE_WB:-}" = fail ] && check=FAIL err=4.00e-02
echo "device: NVIDIA H200; rows 2048; 20 iterations"
echo
echo "| product | M,N,K x batch | op | version | us | GB/s | rel err | check |"
echo "|---|---|---|---|---|---|---|---|"
echo "| xA_qkv | 2048,48,4096 x 1 | [N,K] | skinny | 5.0 | 3444 | 2.00e-03 | ok |"
echo "| xA_qkv | 2048,48,4096 x 1 | [N,K] | cublaslt | 12.0 | 1435 | 2.50e-03 | ok |"
echo "| dyB_gu | 2048,16,11008 x 2 | [K,N] | skinny | 20.0 | 4523 | $err | $check |"
echo "| dyB_gu | 2048,16,11008 x 2 | [K,N] | cublaslt | 40.0 | 2261 | 3.00e-03 | ok |"
echo "| up_gu | 2048,11008,16 x 2 | [N,K] | wide | 12.0 | 7540 | 2.90e-03 | ok |"
echo "| up_gu | 2048,11008,16 x 2 | [N,K] | cublaslt | 21.0 | 4308 | 2.90e-03 | ok |"
echo
echo "cuBLASLt time / skinny time: xA_qkv 2.40x dyB_gu 2.00x; geometric mean 2.19x over 2 products"
echo "cuBLASLt time / wide time: up_gu 1.75x; geometric mean 1.75x over 1 products"
[ "${FAKE_WB:-}" = fail ] && { echo "FAIL"; exit 1; }
exit 0
EOF
cat > "$tmp/path/compute-sanitizer" <<'EOF'
#!/usr/bin/env bash
echo "========= COMPUTE-SANITIZER"
echo "SPOTUNE_TEST_SHAPES=$SPOTUNE_TEST_SHAPES args: $*"
case "$*" in
*"--tool racecheck"*)
    echo "[====] Synthesis: Tested: 7 | Passing: 7 | Failing: 0 | Crashing: 0 " >&2
    if [ -n "${FAKE_RACE:-}" ]; then
        echo "========= Error: Race reported between Write access at flash_dq_stored_kernel<128>+0x2a0"
        echo "=========     and Read access at flash_dq_stored_kernel<128>+0x1f0 [128 hazards]"
        echo "========= RACECHECK SUMMARY: 1 hazard displayed (1 error, 0 warnings)"
        exit 3
    fi
    echo "========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)"
    exit 0 ;;
*test_cuda_attention* | *test_cuda_elementwise*) echo "========= ERROR SUMMARY: 0 errors"; exit 0 ;;
esac
for i in 1 2; do
    echo "========= Invalid __global__ read of size 2 bytes"
    echo "=========     at attention_softmax_rows+0x1b0 in cuda_attention.cu:210"
    echo "=========     by thread (3,0,0) in block (7,0,0)"
done
echo "========= Program hit cudaErrorLaunchFailure (error 719) due to \"unspecified launch failure\" on CUDA API call to cudaStreamSynchronize."
echo "========= ERROR SUMMARY: 3 errors"
exit 3
EOF
cat > "$tmp/path/fakepython" <<'EOF'
#!/usr/bin/env bash
echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH-<unset>}" > "$FAKE_PY_ENV"
echo "args: $*" >> "$FAKE_PY_ENV"
if [ -n "${FAKE_PY_OK:-}" ]; then # bench_hf_peft.py's JSON line, tokens/s by settings
    case "$*" in
    *"--preset llama-13b"*) t=900 ;;
    *"--micro-batch 4"*) t=1500 ;;
    *"--seq-len 8192"*) t=1100 ;;
    *) t=1650 ;;
    esac
    printf '{"tokens_per_s":%s,"step_s":1.0,"peak_mem_bytes":32212254720.0,"step1_loss":11.19,"torch":"2.11.0","peft":"0.21.0"}\n' "$t"
    exit 0
fi
echo "error: import torch: OSError: libcudnn.so.9: cannot open shared object file: No such file or directory" >&2
exit 2
EOF
chmod +x "$bundle/gpu_check.sh" "$bundle/bin/"* "$tmp/path/"*

t0=$(date +%s)
out=$(env -u LD_LIBRARY_PATH OUT="$tmp/mixed" PATH="$tmp/path:/usr/bin:/bin" GPU_CHECK_BOX_SCALE=0.1 \
    GPU_CHECK_PYTHON="$tmp/path/fakepython" FAKE_PY_ENV="$tmp/pyenv" \
    bash "$bundle/gpu_check.sh" 2>&1)
rc=$?
dt=$(($(date +%s) - t0))
table=$(cat "$tmp/mixed/gpu_check_table.md" 2>/dev/null)
check "stand-ins: exit 1 (a step failed)" $((rc != 1)) "exit $rc: $out"
res() { row "$table" "$1" | awk -F' \\| ' '{ print $3 }'; }
expect_row() { # expect_row N RESULT TEXT
    local r
    r=$(row "$table" "$1")
    [ "$(res "$1")" = "$2" ] && has "$r" "$3"
    check "stand-ins: row $1 $2 ($3)" $? "$r"
}
expect_row 1 PASS "NVIDIA H200, 570.86.15, P0, 1980 MHz, 3201 MHz, 1980 MHz, 1 MiB, 143771 MiB"
expect_row 2 PASS "Tested: 39 / Passing: 39 / Failing: 0 / Crashing: 0"
expect_row 3 FAIL "relative RMS error 0.412 > 0.03"
expect_row 4 SKIPPED "cudaErrorNoDevice"
expect_row 5 PASS "Tested: 3"
expect_row 6 PASS "52000 tok/s"
expect_row 6 PASS "MFU honest 21.0% / 6N 25.0%"
expect_row 6 PASS "CPU step 1: loss 10.5210"
expect_row 7 FAIL "step 1 vs the cpu backend: loss 10.52 vs 10.91"
expect_row 8 PASS "MFU honest 44.2% / 6N 45.2%; step 1 loss 11.2000"
expect_row 8 PASS "one step 200.0 ms: GEMM 40%, LoRA 10%, attention 20%, elementwise 20%, optimizer 5%, comm 5%"
expect_row 9 FAIL "error: import torch: OSError: libcudnn.so.9"
expect_row 19 FAIL "exit 2: error: import torch: OSError: libcudnn.so.9"
expect_row 20 FAIL "HF PEFT llama-13b LoRA r16 mb1 seq 2048 (bench_hf_peft.py) | FAIL"
expect_row 21 FAIL "HF PEFT llama-7b LoRA r16 mb1 seq 8192 (bench_hf_peft.py) | FAIL"
expect_row 10 PASS "attention workbench (attn_bench"
expect_row 10 PASS "fused/unfused fwd+bwd at 7B T 2048 (1,2048,32,32,128): 2.00x (fused 0.500+1.500 ms, 275.0/229.1 TFLOP/s; unfused 1.000+3.000 ms); bwd with stored dS 1.500 ms, recomputing dQ 1.800 ms (1.20x); operands staged fwd 0.500, bwd 1.500 ms, in registers 0.550, 1.650 (1.10x, 1.10x); wgmma fwd 0.250, bwd 1.200 ms against mma.sync 0.500, 1.500 (2.00x, 1.25x); cuDNN fwd 0.250, bwd 0.750 ms against fused 0.500, 1.500 (2.00x, 2.00x)"
expect_row 10 PASS "other shapes: 1,2048,32,8,128 2.50x, 1,4096,32,8,64 3.00x, 2,1031,8,2,64 1.00x"
expect_row 10 PASS "worst rel err 4.50e-03 (dk at 1,4096,32,8,64 unfused); 13 rows: 13 ok, 0 FAIL, 1 fallback"
expect_row 11 PASS "elementwise workbench (elem_bench"
expect_row 11 PASS "vector/scalar geometric-mean speedup 4.00x over 2 op-shapes (from 2.00x, add 2048 x 4096, to 8.00x, rmsnorm_fwd 2048 x 4096)"
expect_row 11 PASS "1 vector rows fell back (not counted); bit-identical to scalar (3 vector rows); worst rel err 3.00e-03; 6 rows: 6 ok, 0 FAIL"
expect_row 12 TIMEOUT "killed after 8s; last: built in 31.4 s"
expect_row 13 PASS "bench llama-7b LoRA r16 mb4 seq 2048"
expect_row 13 PASS "3600 tok/s"
expect_row 14 PASS "recompute layer; 3000 tok/s"
expect_row 14 PASS "recompute none had failed: exit 1: spotune: error: cuda backend"
expect_row 15 PASS "bench llama-7b LoRA r16 mb1 seq 8192"
expect_row 15 PASS "3300 tok/s"
expect_row 16 PASS "bench small LoRA mb1 seq 2048, CUDA graphs"
expect_row 16 PASS "graphs: 9 step(s) replayed one (871 ops), 9 update(s) replayed one, 1.25x the eager row's tok/s; 65000 tok/s"
expect_row 17 PASS "bench llama-13b QLoRA (NF4) r16 mb1 seq 2048, recompute layer"
expect_row 17 PASS "1200 tok/s, step 1.707 s, peak 9.1 GiB"
expect_row 18 PASS "2 GPU lines, 0 FAIL; skipped: gpu.p2p, gpu.nccl_allreduce; 3 PASS, 1 WARN"
expect_row 22 PASS "bench llama-7b LoRA r16 mb1 seq 2048, LoRA one by one (SPOTUNE_LORA_BATCHED=0)"
expect_row 22 PASS "SPOTUNE_LORA_BATCHED=0; row 8 is 1.100x this; 3000 tok/s"
expect_row 23 PASS "bench llama-7b LoRA r16 mb1 seq 8192, dS stored in chunks (SPOTUNE_CUDA_ATTENTION=fused-stored)"
expect_row 23 PASS "SPOTUNE_CUDA_ATTENTION=fused-stored; row 15 is 1.100x this; 3000 tok/s"
expect_row 24 PASS "bench llama-7b LoRA r16 mb1 seq 2048, attention by wgmma (SPOTUNE_CUDA_ATTENTION=fused-wgmma)"
expect_row 24 PASS "SPOTUNE_CUDA_ATTENTION=fused-wgmma; row 8 is 0.909x this; 3630 tok/s"
expect_row 25 PASS "bench llama-7b LoRA r16 mb1 seq 2048, CUDA graphs (runtime.cuda_graphs)"
expect_row 25 PASS "graphs: 4 step(s) replayed one (1500 ops), 4 update(s) replayed one, 1.05x the eager row's tok/s; 3465 tok/s"
expect_row 26 PASS "rank-r product workbench (mm_bench"
expect_row 26 PASS "cuBLASLt time / skinny kernel time: xA_qkv 2.40x dyB_gu 2.00x; geometric mean 2.19x over 2 products; cuBLASLt time / wide kernel time: up_gu 1.75x; geometric mean 1.75x over 1 products; worst rel err 3.10e-03 (dyB_gu skinny); 6 rows: 6 ok, 0 FAIL"
expect_row 27 PASS "bench llama-7b LoRA r16 mb1 seq 2048, rank-r products by cuBLASLt (SPOTUNE_CUDA_SKINNY=0 SPOTUNE_CUDA_WIDE=0)"
expect_row 27 PASS "SPOTUNE_CUDA_SKINNY=0 SPOTUNE_CUDA_WIDE=0; row 8 is 1.100x this; 3000 tok/s"
expect_row 28 PASS "bench llama-7b LoRA r16 mb1 seq 2048, attention by cuDNN (SPOTUNE_CUDA_ATTENTION=cudnn)"
expect_row 28 PASS "cuDNN DID NOT RUN: libcudnn.so.9 not found (libcudnn.so.9: cannot open shared object file); the fused kernels run instead; SPOTUNE_CUDA_ATTENTION=cudnn; row 8 is 1.000x this; 3300 tok/s"
expect_row 29 PASS "bench llama-7b LoRA r16 mb1 seq 8192, attention by cuDNN (SPOTUNE_CUDA_ATTENTION=cudnn) | PASS"
expect_row 29 PASS "| SPOTUNE_CUDA_ATTENTION=cudnn; row 15 is 0.833x this; 3960 tok/s"
expect_row 30 PASS "bench small LoRA mb1 seq 2048, attention by cuDNN (SPOTUNE_CUDA_ATTENTION=cudnn), step 1 vs CPU | PASS"
expect_row 30 PASS "| SPOTUNE_CUDA_ATTENTION=cudnn; row 6 is 1.000x this; 52000 tok/s"
expect_row 30 PASS "CPU step 1: loss 10.5210"
expect_row 31 PASS "bench llama-7b LoRA r16 mb1 seq 2048, attention by cuDNN and CUDA graphs | PASS"
expect_row 31 PASS "graphs: 4 step(s) replayed one (1500 ops), 4 update(s) replayed one, 1.05x the eager row's tok/s; 3465 tok/s"
expect_row 32 PASS "bench llama-13b LoRA r16 mb1 seq 2048, attention by cuDNN (SPOTUNE_CUDA_ATTENTION=cudnn) | PASS"
expect_row 32 PASS "| SPOTUNE_CUDA_ATTENTION=cudnn; no row 12 to compare; 1900 tok/s"
expect_row 33 PASS "bench small LoRA mb1 seq 2048, packed documents, attention by cuDNN (SPOTUNE_CUDA_ATTENTION=cudnn), step 1 vs CPU | PASS"
expect_row 33 PASS "| packed documents of ~300 tokens; 55000 tok/s"
expect_row 33 PASS "CPU step 1: loss 10.5210"
expect_row 34 PASS "bench llama-7b LoRA r16 mb1 seq 2048, packed documents | PASS"
expect_row 34 PASS "| packed documents of ~512 tokens; row 8 is 0.917x this; 3600 tok/s"
expect_row 35 PASS "bench llama-7b LoRA r16 mb1 seq 2048, packed documents, attention by cuDNN (SPOTUNE_CUDA_ATTENTION=cudnn) | PASS"
expect_row 35 PASS "| packed documents of ~512 tokens; SPOTUNE_CUDA_ATTENTION=cudnn; row 34 is 0.909x this; 3960 tok/s"
expect_row 36 PASS "compute-sanitizer racecheck on the fused attention tests (reduced shapes) | PASS"
expect_row 36 PASS "0 hazards; Tested: 7 / Passing: 7 / Failing: 0 / Crashing: 0"
expect_row 37 FAIL "exit 3, 3 errors"
expect_row 38 PASS "NVIDIA H200"
expect_row 39 PASS "doctor gpu0.device | PASS | - | NVIDIA H200 (sm_90"
expect_row 40 WARN "doctor gpu0.gemm_bf16 | WARN | - | 512 TFLOP/s, 52% of peak"
expect_row 41 FAIL "memcheck error: Invalid __global__ read of size 2 bytes in attention_softmax_rows | FAIL | - | 2 occurrences"
expect_row 42 FAIL "memcheck error: Program hit cudaErrorLaunchFailure"
n=$(grep -cE '^\| [0-9]+ \|' <<<"$table")
check "stand-ins: 38 rows, the 2 doctor GPU rows and the 2 memcheck error rows" $((n != 42)) "$table"
# the workbenches' own tables after the main one, whole
after=$(sed -n '/^| 42 |/,$p' <<<"$table")
has "$after" "attention workbench: \`attn_bench --iters 3\` (PASS; full output: out/attn_bench.out" &&
    has "$after" "device: NVIDIA H200; 3 iterations" &&
    has "$after" "| 2,1031,8,2,64 | unfused  |" &&
    has "$after" "elementwise workbench: \`elem_bench --iters 3\` (PASS; full output: out/elem_bench.out" &&
    has "$after" "| 1031 x 4103 | add         | vector fallback |" &&
    has "$after" "rank-r product workbench: \`mm_bench --iters 20\` (PASS; full output: out/mm_bench.out" &&
    has "$after" "| dyB_gu | 2048,16,11008 x 2 | [K,N] | cublaslt |" &&
    has "$after" "| up_gu | 2048,11008,16 x 2 | [N,K] | wide |" &&
    [ "$(grep -c '^|' <<<"$after")" -eq $((1 + 15 + 8 + 8)) ]
check "stand-ins: the three workbench tables follow the main table" $? "$after"
has "$(cat "$tmp/pyenv" 2>/dev/null)" "LD_LIBRARY_PATH=<unset>"
check "the Python peer runs without the bundle's LD_LIBRARY_PATH" $? "$(cat "$tmp/pyenv" 2>/dev/null)"
race_out=$(tar -xzOf "$tmp/mixed/gpu_check_outputs.tar.gz" out/racecheck.out 2>&1)
has "$race_out" "SPOTUNE_TEST_SHAPES=reduced args: --tool racecheck --error-exitcode 3" &&
    has "$race_out" "test_cuda_attention --jobs 1 --filter cuda_ops/flash*"
check "racecheck runs the fused attention's tests with reduced shapes" $? "$race_out"
memcheck_out=$(tar -xzOf "$tmp/mixed/gpu_check_outputs.tar.gz" out/memcheck.out 2>&1)
has "$memcheck_out" "SPOTUNE_TEST_SHAPES=reduced args: --tool memcheck"
check "memcheck runs the op tests with reduced shapes" $? "$memcheck_out"
has "$memcheck_out" "test_cuda_ops --jobs 1" && has "$memcheck_out" "test_cuda_attention --jobs 1" &&
    has "$memcheck_out" "test_cuda_elementwise --jobs 1"
check "memcheck runs the three CUDA op suites (test_cuda_ops, test_cuda_elementwise, test_cuda_attention)" \
    $? "$memcheck_out"
la=$(grep -n "test_cuda_attention --jobs 1" <<<"$memcheck_out" | head -1 | cut -d: -f1)
lo=$(grep -n "test_cuda_ops --jobs 1" <<<"$memcheck_out" | head -1 | cut -d: -f1)
[ -n "$la" ] && [ -n "$lo" ] && [ "$la" -lt "$lo" ]
check "memcheck runs the attention suite first, the other ops last" $? "$memcheck_out"
list=$(tar -tzf "$tmp/mixed/gpu_check_outputs.tar.gz" 2>&1)
has "$list" "smi_start-q.out" && has "$list" "smi_end-q.out"
check "nvidia-smi -q kept at start and end" $? "$list"
has "$list" "out/attn_bench.out" && has "$list" "out/elem_bench.out"
check "the workbenches' whole outputs kept" $? "$list"
has "$(cat "$tmp/mixed/gpu_check.log" 2>/dev/null)" "| 1,4096,32,8,64 | unfused  |"
check "the workbench tables in the log" $? "$(cat "$tmp/mixed/gpu_check.log" 2>/dev/null)"
has "$(head -n 3 <<<"$table")" "MFU honest: 4N/token for frozen weights" &&
    has "$(head -n 1 <<<"$table")" "GPU: NVIDIA H200, 570.86.15"
check "the table names the GPU, driver and both MFU conventions" $? "$(head -n 3 <<<"$table")"
check "stand-ins: run under a minute" $((dt >= 60)) "${dt}s"

# with the machine's own LD_LIBRARY_PATH set, Python gets exactly that
# (and the workbenches fail: a FAIL row each)
env LD_LIBRARY_PATH=/opt/machine/lib OUT="$tmp/mixed2" PATH="$tmp/path:/usr/bin:/bin" \
    GPU_CHECK_BOX_SCALE=0.05 GPU_CHECK_PYTHON="$tmp/path/fakepython" FAKE_PY_ENV="$tmp/pyenv2" \
    FAKE_WB=fail FAKE_GRAPHS=off FAKE_RACE=1 bash "$bundle/gpu_check.sh" > /dev/null 2>&1
has "$(cat "$tmp/pyenv2" 2>/dev/null)" "LD_LIBRARY_PATH=/opt/machine/lib" &&
    ! has "$(cat "$tmp/pyenv2" 2>/dev/null)" "$bundle/lib"
check "the Python peer gets the machine's LD_LIBRARY_PATH, not the bundle's" $? \
    "$(cat "$tmp/pyenv2" 2>/dev/null)"
table=$(cat "$tmp/mixed2/gpu_check_table.md" 2>/dev/null)
expect_row 16 FAIL "graphs turned off: capture failed: cudaStreamEndCapture: operation not permitted"
expect_row 26 FAIL "exit 1: 1 FAIL row: dyB_gu 2048,16,11008 x 2 [K,N] skinny rel err 4.00e-02"
expect_row 36 FAIL "exit 3, 1 hazards: Error: Race reported between Write access at flash_dq_stored_kernel<128>+0x2a0; Tested: 7"
expect_row 10 FAIL "exit 1: 1 FAIL row: 1,2048,32,8,128 unfused worst rel err dq 2.50e-02; fused/unfused"
expect_row 10 FAIL "13 rows: 12 ok, 1 FAIL"
expect_row 11 FAIL "exit 1: 1 FAIL row: 2048 x 4096 add vector worst rel err 1.95e-03 = scalar NO; elem_bench: 1 row failed"
expect_row 11 FAIL "NOT bit-identical: 1 of 3 vector rows differ (add 2048 x 4096)"
has "$table" "attention workbench: \`attn_bench --iters 3\` (FAIL;" && has "$table" "| dq  2.50e-02 | FAIL |"
check "stand-ins: a failing workbench's table follows the main table" $? "$table"

# a workbench that hangs (TIMEOUT, its rows so far) and one that finds no
# device (exit 77: SKIPPED with its reason)
env -u LD_LIBRARY_PATH OUT="$tmp/mixed3" PATH="$tmp/path:/usr/bin:/bin" GPU_CHECK_BOX_SCALE=0.05 \
    GPU_CHECK_PYTHON="$tmp/path/fakepython" FAKE_PY_ENV="$tmp/pyenv3" FAKE_WB=other \
    bash "$bundle/gpu_check.sh" > /dev/null 2>&1
table=$(cat "$tmp/mixed3/gpu_check_table.md" 2>/dev/null)
expect_row 10 TIMEOUT "killed after 4s; so far: fused/unfused fwd+bwd at 7B T 2048 (1,2048,32,32,128): - "
expect_row 10 TIMEOUT "1 rows: 1 ok, 0 FAIL"
expect_row 11 SKIPPED "elem_bench: runtime.backend: cuda requested but no CUDA device is usable: cudaGetDeviceCount: no CUDA-capable device"

# --only: the chosen steps run, the others are OMITTED rows (neither failed
# nor skipped: exit 0 when the chosen ones pass); an unknown key is refused
only_run() { # only_run NAME KEYS [VAR=VALUE ...]: the stand-ins with --only KEYS; sets out, rc, table
    local name=$1 keys=$2
    shift 2
    out=$(env -u LD_LIBRARY_PATH OUT="$tmp/$name" PATH="$tmp/path:/usr/bin:/bin" GPU_CHECK_BOX_SCALE=0.1 \
        GPU_CHECK_PYTHON="$tmp/path/fakepython" FAKE_PY_ENV="$tmp/$name.pyenv" "$@" \
        bash "$bundle/gpu_check.sh" --only "$keys" 2>&1)
    rc=$?
    table=$(cat "$tmp/$name/gpu_check_table.md" 2>/dev/null)
}
only_run only b7,attn_bench
check "--only: exit 0 (the chosen steps passed)" $((rc != 0)) "exit $rc: $out"
expect_row 8 PASS "3300 tok/s"
expect_row 10 PASS "fused/unfused fwd+bwd at 7B T 2048"
expect_row 1 PASS "NVIDIA H200"
expect_row 2 OMITTED "not selected (--only b7,attn_bench)"
expect_row 22 OMITTED "not selected (--only b7,attn_bench)"
n=$(grep -cE '^\| [0-9]+ \| .* \| OMITTED \|' <<<"$table")
check "--only: the 34 other steps OMITTED" $((n != 34)) "$table"
! has "$(cat "$tmp/only/gpu_check.log" 2>/dev/null)" "-- ops:"
check "--only: an omitted step does not run" $? "$(cat "$tmp/only/gpu_check.log" 2>/dev/null)"
# the HF peer at the issue's other settings: its ratio to the spotune row of
# the same settings, or that there is none to compare
only_run onlyhf b7mb4,hf7mb4,hf13,hf7s8k,b7s8k FAKE_PY_OK=1
check "--only HF rows: exit 0" $((rc != 0)) "exit $rc: $out"
expect_row 19 PASS "1500 tok/s, step 1.000 s, peak 30.0 GiB, MFU honest 20.0% / 6N 20.4% (spotune's FLOPs per token); spotune (row 13) is 2.40x this; step 1 loss 11.1900; torch 2.11.0, peft 0.21.0"
expect_row 20 PASS "900 tok/s"
expect_row 20 PASS "no spotune row 12 to compare"
expect_row 21 PASS "1100 tok/s"
expect_row 21 PASS "spotune (row 15) is 3.00x this"
pyargs=$(cat "$tmp/onlyhf.pyenv" 2>/dev/null)
has "$pyargs" "--preset llama-7b --mode lora --micro-batch 1 --seq-len 8192 --steps 5 --warmup 1 --lora-r 16 --device cuda --dtype bfloat16"
check "--only HF rows: the peer gets the row's settings" $? "$pyargs"
out=$(OUT="$tmp/only2" bash "$bundle/gpu_check.sh" --only b7,bogus 2>&1)
rc=$?
has "$out" "--only: no step 'bogus'"
check "--only: an unknown step is refused (exit 2)" $(($? != 0 || rc != 2)) "exit $rc: $out"

# ---- 3. the budget ----------------------------------------------------------------------------
t0=$(date +%s)
out=$(env -u LD_LIBRARY_PATH OUT="$tmp/budget" PATH="$tmp/path:/usr/bin:/bin" FAKE_MODE=hang \
    GPU_CHECK_BUDGET_S=30 GPU_CHECK_PYTHON="$tmp/path/fakepython" FAKE_PY_ENV="$tmp/pyenv3" \
    bash "$bundle/gpu_check.sh" 2>&1)
rc=$?
dt=$(($(date +%s) - t0))
table=$(cat "$tmp/budget/gpu_check_table.md" 2>/dev/null)
check "budget: exit 1 (a step timed out)" $((rc != 1)) "exit $rc"
# (the budget keeps 15 s for the end; 2 s more for process starts on a
# loaded machine)
check "budget: the whole run within the 30 s budget" $((dt > 32)) "${dt}s: $out"
r=$(row "$table" 2)
[ "$(res 2)" = TIMEOUT ] && grep -qE "killed after 1[0-5]s" <<<"$r"
check "budget: the hung step cut at what was left (15 s at most)" $? "$r"
nrows=$(grep -cE '^\| [0-9]+ \|' <<<"$table")
check "budget: every row present" $((nrows != 38)) "$table"
notstarted=$(grep -E '^\| ([3-9]|[12][0-9]|3[0-7]) \|' <<<"$table" | grep -c "| SKIPPED | 0 | not started")
check "budget: the steps after it are 'not started' rows" $((notstarted != 35)) "$table"
expect_row 38 PASS "NVIDIA H200"

# ---- 4. a run cut short from outside ----------------------------------------------------------
# (its caller's time limit): the table of the rows reached is in OUT, marked
# PARTIAL, rewritten after each step
{ env -u LD_LIBRARY_PATH OUT="$tmp/cut" PATH="$tmp/path:/usr/bin:/bin" FAKE_MODE=hang \
    GPU_CHECK_BOX_SCALE=0.05 GPU_CHECK_PYTHON="$tmp/path/fakepython" FAKE_PY_ENV="$tmp/pyenv4" \
    timeout -s KILL 4 bash "$bundle/gpu_check.sh" > /dev/null 2>&1; } 2>/dev/null
table=$(cat "$tmp/cut/gpu_check_table.md" 2>/dev/null)
has "$table" "PARTIAL: the check was still running after"
check "cut short: the table in OUT says it is partial" $? "$table"
nrows=$(grep -cE '^\| [0-9]+ \|' <<<"$table")
check "cut short: every row present" $((nrows != 38)) "$table"
expect_row 1 PASS "NVIDIA H200"
has "$(row "$table" 2)" "| SKIPPED | - | not reached"
check "cut short: the step it was in is 'not reached'" $? "$table"
sleep 4 # the hung stand-in's own time box

echo "$fails failure(s)"
[ $fails -eq 0 ]
