#!/usr/bin/env bash
# bench_cpu.sh — tokens/s of a training step on the CPU: spotune against
# PyTorch with transformers + PEFT on the same number of threads, same model
# (the `small` preset: vocabulary 32000, hidden 768, 12 layers, 12 heads / 4 KV
# heads), micro_batch 4 x seq_len 256, LoRA r=16 on all 7 projections and full
# fine-tuning. Prints a table and the ratio. A benchmark, not a test.
# The peer needs: pip install torch transformers peft (the CPU build of torch
# is enough); without it only spotune's figures are printed.
# usage: scripts/bench_cpu.sh [--threads N] [--steps N] [--warmup N] [--python PY]
set -euo pipefail
cd "$(dirname "$0")/.."
threads=$(nproc) steps=3 warmup=1 py=python3
while [ $# -gt 0 ]; do
  case "$1" in
    --threads) threads=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    --warmup) warmup=$2; shift 2 ;;
    --python) py=$2; shift 2 ;;
    *) echo "usage: scripts/bench_cpu.sh [--threads N] [--steps N] [--warmup N] [--python PY]" >&2; exit 2 ;;
  esac
done
scripts/install-deps.sh >/dev/null
cmake -S . -B build-cpu -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSPOTUNE_CUDA=OFF >/dev/null
ninja -C build-cpu spotune >/dev/null
model=runs/bench/small
[ -f "$model/config.json" ] || build-cpu/spotune init-model --preset small --seed 1 "$model" >/dev/null

field() { sed -E "s/.*\"$1\": ?([0-9.eE+-]+).*/\1/"; }
peer_ok=1
"$py" -c "import torch, transformers, peft" 2>/dev/null || peer_ok=0
echo "CPU training step, small preset (110M), micro_batch 4 x seq_len 256, $threads thread(s), $steps timed step(s)"
printf "%-6s %16s %16s %8s\n" mode "spotune tok/s" "HF+PEFT tok/s" ratio
for mode in lora full; do
  ours=$(build-cpu/spotune bench --preset small --mode "$mode" --micro-batch 4 --seq-len 256 \
    --steps "$steps" --warmup "$warmup" --threads "$threads" --backend cpu --json | field tokens_per_s)
  if [ "$peer_ok" = 1 ]; then
    theirs=$("$py" scripts/bench_hf_peft.py --model "$model" --mode "$mode" --micro-batch 4 \
      --seq-len 256 --threads "$threads" --steps "$steps" --warmup "$warmup" 2>/dev/null | field tokens_per_s)
    ratio=$(awk -v a="$ours" -v b="$theirs" 'BEGIN { printf "%.2fx", a / b }')
  else
    theirs="(no torch)" ratio="-"
  fi
  [ "$peer_ok" = 1 ] && theirs=$(printf "%.1f" "$theirs")
  printf "%-6s %16.1f %16s %8s\n" "$mode" "$ours" "$theirs" "$ratio"
done
[ "$peer_ok" = 1 ] || echo "the peer needs: pip install torch transformers peft"
