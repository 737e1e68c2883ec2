#!/usr/bin/env bash
# demo.sh — fine-tunes the tiny model with LoRA on the CPU, data-parallel over
# 2 MPI ranks, and survives a simulated preemption: halfway through, the job
# gets the signal a spot-termination notice brings (SIGUSR1), checkpoints,
# pushes the checkpoint to an object store (a file:// bucket here) and exits
# 75; the run directory is then deleted, as a vanished machine's disk would
# be, and the same command on a "new machine" with half the ranks (a spot
# machine with fewer GPUs) resumes from the bucket, keeps the global batch
# (each rank accumulates more micro-batches) and finishes. Finally the
# adapter is exported in the PEFT layout. Before training, `spotune doctor`
# checks the machine and the run's inputs. Installs what is missing, builds
# (CPU only, for speed), makes the model and the data, and shows the loss
# falling (about two minutes on 2 cores).
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
rm -rf runs/demo runs/demo-bucket
bucket="file://$PWD/runs/demo-bucket"
# what a user runs first on a machine they just rented: the host, the disk,
# the store, the model, the data and the memory plan (no GPU here: those
# lines are SKIPPED with the reason)
echo "== checking this machine for the run: spotune doctor"
"$spotune" doctor configs/tiny-cpu.yaml --cloud none --io-mib 16 --remote "$bucket" ||
  echo "   (the doctor found a FAIL above; the demo goes on)"
args=("$spotune" train configs/tiny-cpu.yaml
      --set checkpoint.remote="$bucket" --set checkpoint.every_steps=25)
train=(mpirun -np "$ranks" --oversubscribe "${args[@]}")
# the new machine: half the ranks (1 rank: 2)
again=$(( ranks > 1 ? ranks / 2 : 2 ))
echo "== training: ${train[*]}"
"${train[@]}" &
job=$!
# the "spot-termination notice" arrives at step 100
until grep -q '"step":100,' runs/demo/metrics.jsonl 2>/dev/null || ! kill -0 "$job" 2>/dev/null; do
  sleep 0.2
done
echo "== simulated preemption: SIGUSR1 to mpirun (forwarded to every rank)"
kill -USR1 "$job" 2>/dev/null || true
rc=0
wait "$job" || rc=$?
echo "== the job exited $rc (75: stopped after a complete checkpoint)"
echo "== the machine is gone: deleting runs/demo; the checkpoints in $bucket remain"
rm -rf runs/demo
echo "== the same command on a new machine with $again rank(s) instead of $ranks"
resume=(mpirun -np "$again" --oversubscribe "${args[@]}")
echo "   ${resume[*]}"
"${resume[@]}"
echo "== the checkpoints left in the bucket"
"$spotune" ckpt list "$bucket"
echo "== the adapter of the last checkpoint, exported again from the bucket"
last=$(ls runs/demo-bucket | grep '^step-' | tail -1)
"$spotune" export "$bucket/$last" --peft runs/demo/adapter-from-bucket
cmp runs/demo/adapter/adapter_model.safetensors \
  runs/demo/adapter-from-bucket/adapter_model.safetensors &&
  echo "   identical to the run's own runs/demo/adapter/"

echo "== validation loss, from runs/demo/metrics.jsonl"
grep '"event":"val"' runs/demo/metrics.jsonl |
  sed -E 's/.*"step":([0-9]+).*"val_loss":([0-9.]+).*/  step \1: \2/'
if [ -x .venv/bin/python ] && .venv/bin/python -c "import matplotlib" 2>/dev/null; then
  .venv/bin/python scripts/plot_metrics.py runs/demo --out runs/demo/loss.png &&
    echo "plot: runs/demo/loss.png"
fi
echo "adapter (PEFT layout): runs/demo/adapter/ (adapter_model.safetensors, adapter_config.json)"
