"""The README's first command on a fresh virtual environment: the eSpeak NG path installs small,
pulls no torch, imports none, and a codec-LM model is refused with the command that installs it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).parents[2]
#: The eSpeak NG path must install in under this (issue 15: it was 5.7 GB with torch); measured 199 MB on
#: 2026-12-01, 447 MB (du) once PyAV (104 MB) and SciPy (143 MB) came in for the audiobook formats.
LIMIT_MB = 500


def size_mb(path: Path) -> float:
    return sum(p.lstat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink()) / 1e6


@pytest.fixture(scope="module")
def fresh_venv(tmp_path_factory):
    """``python3 -m venv .venv && .venv/bin/pip install -e '.[espeak]'`` (the README's first command)."""
    venv = tmp_path_factory.mktemp("fresh") / ".venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    subprocess.run(
        [str(venv / "bin" / "pip"), "install", "-q", "--disable-pip-version-check", "-e", f"{ROOT}[espeak]"],
        check=True,
        timeout=900,
    )
    return venv


def run(venv: Path, cwd: Path, *args: str, **kw):
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("REDIS_URL", "PYTHONPATH") and not k.startswith("NARRATE_")
    }
    env["NARRATE_DATA_DIR"] = str(cwd / "data")
    return subprocess.run(
        [str(venv / "bin" / "python"), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        **kw,
    )


def test_the_espeak_path_installs_small_and_needs_no_torch(fresh_venv, tmp_path):
    listed = subprocess.run(
        [str(fresh_venv / "bin" / "pip"), "list"], capture_output=True, text=True, check=True
    )
    names = {line.split()[0].lower() for line in listed.stdout.splitlines()[2:]}
    assert not {n for n in names if n == "torch" or n.startswith(("nvidia", "triton", "transformers"))}, names
    size = size_mb(fresh_venv)
    print(f"fresh venv with the espeak extra: {size:.0f} MB")
    assert size < LIMIT_MB
    (tmp_path / "book.md").write_text("# One\n\nHello there. Goodbye.\n", encoding="utf-8")
    result = run(
        fresh_venv, tmp_path, "-X", "importtime", "-m", "narrate.cli", "file", "book.md", "-o", "book.wav"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    imported = [
        line.rsplit("|", 1)[-1].strip()
        for line in result.stderr.splitlines()
        if line.startswith("import time:")
    ]
    assert imported and not [m for m in imported if m.split(".")[0] in ("torch", "snac", "transformers")]
    assert (tmp_path / "book.wav").stat().st_size > 10_000


def test_without_the_codec_extra_the_codec_models_say_how_to_get_it(fresh_venv, tmp_path):
    models = run(fresh_venv, tmp_path, "-m", "narrate.cli", "models")
    assert models.returncode == 0, models.stderr
    assert models.stdout.startswith("narrate file uses: espeak")
    tiny = models.stdout.split("\ntiny: ", 1)[1].split("\n\n", 1)[0]
    assert (
        "unavailable: it needs the codec extra (torch" in tiny
        and "pip install 'narration-fleet[codec]'" in tiny
    )
    (tmp_path / "book.md").write_text("Hello.", encoding="utf-8")
    refused = run(fresh_venv, tmp_path, "-m", "narrate.cli", "file", "book.md", "--model", "tiny")
    assert (
        refused.returncode == 2 and "model 'tiny' cannot run here: it needs the codec extra" in refused.stderr
    )
    assert not (tmp_path / "data").exists()
