#!/usr/bin/env bash
# One command: install everything the tests need (router, simulator, real vLLM CPU build
# and NIXL for the real_engine tests) into .venv, then run every test.
# Extra arguments go to pytest, e.g. `scripts/test.sh -m "not real_engine"`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# dnsmasq: the real DNS server of the discovery tests.
if ! command -v dnsmasq >/dev/null && [ ! -x /usr/sbin/dnsmasq ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq dnsmasq-base
    else
        echo "scripts/test.sh: install dnsmasq (Debian: apt-get install dnsmasq-base) for the discovery tests" >&2
    fi
fi
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install --quiet --upgrade pip
python -m pip install --quiet -e '.[test,bench]'
# Real engines: vLLM CPU build + NIXL, with their install quirks handled (see README).
engine-launcher install-deps --cpu
exec python -m pytest "$@"
