"""The eSpeak NG engine: streaming pieces, sample rate, voices, rate and pitch, unreadable scripts."""

from __future__ import annotations

import re
import threading
import time

import numpy as np
import pytest

from models.espeak import unavailable_reason
from tests.conftest import require

PARAGRAPH = (
    "The harbour woke before the town did. Gulls argued over the nets while the old man counted "
    "crates. He had counted them for thirty years, every morning, before the sun came up over the "
    "water. Nobody answered him. The fog did not care, and the boats stayed where they were."
)


@pytest.fixture(scope="module")
def engine():
    require(unavailable_reason() is None, f"eSpeak NG: {unavailable_reason()}")
    from models import espeak

    return espeak.engine()


def words(text: str) -> int:
    return len(re.findall(r"[\w'-]+", text))


def f0(audio: np.ndarray, rate: int = 22_050) -> float:
    """Median fundamental frequency (autocorrelation over 40 ms frames with energy), Hz."""
    x = audio.astype(np.float64)
    frame, hop = int(0.04 * rate), int(0.02 * rate)
    lo, hi = int(rate / 400), int(rate / 60)
    loud = 0.3 * np.sqrt(np.mean(x**2))
    found = []
    for start in range(0, x.size - frame, hop):
        seg = x[start : start + frame] - x[start : start + frame].mean()
        if np.sqrt(np.mean(seg**2)) < loud:
            continue
        ac = np.correlate(seg, seg, "full")[frame - 1 :]
        lag = lo + int(np.argmax(ac[lo:hi]))
        if ac[lag] > 0.3 * ac[0]:
            found.append(rate / lag)
    return float(np.median(found))


def test_speech_arrives_in_short_pieces_at_22050_hz(engine):
    pieces, times = [], []
    start = time.perf_counter()
    engine.synthesize(PARAGRAPH, "en-us", lambda p: pieces.append(p) is None or times.append(0))
    elapsed = time.perf_counter() - start
    audio = np.concatenate(pieces)
    assert engine.sample_rate == 22_050
    assert all(p.dtype == np.int16 and p.ndim == 1 for p in pieces)
    seconds = audio.size / 22_050
    assert 8 < seconds < 25, seconds  # 45 words
    assert len(pieces) > 50 and max(p.size for p in pieces) <= 0.1 * 22_050  # ~60 ms pieces
    assert np.sqrt(np.mean(audio.astype(float) ** 2)) > 500  # speech, not silence
    speed = seconds / elapsed
    print(f"\n{seconds:.1f} s of speech in {elapsed * 1000:.0f} ms: {speed:.0f}x real time")
    assert speed > 50


def test_returning_false_stops_the_synthesis(engine):
    """The callback sees audio while eSpeak is still synthesizing: stopping after 3 pieces ends it."""
    pieces: list[np.ndarray] = []

    def on_audio(piece):
        pieces.append(piece)
        return len(pieces) < 3

    engine.synthesize(PARAGRAPH, "en-us", on_audio)
    assert len(pieces) == 3
    assert engine.speak("Still works afterwards.").size > 0.5 * 22_050


def test_words_per_minute_follow_the_rate(engine):
    durations = {r: engine.speak(PARAGRAPH, "en-us", rate=r).size / 22_050 for r in (100, 175, 300)}
    wpm = {r: words(PARAGRAPH) / (d / 60) for r, d in durations.items()}
    print(f"\nwords per minute by rate setting: { {r: round(w) for r, w in wpm.items()} }")
    assert 130 < wpm[175] < 220  # eSpeak's nominal 175 wpm; the text's sentence pauses count too
    assert wpm[100] < 0.75 * wpm[175] < 0.75 * wpm[300]


def test_pitch_moves_the_fundamental(engine):
    low = f0(engine.speak(PARAGRAPH, "en-us", pitch=10))
    high = f0(engine.speak(PARAGRAPH, "en-us", pitch=90))
    print(f"\nmedian F0: pitch 10 -> {low:.0f} Hz, pitch 90 -> {high:.0f} Hz")
    assert high > 1.3 * low


