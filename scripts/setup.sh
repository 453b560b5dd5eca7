#!/usr/bin/env bash
# Create (or reuse) .venv and install megatron_bfpp with what the tests and the CPU demo need.
# torch is pinned first so pip takes the CPU build instead of the CUDA one with several GB of
# CUDA packages; on a GPU machine, install your CUDA torch before running this.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
. .venv/bin/activate
if ! python -c "import torch" 2>/dev/null; then
  pip install -q "torch==${TORCH_VERSION:-2.13.0}"
fi
pip install -q -e ".[test]"
