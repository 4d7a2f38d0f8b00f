"""Runaway segments: an AR model that never stops, loops on the same frames, or speaks near-silence.

The limits are family data (``RunawayLimits`` on ``CodecLMFamily``); the detectors are pure functions
and small classes with no Redis and no engine, so they are unit-tested on their own:

- never stops: the engine ended the request without the stop token (it reached ``max_tokens``, the
  budget computed from the text length) — judged by the AR worker when the request ends;
- repeats: the same frame, or a cycle of up to ``max_cycle_frames`` frames, for more than
  ``repeat_seconds`` in a row — ``RepeatDetector``, fed every frame as it is generated;
- near-silence: the whole segment's decoded audio has an RMS below ``silence_dbfs`` — judged by the
  assembler, the first stage that holds a segment's audio in one piece (codec-agnostic: no guess at
  which codes are "silent" for a given codec).

A detected runaway is retried with another seed (``retry_seed``: the segment seed and the retry
number, so a rerun of the job reproduces every retry), at most ``NARRATE_RUNAWAY_RETRIES`` times;
the last try's audio is kept and the segment is flagged (warning event, manifest, job counter).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class RunawayLimits:
    #: Reaching the generation budget without the stop token is a runaway. Off for models that never
    #: stop by design (the tiny test models' random weights: their budget is how a segment ends).
    stop_required: bool = True
    #: The same frame, or a cycle of up to ``max_cycle_frames`` frames, repeated for longer than this.
    repeat_seconds: float = 2.0
    max_cycle_frames: int = 4
    #: A whole segment whose RMS is below this (dB relative to full scale) is near-silence.
    silence_dbfs: float = -50.0


class RunawayError(Exception):
    """A runaway detected while generating; ``flush`` holds the windows that end the segment's audio
    where the detection happened (published only on the last try, when the segment is kept flagged)."""

    def __init__(self, kind: str, detail: str, flush: list | None = None) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
        self.detail = detail
        self.flush = flush or []


#: Runaway kinds, as they appear in events and the manifest.
NEVER_STOPS = "never_stops"
REPEATS = "repeats"
SILENCE = "silence"


def retry_seed(seed: int, retry: int) -> int:
    """The sampling seed of a segment's ``retry``-th retry (retry 0 is the segment seed itself)."""
    if retry == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}\x1fretry\x1f{retry}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") & 0x7FFF_FFFF


class RepeatDetector:
    """Counts, for every cycle length p <= ``max_cycle``, how many frames in a row equal the frame p
    before them; a run of ``limit`` frames for any p is a loop. O(max_cycle) work per frame."""

    def __init__(self, max_cycle: int, limit: int) -> None:
        if max_cycle < 1 or limit < 1:
            raise ValueError("max_cycle and limit must be >= 1")
        self.max_cycle = max_cycle
        self.limit = limit
        self._recent: list[bytes] = []  # the last max_cycle frames, oldest first
        self._runs = [0] * (max_cycle + 1)
        self.frames = 0

    def push(self, frames: np.ndarray) -> tuple[int, int] | None:
        """Feed new frames ([n, codes_per_frame]); returns (cycle length, run length) once looping."""
        for row in np.asarray(frames):
            key = row.tobytes()
            for p in range(1, self.max_cycle + 1):
                same = len(self._recent) >= p and self._recent[-p] == key
                self._runs[p] = self._runs[p] + 1 if same else 0
            self._recent.append(key)
            if len(self._recent) > self.max_cycle:
                del self._recent[0]
            self.frames += 1
            for p in range(1, self.max_cycle + 1):
                if self._runs[p] >= self.limit:
                    return p, self._runs[p] + p
        return None


def repeat_limit_frames(limits: RunawayLimits, frame_seconds: float) -> int:
    """``repeat_seconds`` in frames of a codec with frames of ``frame_seconds``."""
    return max(1, math.ceil(limits.repeat_seconds / frame_seconds))


def level_dbfs(pcm: bytes) -> float:
    """RMS level of int16 PCM in dB relative to full scale (-inf for no samples or digital silence)."""
    samples = np.frombuffer(pcm, dtype="<i2").astype(np.float64) / 32768.0
    if samples.size == 0:
        return float("-inf")
    rms = float(np.sqrt(np.mean(samples * samples)))
    return 20.0 * math.log10(rms) if rms > 0 else float("-inf")
