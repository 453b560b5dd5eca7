#!/usr/bin/env bash
# The project's test command (README quick start, CI): set up, lint, type-check, run every test.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -n "${BFPP_SETUP_DONE:-}" ] || bash scripts/setup.sh  # set by .ci/run, which set it up
. "${VENV:-.venv}/bin/activate"
echo "== ruff (lint, format)"
ruff check .
ruff format --check .
echo "== mypy (pure layers, strict)"
mypy --cache-dir "${VENV:-.venv}/.mypy_cache"  # a cache per environment: two lanes at once (.ci/run) share none
echo "== pytest"
pytest -q -p no:cacheprovider --durations=15 "$@"
