#!/usr/bin/env bash
# Writes the demo's synthetic text: paragraphs of short sentences about
# coloured animals and sums ("the red cat has 3 legs and 4 eyes, 7 in all."),
# 600 KB, the same bytes for the same seed. Used by scripts/demo.sh and the
# training tests.
# usage: scripts/make_demo_text.sh OUT.txt [SEED]
set -euo pipefail
out=${1:?usage: make_demo_text.sh OUT.txt [SEED]}
seed=${2:-7}
awk -v seed="$seed" 'BEGIN {
  srand(seed)
  split("red green blue yellow black white", col, " ")
  split("cat dog fox bird fish horse", ani, " ")
  for (p = 0; p < 3000; p++) {
    for (l = 0; l < 6; l++) {
      a = int(rand() * 50); b = int(rand() * 50)
      c = col[1 + int(rand() * 6)]; n = ani[1 + int(rand() * 6)]
      if (rand() < 0.5) printf "the %s %s has %d legs and %d eyes, %d in all.\n", c, n, a, b, a + b
      else printf "%d plus %d is %d.\n", a, b, a + b
    }
    printf "\n"
  }
}' > "$out"
