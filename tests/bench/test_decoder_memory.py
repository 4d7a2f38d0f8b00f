"""bench/decoder_speed.py --memory on the CPU: the SNAC decoder's activations per frame decoded,
the figure behind ``decode_max_frames`` (~2.5 MiB a frame in float32, whatever the batch)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]


def test_the_decoders_activations_grow_with_the_frames_of_a_pass(tmp_path):
    done = subprocess.run(
        [sys.executable, "bench/decoder_speed.py", "--memory", "--batches", "1,3", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "RESULT decoder memory limit: none" in done.stdout
    result = json.loads((tmp_path / "decoder_memory.json").read_text())
    per_frame = {int(b): v / 2**20 for b, v in result["per_frame_bytes"].items()}
    assert set(per_frame) == {1, 3} and result["mix"] is None  # the allocator's mix: on a GPU only
    # the last upsampling block's 64 channels at 2,048 samples a frame, a few tensors alive at once
    assert 1.0 < per_frame[1] < 5.0
    assert abs(per_frame[3] - per_frame[1]) / per_frame[1] < 0.05  # per frame, not per pass
