"""bench/gpu_decoder_run.sh, the decoder-only GPU call, run here with DECODER_FLAGS="--device cpu": its
arguments still parse, both runs come back with their results and kernel tables, the second with
cuDNN's autotuning recorded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).parents[2]


def test_the_decoder_call_brings_back_both_runs(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    env = {
        **os.environ,
        "OUT": str(out),
        "DECODER_FLAGS": "--device cpu",
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",  # python3: this interpreter
    }
    done = subprocess.run(
        ["bash", "bench/gpu_decoder_run.sh", "280"]
        + ["--window-count", "4", "--read-sizes", "4", "--repeats", "1"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    card = (out / "card.txt").read_text()
    assert "dec: exit status 0" in card and "dec-cudnn: exit status 0" in card, card
    first, second = (json.loads((out / f"{name}.json").read_text()) for name in ("dec", "dec-cudnn"))
    assert first["cudnn_benchmark"] is False and second["cudnn_benchmark"] is True
    assert set(first["device_seconds"]) == set(second["device_seconds"]) >= {"uniform cut", "uniform cut@0"}
    with tarfile.open(out / "kernels.tgz") as tables:
        names = tables.getnames()
    assert "dec/kernels-uniform-cut-reads-of-4.txt" in names
    assert "dec-cudnn/kernels-uniform-cut-reads-of-32.txt" in names
    assert "new audio-s/s" in done.stdout  # the figures, printed at the end
