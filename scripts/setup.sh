#!/usr/bin/env bash
# Create (or reuse) a virtual environment with megatron_bfpp and what the tests and the CPU demo
# need, on the right stack for this machine:
#   primary: Python >= 3.12 (3.12 preferred) with megatron-core 0.19.x and torch 2.14.1, when such
#            a Python exists (PATH or pyenv);
#   0.16:    otherwise the newest Python 3.10/3.11 with megatron-core 0.16.1 and torch 2.13.0.
# Prints one line saying which. Environment:
#   BFPP_STACK=auto|0.19|0.16   force a stack (default auto, as above)
#   BFPP_STACK=0.17|0.18        megatron-core 0.17.1 / 0.18.2 on Python 3.12 with torch 2.14.1
#                               (.ci/run runs a selection of the tests on them)
#   BFPP_STACK=bridge           the 0.19 stack plus Megatron-Bridge 0.6.2 (Python 3.12) for
#                               tests/bridge (its CPU shims live in megatron_bfpp.testing)
#   VENV=DIR                    the environment's folder (default .venv)
#   PYTHON=/path/to/python      use this interpreter (its version decides the stack)
# torch is installed first, pinned (TORCH_VERSION, default by stack: 2.14.1, or 2.13.0 on the 0.16
# and bridge stacks; both in megatron_bfpp.compat.TORCH_WINDOW), so pip does not pick a newer
# release: on Python 3.11 this machine kind has a local CPU build of torch 2.13.0; elsewhere
# PyPI's build is used (on Linux it
# brings CUDA libraries, which run fine without a GPU). On a GPU machine install your CUDA torch
# into the environment first.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
STACK=${BFPP_STACK:-auto}

die() { echo "setup.sh: error: $*" >&2; exit 2; }

# "3 12" for an interpreter, or nothing if it does not run.
py_version() { "$1" -c 'import sys; print(*sys.version_info[:2])' 2>/dev/null || true; }

# Interpreters to consider: PATH names, then pyenv's installed versions.
candidates() {
  local name root
  for name in python3.12 python3.13 python3.14 python3.11 python3.10 python3; do
    command -v "$name" 2>/dev/null || true
  done
  if command -v pyenv >/dev/null 2>&1; then
    root=$(pyenv root 2>/dev/null || true)
    [ -n "$root" ] && ls -d "$root"/versions/3.1[0-9]*/bin/python 2>/dev/null || true
  fi
}

# The best interpreter for a stack: "new" = 3.12 first, then any newer; "old" = newest 3.10/3.11.
pick_python() {
  local want=$1 best="" best_key=-1 py major minor key
  while read -r py; do
    [ -x "$py" ] || continue
    read -r major minor <<<"$(py_version "$py")" || continue
    [ "${major:-0}" = 3 ] || continue
    if [ "$want" = new ]; then
      [ "$minor" -ge 12 ] || continue
      key=$((minor == 12 ? 100 : 100 - minor))  # 3.12 is the tested one
    else
      [ "$minor" -ge 10 ] && [ "$minor" -le 11 ] || continue
      key=$minor
    fi
    if [ "$key" -gt "$best_key" ]; then best=$py; best_key=$key; fi
  done < <(candidates)
  echo "$best"
}

if [ -n "${PYTHON:-}" ]; then
  command -v "$PYTHON" >/dev/null 2>&1 || die "PYTHON=$PYTHON is not an interpreter"
  read -r _ minor <<<"$(py_version "$PYTHON")"
  if [ "$STACK" = auto ]; then STACK=$([ "${minor:-0}" -ge 12 ] && echo 0.19 || echo 0.16); fi
else
  case "$STACK" in
    auto)
      PYTHON=$(pick_python new)
      if [ -n "$PYTHON" ]; then STACK=0.19; else PYTHON=$(pick_python old); STACK=0.16; fi ;;
    0.19|0.18|0.17|bridge) PYTHON=$(pick_python new) ;;
    0.16) PYTHON=$(pick_python old) ;;
    *) die "BFPP_STACK must be auto, 0.19, 0.18, 0.17, 0.16 or bridge, got '$STACK'" ;;
  esac
fi
# Each stack: its megatron-core and the torch it is tested with.
case "$STACK" in
  0.19) CORE="megatron-core>=0.19.2,<0.20" TORCH="2.14.1" ;;
  0.18) CORE="megatron-core==0.18.2" TORCH="2.14.1" ;;
  0.17) CORE="megatron-core==0.17.1" TORCH="2.14.1" ;;
  0.16) CORE="megatron-core==0.16.1" TORCH="2.13.0" ;;
  bridge) CORE="megatron-core==0.19.2" TORCH="2.13.0" ;;
  *) die "BFPP_STACK must be auto, 0.19, 0.18, 0.17, 0.16 or bridge, got '$STACK'" ;;
esac
TORCH_VERSION=${TORCH_VERSION:-$TORCH}
[ -n "$PYTHON" ] || die "no Python for megatron-core $STACK found (0.19 needs Python >= 3.12, \
0.16 needs 3.10 or 3.11, 0.17 and 0.18 need 3.12; install one, e.g. pyenv install 3.12, or set PYTHON=...)"
PY_VERSION=$(py_version "$PYTHON" | tr ' ' .)

# A folder made for another Python is rebuilt rather than silently reused.
if [ -x "$VENV/bin/python" ] && [ "$(py_version "$VENV/bin/python" | tr ' ' .)" != "$PY_VERSION" ]; then
  rm -rf "$VENV"
fi
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
. "$VENV/bin/activate"
# A torch already there (a GPU machine's own CUDA build) is kept.
if ! python -c "import torch" 2>/dev/null; then
  pip install -q "torch==$TORCH_VERSION"
fi
echo "setup.sh: megatron-core $STACK stack: Python $PY_VERSION ($PYTHON), torch" \
  "$(python -c 'import torch; print(torch.__version__)' 2>/dev/null) in $VENV"
pip install -q -e ".[test]" "$CORE"
if [ "$STACK" = bridge ]; then
  [ "$PY_VERSION" = 3.12 ] || die "Megatron-Bridge 0.6.2 needs Python 3.12, got $PY_VERSION"
  # Bridge's own requirements pull in GPU-only packages (Transformer Engine, flashinfer, ...):
  # install it without them, with what its training modules import.
  pip install -q --no-deps "megatron-bridge==0.6.2"
  pip install -q "transformers>=5.8,<=5.12.1" datasets "tensorboard>=2.19" "omegaconf>=2.3" \
    einops megatron-energon "hydra-core>=1.3.4,<1.4" rich tqdm pyyaml regex six "wandb==0.29.0" \
    nvidia-modelopt defusedxml
  # nvidia-resiliency-ext (megatron-core reads its version; Bridge imports it) is published
  # only as manylinux_2_39 wheels; the parts Bridge imports are pure Python, so an older glibc
  # takes the same wheel under an older tag.
  if ! python -c "import nvidia_resiliency_ext" 2>/dev/null; then
    wheels=$(mktemp -d)
    pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --platform manylinux_2_39_x86_64 -d "$wheels" "nvidia-resiliency-ext==0.6.0"
    for wheel in "$wheels"/*manylinux_2_39*.whl; do
      mv "$wheel" "${wheel/manylinux_2_39/manylinux_2_17}"
    done
    pip install -q --no-deps "$wheels"/*.whl
    rm -rf "$wheels"
  fi
fi
