#!/usr/bin/env bash
# The README's main job: set up, then pretrain a small GPT with the breadth-first schedule
# (pp=4, 2 virtual stages per rank) on 4 local CPU ranks with gloo, writing per-iteration metrics;
# then draw the same schedule with the simulator. Extra flags go to bfpp-train.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. "${VENV:-.venv}/bin/activate"
mkdir -p out
bfpp-train --pipeline-schedule breadth-first --pipeline-model-parallel-size 4 \
  --num-virtual-stages-per-pipeline-rank 2 --metrics-file out/metrics.jsonl "$@"
bfpp-sim --schedule breadth-first --pp 4 --vp 2 --microbatches 8 --grid none \
  --png out/breadth-first.png --trace out/breadth-first.json
