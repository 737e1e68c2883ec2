#!/usr/bin/env bash
# bench_cpu.sh — tokens/s of a training step on the CPU: spotune against
# PyTorch with transformers + PEFT on the same number of threads, same model
# (the `small` preset: vocabulary 32000, hidden 768, 12 layers, 12 heads / 4 KV
# heads), micro_batch 4 x seq_len 256, LoRA r=16 on all 7 projections and full
# fine-tuning. Each mode runs --runs times (3), spotune and the peer
# alternated; prints every pair and a median line whose ratio is the median
# of spotune over the median of the peer (a shared machine moves either by
# 10-20% from run to run: one pair's ratio is mostly noise). A benchmark, not
# a test.
# The peer needs torch, transformers and PEFT (scripts/install-deps.sh
# --python --hf puts them in .venv, the default PY when it exists); without
# them only spotune's figures are printed.
# The peer runs with glibc's malloc told to keep freed memory
# (MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_, MALLOC_TOP_PAD_): PyTorch's
# CPU allocator gives its large blocks (the logits, activations and their
# gradients) back to the system every step and faults them in again, which on
# some virtual machines costs it nearly half its speed (275 against 489
# tokens/s for LoRA, docs/perf.md); the settings do what the jemalloc or
# tcmalloc preload of PyTorch's CPU tuning guides does. --peer-malloc system
# runs it with glibc's defaults. spotune allocates its arenas once.
# spotune runs as its own advice has it: where an OPENBLAS_CORETYPE set in
# the environment holds OpenBLAS to kernels narrower than the CPU's vector
# units (spotune keeps a value the user set, and warns, naming the better
# one), this script runs spotune with the better value, as it does the peer
# with its tuning guides' allocator; --spotune-blas as-set keeps the
# environment's (up to 2x slower: docs/perf.md, the Zen 5 rows). The first
# line after the header names the kernels of spotune's products (OpenBLAS's,
# and spotune's own for LoRA's narrow ones) and what was done.
# usage: scripts/bench_cpu.sh [--threads N] [--steps N] [--warmup N] [--runs N] [--python PY]
#                             [--peer-malloc keep|system] [--spotune-blas best|as-set]
set -euo pipefail
cd "$(dirname "$0")/.."
threads=$(nproc) steps=3 warmup=1 runs=3 py=python3 peer_malloc=keep spotune_blas=best
[ -x .venv/bin/python ] && py=.venv/bin/python
usage="usage: scripts/bench_cpu.sh [--threads N] [--steps N] [--warmup N] [--runs N] [--python PY] [--peer-malloc keep|system] [--spotune-blas best|as-set]"
while [ $# -gt 0 ]; do
  case "$1" in
    --threads) threads=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    --warmup) warmup=$2; shift 2 ;;
    --runs) runs=$2; shift 2 ;;
    --python) py=$2; shift 2 ;;
    --peer-malloc) peer_malloc=$2; shift 2 ;;
    --spotune-blas) spotune_blas=$2; shift 2 ;;
    *) echo "$usage" >&2; exit 2 ;;
  esac
done
case "$runs" in ''|*[!0-9]*|0) echo "bench_cpu: --runs wants a whole number from 1 ($runs)" >&2; exit 2 ;; esac
case "$peer_malloc" in
  keep) peer_env=(MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=68719476736
                  MALLOC_TOP_PAD_=1073741824) ;;
  system) peer_env=() ;;
  *) echo "bench_cpu: --peer-malloc wants keep or system ($peer_malloc)" >&2; exit 2 ;;
esac
case "$spotune_blas" in best|as-set) ;; *) echo "bench_cpu: --spotune-blas wants best or as-set ($spotune_blas)" >&2; exit 2 ;; esac
scripts/install-deps.sh >/dev/null
cmake -S . -B build-cpu -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSPOTUNE_CUDA=OFF >/dev/null
ninja -C build-cpu spotune >/dev/null
model=runs/bench/small
[ -f "$model/config.json" ] || build-cpu/spotune init-model --preset small --seed 1 "$model" >/dev/null
# spotune's advice on the kernels of its products (a one-step run says it)
blas_json=$(build-cpu/spotune bench --preset tiny --mode lora --micro-batch 1 --seq-len 32 --steps 1 \
  --warmup 0 --threads 1 --backend cpu --json 2>/dev/null)
