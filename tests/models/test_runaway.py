"""The runaway detectors and the retry seeds (models/runaway.py), on their own."""

from __future__ import annotations

import numpy as np
import pytest

from models.registry import MODELS
from models.runaway import RepeatDetector, level_dbfs, repeat_limit_frames, retry_seed


def frames(rows) -> np.ndarray:
    return np.asarray(rows, dtype=np.int32).reshape(len(rows), -1)


def test_one_frame_repeated_is_caught_at_the_limit_and_not_before():
    detector = RepeatDetector(max_cycle=4, limit=5)
    rng = np.random.default_rng(0)
    assert detector.push(rng.integers(0, 4096, size=(40, 7))) is None  # varied frames never trigger
    same = frames([[1, 2, 3, 4, 5, 6, 7]] * 5)
    assert detector.push(same) is None  # 5 equal frames: 4 repeats of the first
    assert detector.push(same[:1]) == (1, 6)  # the 6th: 5 repeats -> a cycle of 1 for 6 frames


def test_a_short_cycle_is_caught_and_a_broken_run_starts_over():
    detector = RepeatDetector(max_cycle=4, limit=6)
    a, b, c = [1] * 7, [2] * 7, [3] * 7
    assert detector.push(frames([a, b, c, a, b, c, a, b])) is None  # 5 frames equal to 3 before
    assert detector.push(frames([[9] * 7])) is None  # broken: the run restarts
    assert detector.push(frames([a, b, c, a, b, c, a, b])) is None
    assert detector.push(frames([c])) == (3, 9)  # a, b, c, a, b, c, a, b, c: 6 repeats of the 3-cycle
    with pytest.raises(ValueError):
        RepeatDetector(max_cycle=0, limit=3)


def test_single_code_frames_and_cycles_longer_than_the_limit_are_not_loops():
    detector = RepeatDetector(max_cycle=2, limit=4)
    assert detector.push(frames([[1], [2], [3], [1], [2], [3], [1], [2], [3]])) is None  # period 3 > 2
    assert detector.push(frames([[5], [5], [5], [5]])) is None
    assert detector.push(frames([[5]])) == (1, 5)


def test_family_limits_in_frames():
    orpheus, llasa = MODELS["orpheus"].family, MODELS["tiny-llasa"].family
    assert orpheus.repeat_limit_frames == 24  # 2 s of 85.3 ms frames
    assert llasa.repeat_limit_frames == 100  # 2 s at 50 Hz
    assert repeat_limit_frames(orpheus.runaway, 0.5) == 4
    assert orpheus.runaway.stop_required and not MODELS["tiny"].family.runaway.stop_required


def test_retry_seeds_are_reproducible_distinct_and_leave_the_first_try_alone():
    assert retry_seed(1234, 0) == 1234
    seeds = [retry_seed(1234, r) for r in range(1, 6)]
    assert seeds == [retry_seed(1234, r) for r in range(1, 6)]
    assert len(set(seeds) | {1234}) == 6 and all(0 <= s < 2**31 for s in seeds)
    assert retry_seed(1235, 1) != retry_seed(1234, 1)


def test_levels_in_dbfs():
    t = np.arange(16000) / 16000
    sine = (np.sin(2 * np.pi * 440 * t) * 32767).astype("<i2").tobytes()
    assert level_dbfs(sine) == pytest.approx(-3.01, abs=0.05)
    quiet = (np.sin(2 * np.pi * 440 * t) * 32767 * 10 ** (-60 / 20)).astype("<i2").tobytes()
    assert level_dbfs(quiet) == pytest.approx(-63.0, abs=0.5)
    assert level_dbfs(b"") == level_dbfs(bytes(200)) == float("-inf")
