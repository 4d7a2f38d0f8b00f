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


def test_explicit_pauses_and_scene_breaks_are_silences_of_exact_length(tmp_path):
    """``[pause 2s]`` is exactly 2 s of digital silence after what precedes it (whatever the
    structure would have put there), pauses in a row add up, a rule is a scene pause."""
    text = "# One\n\nWait [pause 2s] for it.\n\n* * *\n\nAfter the break. [pause 250ms][pause 0.5s]\n\nEnd."
    plan = plan_text(text)
    assert [(s.text, s.pause_after, s.pause_ms) for s in plan.segments] == [
        ("One", Pause.PARAGRAPH, -1),
        ("Wait", Pause.SENTENCE, 2000),
        ("for it.", Pause.SCENE, -1),
        ("After the break.", Pause.PARAGRAPH, 750),
        ("End.", Pause.END, -1),
    ]
    pauses = Pauses(300, 700, 1500, scene_ms=2500)
    data = parts(plan)
    out = tmp_path / "out.wav"
    manifest = stitch(plan, data.__getitem__, out, fmt="wav", model_rate=24000, out_rate=24000, pauses=pauses)
    audio, _ = sf.read(out, dtype="int16")
    segs = manifest.segments
    gaps = [segs[i + 1]["start_sample"] - (segs[i]["start_sample"] + segs[i]["samples"]) for i in range(4)]
    assert gaps == [700 * 24, 2000 * 24, 2500 * 24, 750 * 24]
    for i in range(4):  # digital silence, all of it
        end = segs[i]["start_sample"] + segs[i]["samples"]
        assert not audio[end : segs[i + 1]["start_sample"]].any()
