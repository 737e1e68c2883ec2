#!/usr/bin/env bash
# demo.sh — fine-tunes the tiny model with LoRA on the CPU, data-parallel over
# 2 MPI ranks, and exports the adapter in the PEFT layout. Installs what is
# missing, builds (CPU only, for speed), makes the model and the data, trains
# (about two minutes on 2 cores) and shows the loss falling.
# usage: scripts/demo.sh [RANKS]        (default 2)
set -euo pipefail
cd "$(dirname "$0")/.."
ranks=${1:-2}

scripts/install-deps.sh
echo "== building (build-cpu/)"
cmake -S . -B build-cpu -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSPOTUNE_CUDA=OFF >/dev/null
ninja -C build-cpu spotune >/dev/null
spotune=build-cpu/spotune

inputs=runs/demo-inputs
mkdir -p "$inputs"
if [ ! -f "$inputs/data.train.h5" ]; then
  echo "== making the demo data: synthetic sentences, byte-level tokens"
  scripts/make_demo_text.sh "$inputs/demo.txt"
  "$spotune" prepare-text "$inputs/demo.txt" "$inputs/data" --val-fraction 0.05
fi
if [ ! -f "$inputs/tiny-model/config.json" ]; then
  echo "== making the tiny model (random weights, Hugging Face layout)"
  "$spotune" init-model --preset tiny --seed 1 "$inputs/tiny-model"
fi

if [ "$(id -u)" -eq 0 ]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
rm -rf runs/demo
echo "== training: mpirun -np $ranks $spotune train configs/tiny-cpu.yaml"
mpirun -np "$ranks" --oversubscribe "$spotune" train configs/tiny-cpu.yaml

echo "== validation loss, from runs/demo/metrics.jsonl"
grep '"event":"val"' runs/demo/metrics.jsonl |
  sed -E 's/.*"step":([0-9]+).*"val_loss":([0-9.]+).*/  step \1: \2/'
if [ -x .venv/bin/python ] && .venv/bin/python -c "import matplotlib" 2>/dev/null; then
  .venv/bin/python scripts/plot_metrics.py runs/demo --out runs/demo/loss.png &&
    echo "plot: runs/demo/loss.png"
fi
echo "adapter (PEFT layout): runs/demo/adapter/ (adapter_model.safetensors, adapter_config.json)"
