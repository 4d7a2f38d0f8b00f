from __future__ import annotations

import numpy as np
import pytest
import soundfile as sf

from jobs.audio import Pauses, stitch
from jobs.segmentation import Pause, plan_text

PAUSES = Pauses(sentence_ms=300, paragraph_ms=700, chapter_ms=1500)
TEXT = "# One\n\nFirst. Second.\n\nThird.\n\n# Two\n\nFourth."


def parts(plan, rate=24000):
    rng = np.random.default_rng(0)
    return {
        s.index: (rng.integers(-3000, 3000, size=rate // 10 * (s.index + 1))).astype("<i2").tobytes()
        for s in plan.segments
    }


@pytest.mark.parametrize("fmt", ["wav", "flac"])
def test_duration_is_segments_plus_pauses_and_audio_is_in_order(tmp_path, fmt):
    plan = plan_text(TEXT)
    data = parts(plan)
    out = tmp_path / f"out.{fmt}"
    manifest = stitch(plan, data.__getitem__, out, fmt=fmt, model_rate=24000, out_rate=24000, pauses=PAUSES)
    pauses = sum(PAUSES.samples(s.pause_after, 24000) for s in plan.segments)
    assert [s.pause_after for s in plan.segments][-1] is Pause.END
    expected = sum(len(b) // 2 for b in data.values()) + pauses
    audio, rate = sf.read(out, dtype="int16")
    assert rate == 24000 and audio.ndim == 1 and audio.shape[0] == expected == manifest.samples
    for seg in manifest.segments:  # each segment's samples are where the manifest says, once
        start = seg["start_sample"]
        np.testing.assert_array_equal(
            audio[start : start + seg["samples"]], np.frombuffer(data[seg["index"]], "<i2")
        )
    assert [c["title"] for c in manifest.chapters] == ["One", "Two"]
    assert manifest.chapters[1]["start_s"] == pytest.approx(manifest.segments[4]["start_s"])


def test_resampling_keeps_the_duration(tmp_path):
    plan = plan_text(TEXT)
    data = parts(plan)
    out = tmp_path / "out.wav"
    manifest = stitch(plan, data.__getitem__, out, fmt="wav", model_rate=24000, out_rate=16000, pauses=PAUSES)
    at_24k = sum(len(b) // 2 for b in data.values()) + sum(
        PAUSES.samples(s.pause_after, 24000) for s in plan.segments
    )
    info = sf.info(out)
    assert info.samplerate == 16000
    assert abs(info.frames - at_24k * 2 / 3) <= 2 and info.frames == manifest.samples