better=$(echo "$blas_json" | sed -nE 's/.*"blas_better":"([^"]*)".*/\1/p')
blas_note="" spotune_env=()
if [ -n "$better" ] && [ "$spotune_blas" = best ]; then
  blas_note="OPENBLAS_CORETYPE=${OPENBLAS_CORETYPE:-} in the environment holds OpenBLAS below this CPU; spotune runs with OPENBLAS_CORETYPE=$better, as it advises (--spotune-blas as-set keeps the environment's)"
  spotune_env=(OPENBLAS_CORETYPE="$better") # spotune's runs only: the peer is as it was
elif [ -n "$better" ]; then
  blas_note="OPENBLAS_CORETYPE=${OPENBLAS_CORETYPE:-} holds OpenBLAS below this CPU, kept (--spotune-blas as-set): with $better spotune's figures are higher; the peer does not read it"
fi

field() { sed -E "s/.*\"$1\": ?([0-9.eE+-]+).*/\1/"; }
median() { sort -g | awk '{ v[NR] = $1 } END { if (NR % 2) print v[(NR + 1) / 2]; else print (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
peer_ok=1 blas_said=""
"$py" -c "import torch, transformers, peft" 2>/dev/null || peer_ok=0
echo "CPU training step, small preset (110M), micro_batch 4 x seq_len 256, $threads thread(s), $steps timed step(s), $runs run(s) a mode; the peer's malloc: $peer_malloc"
printf "%-6s %6s %16s %16s %8s\n" mode run "spotune tok/s" "HF+PEFT tok/s" ratio
for mode in lora full; do
  ours_all="" theirs_all=""
  for run in $(seq 1 "$runs"); do
    json=$(env "${spotune_env[@]}" build-cpu/spotune bench --preset small --mode "$mode" --micro-batch 4 --seq-len 256 \
      --steps "$steps" --warmup "$warmup" --threads "$threads" --backend cpu --json)
    ours=$(echo "$json" | field tokens_per_s)
    if [ -z "$blas_said" ]; then # the kernels of spotune's products move its figure by up to 2x
      blas_said=1
      echo "spotune's products: $(echo "$json" | sed -nE 's/.*"blas":"([^"]*)".*/\1/p')"
      [ -z "$blas_note" ] || echo "  ($blas_note)"
    fi
    ours_all="$ours_all $ours"
    if [ "$peer_ok" = 1 ]; then
      theirs=$(env "${peer_env[@]}" "$py" scripts/bench_hf_peft.py --model "$model" --mode "$mode" --micro-batch 4 \
        --seq-len 256 --threads "$threads" --steps "$steps" --warmup "$warmup" 2>/dev/null | field tokens_per_s)
      theirs_all="$theirs_all $theirs"
      ratio=$(awk -v a="$ours" -v b="$theirs" 'BEGIN { printf "%.2fx", a / b }')
      theirs=$(printf "%.1f" "$theirs")
    else
      theirs="(no torch)" ratio="-"
    fi
    printf "%-6s %6s %16.1f %16s %8s\n" "$mode" "$run" "$ours" "$theirs" "$ratio"
  done
  om=$(echo "$ours_all" | tr ' ' '\n' | grep . | median)
  if [ "$peer_ok" = 1 ]; then
    tm=$(echo "$theirs_all" | tr ' ' '\n' | grep . | median)
    ratio=$(awk -v a="$om" -v b="$tm" 'BEGIN { printf "%.2fx", a / b }')
    tm=$(printf "%.1f" "$tm")
  else
    tm="(no torch)" ratio="-"
  fi
  printf "%-6s %6s %16.1f %16s %8s\n" "$mode" median "$om" "$tm" "$ratio"
done
[ "$peer_ok" = 1 ] || echo "the peer needs torch, transformers and PEFT: scripts/install-deps.sh --python --hf"
