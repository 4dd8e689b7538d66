#!/usr/bin/env bash
# One command: install everything the tests need (router, simulator, real vLLM CPU build
# and NIXL for the real_engine tests) into .venv, then run every test.
# Extra arguments go to pytest, e.g. `scripts/test.sh -m "not real_engine"`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install --quiet --upgrade pip
python -m pip install --quiet -e '.[test,bench]'
# Real engines: vLLM CPU build + NIXL, with their install quirks handled (see README).
engine-launcher install-deps --cpu
exec python -m pytest "$@"
