#!/usr/bin/env bash
# plan_table.sh — the table of docs/plan.md, made by `spotune plan --json`:
# Llama-2-7B and 13B shapes (the llama-7b and llama-13b presets) x LoRA r 16 on
# all 7 projections, QLoRA, full fine-tuning (on 1 GPU and on 8 with the
# optimizer sharded) x a 24, 48, 80 and 141 GB card; seq_len 2048, micro_batch
# 1, no recompute. Prints Markdown; tests/test_plan.c checks docs/plan.md
# carries it unchanged.
# usage: scripts/plan_table.sh [--spotune PATH]   (default: build/spotune)
set -euo pipefail
cd "$(dirname "$0")/.."
spotune=build/spotune
while [ $# -gt 0 ]; do
  case "$1" in
    --spotune) spotune=$2; shift 2 ;;
    *) echo "usage: scripts/plan_table.sh [--spotune PATH]" >&2; exit 2 ;;
  esac
done
[ -x "$spotune" ] || { echo "plan_table.sh: $spotune is not an executable (--spotune PATH)" >&2; exit 2; }

echo "| model | mode | card | GPUs | weights GiB | trainable + grads + optimizer GiB | activations GiB | total GiB | fits | cheapest change that fits (GiB per GPU) | tokens/s per GPU | checkpoint GB |"
echo "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | --- | --- | ---: | ---: |"
for model in llama-7b llama-13b; do
  for mode in lora qlora full full8; do
    for gpu in RTX4090 L40S H100 H200; do
      gpus=1 m=$mode
      [ "$mode" = full8 ] && gpus=8 m=full
      # exit 2 with a plan printed: nothing fits (the JSON says so too)
      json=$("$spotune" plan "$model" --mode "$m" --gpu "$gpu" --gpus "$gpus" --json 2>/dev/null) || true
      [ -n "$json" ] || { echo "plan_table.sh: spotune plan $model --mode $m --gpu $gpu failed" >&2; exit 1; }
      python3 -c '
import json, sys
j = json.loads(sys.argv[1])
m, g = j["memory_gib"], j["gpu"]
state = m["trainable"] + m["gradients"] + m["optimizer"]
if j["fits"]:
    fits, fix = "yes", ""
else:
    fits = "no"
    fx = j["fixes"]
    fix = "%s (%.1f)" % (fx[0]["change"], fx[0]["total_gib"]) if fx else "nothing"
mode = j["mode"]
print("| %s | %s | %s | %d | %.1f | %.1f | %.1f | %.1f | %s | %s | %.0f | %.2f |" % (
    j["model"], mode, g["name"], g["gpus"], m["weights"], state, m["activations"], m["total"],
    fits, fix, j["speed"]["tokens_per_s_gpu"], j["checkpoint"]["bytes"] / 1e9))
' "$json"
    done
  done
done
