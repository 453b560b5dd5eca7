#!/usr/bin/env bash
# The README's main job: set up, then simulate and draw a breadth-first schedule
# (pp=4, 2 chunks per rank, 8 micro-batches). Real pretraining with bfpp-train replaces this
# once the runtime lands; see the README.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
mkdir -p out
bfpp-sim --schedule breadth-first --pp 4 --vp 2 --microbatches 8 \
  --t-forward 1 --t-backward 2 --t-grad-reduce 1 \
  --png out/breadth-first.png --trace out/breadth-first.json "$@"
