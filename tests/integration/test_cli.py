"""The README's first command: ``narrate file`` on embedded defaults (private Valkey, local storage)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import soundfile as sf

pytestmark = pytest.mark.integration


def test_narrate_file_on_embedded_defaults(tmp_path, tiny_dir):
    data = tmp_path / "data"
    (data / "models").mkdir(parents=True)
    shutil.copytree(tiny_dir, data / "models" / tiny_dir.name)  # skip rebuilding the tiny model
    book = tmp_path / "book.md"
    book.write_text("# One\n\nHello there. How are you?\n\n# Two\n\nFine, thanks.", encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL" and not k.startswith("NARRATE_")}
    env["NARRATE_DATA_DIR"] = str(data)
    result = subprocess.run(
        [sys.executable, "-m", "fleet.cli", "file", str(book), "-o", str(tmp_path / "book.wav")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    info = sf.info(tmp_path / "book.wav")
    assert info.samplerate == 24000 and info.frames > 24000
    assert "5 segments, 2 chapters" in result.stdout
    assert "100%" in result.stderr  # the progress bar ran to the end
    # the embedded server kept its data, append-only, in the data dir
    assert any((data / "valkey" / "appendonlydir").iterdir())


def test_narrate_file_refuses_bad_input(tmp_path, tiny_dir):
    data = tmp_path / "data"
    (data / "models").mkdir(parents=True)
    shutil.copytree(tiny_dir, data / "models" / tiny_dir.name)
    empty = tmp_path / "empty.md"
    empty.write_text("   \n", encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL" and not k.startswith("NARRATE_")}
    env["NARRATE_DATA_DIR"] = str(data)
    result = subprocess.run(
        [sys.executable, "-m", "fleet.cli", "file", str(empty)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2 and "text is empty" in result.stderr