def test_voices_languages_and_variants(engine):
    catalogue = engine.voices
    assert {"en-us", "en", "fr", "de", "ru", "cmn", "ja"} <= set(catalogue.voices)
    assert len(catalogue.voices) > 100
    assert {"f3", "m3", "klatt", "whisper"} <= set(catalogue.variants)
    assert catalogue.espeak_name("en-us+f3") == "gmw/en-US+f3"
    assert catalogue.problem("EN-US+F3") is None  # ids are case-insensitive
    # a job keeps the voice as listed: other spellings and aliases are one voice to the segment cache
    assert catalogue.canonical("EN-US+F3") == "en-us+f3" and catalogue.canonical("en-GB") == "en"
    assert catalogue.canonical("xx-yy") == "xx-yy"  # not a voice: left for problem() to refuse
    assert "not an eSpeak NG language" in catalogue.problem("xx-yy")
    assert "unknown voice variant" in catalogue.problem("en-us+nobody")
    # a variant changes the voice: female variant 3 speaks higher than male variant 1
    assert f0(engine.speak(PARAGRAPH, "en-us+f3")) > 1.3 * f0(engine.speak(PARAGRAPH, "en-us+m1"))
    # a language changes the speech: the same letters read in French and in English differ
    assert engine.speak("Nation", "fr").size != engine.speak("Nation", "en-us").size


def test_text_the_voice_cannot_read_is_refused(engine):
    from models.espeak import UnsupportedTextError

    engine.check_text("Hello there, nice to meet you.", "en-us")
    engine.check_text("Привет, как дела?", "ru")
    engine.check_text("你好世界", "cmn")
    with pytest.raises(UnsupportedTextError, match=r"cannot read Khmer .*no eSpeak NG voice reads Khmer"):
        engine.check_text("Hello. សួស្តី ពិភពលោក", "en-us")
    with pytest.raises(
        UnsupportedTextError, match=r"'en-us' cannot read Cyrillic .*voices that read it: .*\bru\b"
    ):
        engine.check_text("Привет, как дела?", "en-us")


def test_one_synthesis_at_a_time_per_process(engine):
    """Two threads asking at once are served one after the other (eSpeak's state is global)."""
    spans: dict[str, list[float]] = {}
    sizes: dict[str, int] = {}

    def speak(name: str, voice: str) -> None:
        times: list[float] = []
        total = []

        def on_audio(piece):
            times.append(time.perf_counter())
            total.append(piece.size)
            return True

        engine.synthesize(PARAGRAPH * 3, voice, on_audio)
        spans[name] = [times[0], times[-1]]
        sizes[name] = sum(total)

    threads = [threading.Thread(target=speak, args=(n, v)) for n, v in (("a", "en-us"), ("b", "en-gb+f3"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    (a0, a1), (b0, b1) = spans["a"], spans["b"]
    assert a1 < b0 or b1 < a0, spans  # no overlap
    alone = engine.speak(PARAGRAPH * 3, "en-us").size
    assert abs(sizes["a"] - alone) < 0.02 * alone  # run-to-run differences are a few hundred samples


def test_emphasis_marks_become_ssml_emphasis(engine):
    """The marks of jobs/segmentation.py: the same sentence through SSML with and without
    <emphasis> around one word; the stressed word is said longer (well beyond eSpeak NG's jitter
    of a few samples between two calls)."""
    from models import espeak

    stressed = engine.speak(f"I said {espeak._EMPHASIS_OPEN}no{espeak._EMPHASIS_CLOSE} today.")
    pieces = []
    with espeak._LOCK:
        engine._lib.set_voice("en-us")
        engine._lib.synth("<speak>I said no today.</speak>", lambda p: pieces.append(p) is None, ssml=True)
    flat = np.concatenate(pieces)
    assert stressed.size > 1.03 * flat.size, (stressed.size, flat.size)
