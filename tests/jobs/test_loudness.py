"""Loudness: the streaming meter agrees with pyloudnorm's whole-signal BS.1770-4 measure; a book whose
chapters differ in loudness is normalised to the target (measured again, independently, by pyloudnorm
on the decoded file), its true peak under the ceiling, its pauses still exact silence."""

from __future__ import annotations

import re
import shutil
import subprocess

import numpy as np
import pyloudnorm
import pytest
import soundfile as sf

from jobs.audio import Pauses, stitch
from jobs.loudness import LoudnessMeter
from jobs.segmentation import plan_text
from tests.conftest import require

RATE = 24_000
PAUSES = Pauses(300, 700, 1500)
TEXT = "# Quiet\n\n" + "A sentence here. " * 12 + "\n\n# Loud\n\n" + "Another one there. " * 12


def speechlike(n: int, amp: float, seed: int) -> np.ndarray:
    """A voiced-sounding signal: harmonics under a syllable-rate envelope."""
    t = np.arange(n) / RATE
    rng = np.random.default_rng(seed)
    f0 = 110 + 40 * rng.random()
    x = sum(np.sin(2 * np.pi * f0 * k * t + rng.random() * 6) / k for k in range(1, 8))
    envelope = 0.55 + 0.45 * np.sin(2 * np.pi * 4 * t) ** 2
    return (x / 2.6 * envelope * amp * 32767).astype(np.int16)


def book(plan):
    """The first chapter's sentences 18 dB quieter than the second's."""
    quiet = {s.index for s in plan.segments if s.chapter == 0}
    return {
        s.index: speechlike(RATE + 97 * s.index, 0.04 if s.index in quiet else 0.32, s.index).tobytes()
        for s in plan.segments
    }


def test_the_streaming_meter_equals_pyloudnorm():
    plan = plan_text(TEXT)
    parts = book(plan)
    signal = np.concatenate([np.frombuffer(parts[s.index], "<i2") for s in plan.segments])
    meter = LoudnessMeter(RATE)
    for piece in np.array_split(signal, 37):
        meter.feed(piece)
    reference = pyloudnorm.Meter(RATE).integrated_loudness(signal.astype(np.float64) / 32768)
    assert meter.result().integrated_lufs == pytest.approx(reference, abs=0.05)


@pytest.mark.parametrize(("fmt", "target", "ceiling"), [("flac", -18.0, -3.0), ("m4a", -20.0, -3.0), ("flac", -16.0, -1.0)])
def test_a_book_is_normalised_to_the_target_under_the_ceiling(tmp_path, fmt, target, ceiling):
    require(shutil.which("ffmpeg") is not None, "ffmpeg (Debian's package; scripts/test.sh installs it)")
    plan = plan_text(TEXT)
    parts = book(plan)
    out = tmp_path / f"book.{fmt}"
    manifest = stitch(
        plan, parts.__getitem__, out, fmt=fmt, model_rate=RATE, out_rate=RATE, pauses=PAUSES,
        loudness=(target, ceiling),
    )  # fmt: skip
    if fmt == "flac":
        audio, rate = sf.read(out, dtype="float64")
    else:  # Debian's ffmpeg decodes the AAC
        raw = subprocess.run(["ffmpeg", "-v", "error", "-i", str(out), "-f", "f32le", "-"], capture_output=True, check=True)
        audio, rate = np.frombuffer(raw.stdout, "<f4").astype(np.float64), RATE
    measured = pyloudnorm.Meter(rate).integrated_loudness(audio)
    assert abs(measured - target) <= 0.5, (measured, manifest.loudness)
    meter = LoudnessMeter(rate)
    meter.feed(audio.astype(np.float32))
    assert meter.result().true_peak_dbtp <= ceiling + 0.1, manifest.loudness
    if fmt == "flac":  # the pauses are still exact silence, where the manifest puts them
        pcm = (audio * 32768).round().astype(np.int32)
        for seg, nxt in zip(manifest.segments, manifest.segments[1:], strict=False):
            gap = pcm[seg["start_sample"] + seg["samples"] : nxt["start_sample"]]
            assert gap.size == PAUSES.samples(plan.segments[seg["index"]].pause_after, RATE) and not gap.any()
    assert manifest.loudness["gain_db"] > 0  # the quiet book was raised
    # and FFmpeg's own BS.1770 meter (ebur128, Debian's build: no code shared with ours) agrees
    report = subprocess.run(
        ["ffmpeg", "-nostats", "-i", str(out), "-af", "ebur128=peak=true", "-f", "null", "-"],
        capture_output=True, text=True, check=True,
    ).stderr.rsplit("Summary:", 1)[1]  # fmt: skip
    integrated = float(re.search(r"I:\s+(-?[\d.]+) LUFS", report).group(1))
    true_peak = float(re.search(r"Peak:\s+(-?[\d.]+) dBFS", report).group(1))
    assert abs(integrated - target) <= 0.5 and true_peak <= ceiling, report
