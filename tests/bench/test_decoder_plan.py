"""bench/decoder_speed.py --windows --plan-only: how a GPU decoder would group the fleet bench's
windows into passes (counted on the CPU, nothing decoded), the figures behind
``decode_pass_cost_frames``."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]


def test_a_pass_cost_trades_frames_for_fewer_passes_on_the_fleets_windows(tmp_path):
    done = subprocess.run(
        [sys.executable, "bench/decoder_speed.py", "--windows", "--plan-only", "--window-count", "400"]
        + ["--read-sizes", "32", "--pass-costs", "0", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    passes = json.loads((tmp_path / "decoder_windows.json").read_text())["passes"]
    for windows in ("uniform", "uneven"):
        plans = {
            decode: passes[f"{windows} {decode}"]["32"]["as on a GPU"] for decode in ("whole", "cut", "cut@0")
        }
        whole, cut, fewest = plans["whole"], plans["cut"], plans["cut@0"]
        # grouped for the fewest frames: fewer frames than the fleet's grouping, in more passes
        assert (
            fewest["back_frames_a_new_frame"]
            < cut["back_frames_a_new_frame"]
            < whole["back_frames_a_new_frame"]
        )
        assert fewest["back_passes_a_read"] > cut["back_passes_a_read"]
        # the first block sees whole windows, however the rest is grouped
        assert fewest["front_passes_a_read"] == cut["front_passes_a_read"] == whole["front_passes_a_read"]
    uniform = passes["uniform cut"]["32"]["as on a GPU"]
    # windows of one length: the fleet's grouping cuts them in about one pass a read, as whole windows go
    assert (
        uniform["back_passes_a_read"]
        < 1.5 * passes["uniform whole"]["32"]["as on a GPU"]["back_passes_a_read"]
    )


def test_the_decoders_device_time_is_summed_for_every_variant(tmp_path):
    """--device-time: each variant decoded once more under torch.profiler (on the CPU the operators'
    own time; on a GPU the kernels'), for the same new audio as the timed runs."""
    done = subprocess.run(
        [sys.executable, "bench/decoder_speed.py", "--windows", "--window-count", "4", "--read-sizes", "4"]
        + ["--repeats", "1", "--pass-costs", "", "--device-time", "--cudnn-benchmark"]
        + ["--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads((tmp_path / "decoder_windows.json").read_text())
    assert result["cudnn_benchmark"] is True  # recorded beside the figures it may change
    keys = {f"{windows} {decode}" for windows in ("uniform", "uneven") for decode in ("whole", "cut")}
    assert set(result["device_seconds"]) == keys
    for key in keys:
        busy = result["device_seconds"][key]["4"]
        assert 0 < busy < 120, (key, busy)
        assert f"RESULT windows {key}, reads of 4: {busy:.3f} s of device time" in done.stdout
    # the same windows' new audio, whole or cut
    audio = {}
    for line in done.stdout.splitlines():
        if "s of device time for" in line:
            key = line.removeprefix("RESULT windows ").split(",")[0]
            audio[key] = line.split(" for ")[1].split(" s of new audio")[0]
    assert set(audio) == keys
    for windows in ("uniform", "uneven"):
        assert audio[f"{windows} whole"] == audio[f"{windows} cut"] != "0"
    # where the time went: the profiler's table for each variant (on the CPU, the operators')
    for key in keys:
        table = (tmp_path / f"kernels-{key.replace(' ', '-')}-reads-of-4.txt").read_text()
        assert "Self CPU" in table and "aten::" in table, table[:500]


def test_longer_chunks_send_fewer_windows_for_the_same_books():
    """--chunk-frames: uniform windows of chunks of 50 new frames beside the default 25 (plan only)."""
    done = subprocess.run(
        [sys.executable, "bench/decoder_speed.py", "--windows", "--plan-only", "--window-count", "100000"]
        + ["--read-sizes", "32", "--pass-costs", "", "--chunk-frames", "50"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    counts = {}  # windows, frames decoded, new frames
    for line in done.stdout.splitlines():
        found = re.match(
            r"RESULT windows (uniform\S*): (\d+) windows, (\d+) frames decoded for (\d+) new", line
        )
        if found:
            counts[found[1]] = tuple(int(n) for n in found.groups()[1:])
    assert set(counts) == {"uniform", "uniform/50"}
    # every window of both: the books' new frames are the same; longer chunks, fewer windows
    assert counts["uniform/50"][2] == counts["uniform"][2]
    assert counts["uniform/50"][0] < 0.7 * counts["uniform"][0]
