"""The speech worker's compute: a segment's audio handed on while eSpeak NG is still producing it."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from fleet.messages import SegmentTask
from models.espeak import unavailable_reason
from tests.conftest import require

TEXT = (
    "The walk took an hour, and the path was steep; the wind was cold, and the rain came and went "
    "while he climbed towards the lighthouse with the brass key in his pocket."
)


@pytest.fixture(scope="module")
def speaker():
    require(unavailable_reason() is None, f"eSpeak NG: {unavailable_reason()}")
    from models import espeak
    from models.espeak import espeak_family
    from workers.speech import SegmentSpeaker

    return SegmentSpeaker(espeak.engine(), espeak_family(), chunk_ms=1000)


def task(text: str = TEXT, voice: str = "en-us", rate: int = 0) -> SegmentTask:
    return SegmentTask("job", 0, text, "espeak", voice, seed=0, rate=rate)


async def collect(speaker, t: SegmentTask) -> list[tuple[np.ndarray, bool]]:
    return [p async for p in speaker.pieces(t)]


def test_first_audio_at_once_then_about_a_second_per_chunk(speaker):
    pieces = asyncio.run(collect(speaker, task()))
    sizes = [p.size for p, _ in pieces]
    finals = [f for _, f in pieces]
    assert finals == [False] * (len(pieces) - 1) + [True]  # one final piece, the last
    assert 0 < sizes[0] <= 0.1 * 22_050  # the first piece eSpeak produced, alone: fast first audio
    assert all(22_050 <= s < 1.1 * 22_050 for s in sizes[1:-1]) and len(sizes) >= 5
    whole = speaker.engine.speak(TEXT, "en-us")
    assert abs(sum(sizes) - whole.size) < 0.02 * whole.size  # delta pieces add up to the whole (I1)


def test_the_job_rate_reaches_the_engine(speaker):
    slow = sum(p.size for p, _ in asyncio.run(collect(speaker, task(rate=100))))
    fast = sum(p.size for p, _ in asyncio.run(collect(speaker, task(rate=350))))
    assert fast < 0.5 * slow


def test_leaving_early_stops_the_synthesis(speaker):
    async def first_only():
        async for piece, _final in speaker.pieces(task(TEXT * 20)):
            return piece
        return None

    assert asyncio.run(first_only()).size > 0
    # the engine is free again at once (an unfinished synthesis would hold the process-wide lock)
    assert sum(p.size for p, _ in asyncio.run(collect(speaker, task("Done.")))) > 0


def test_unreadable_text_fails_before_any_audio(speaker):
    from models.espeak import UnsupportedTextError

    with pytest.raises(UnsupportedTextError, match="Khmer"):
        asyncio.run(collect(speaker, task("សួស្តី ពិភពលោក")))
