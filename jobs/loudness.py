"""Loudness of a book fed in pieces: ITU-R BS.1770-4 integrated loudness (LUFS) and true peak (dBTP).

pyloudnorm (MIT) is the reference implementation, but it measures a whole signal in memory (a 10-hour
book at 24 kHz is 6.9 GB of float64). So this meter takes pyloudnorm's own K-weighting filters (its
``IIRfilter`` stages, the coefficients BS.1770 defines) and runs them with carried state over each
piece, keeping only the sum of squares of every 100 ms hop (10 hours: 360,000 floats); the gating
(400 ms blocks, 75 % overlap, -70 LUFS absolute, -10 LU relative) then runs on those at the end.
True peak: the signal oversampled 4x (one continuous soxr stream), its largest magnitude.
tests/jobs/test_loudness.py checks it against pyloudnorm's ``integrated_loudness``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

SILENCE_LUFS = -70.0  # the absolute gate: a book quieter than this is silence
#: More than a band-limited signal's inter-sample peak exceeds its sample peak by (dB).
INTER_SAMPLE_DB = 3.0
INTER_SAMPLE = 10 ** (INTER_SAMPLE_DB / 20)


@dataclass(frozen=True)
class Loudness:
    integrated_lufs: float
    true_peak_dbtp: float


class LoudnessMeter:
    def __init__(self, rate: int) -> None:
        import pyloudnorm
        import soxr

        stages = pyloudnorm.Meter(rate)._filters.values()  # K-weighting: high shelf, then high pass
        self._stages = [(s.b, s.a, s.passband_gain) for s in stages]
        self._state = [np.zeros(max(len(b), len(a)) - 1) for b, a, _ in self._stages]
        self._hop = round(0.1 * rate)
        self._carry = np.zeros(0)
        self._hops: list[np.ndarray] = []
        self._upsampler = soxr.ResampleStream(rate, 4 * rate, 1, dtype="float32")
        self._peak = 0.0
        self._last_peak = 0.0

    def feed(self, pcm: np.ndarray) -> None:
        """Add int16 (or float in [-1, 1]) mono samples."""
        if not pcm.size:
            return
        import scipy.signal

        x = pcm.astype(np.float64) / 32768.0 if pcm.dtype == np.int16 else pcm.astype(np.float64)
        sample_peak = float(np.abs(x).max())
        self._peak = max(self._peak, sample_peak)
        # the oversampled stream sees every piece (it is one stream); its peaks are looked at only
        # where they could raise the maximum (a band-limited signal's inter-sample peaks exceed its
        # sample peaks by far less than INTER_SAMPLE_DB)
        up = self._upsampler.resample_chunk(x.astype(np.float32))  # (it lags: the last piece is in it too)
        if up.size and max(sample_peak, self._last_peak) * INTER_SAMPLE > self._peak:
            self._peak = max(self._peak, float(np.abs(up).max()))
        self._last_peak = sample_peak
        y = x
        for i, (b, a, gain) in enumerate(self._stages):
            y, self._state[i] = scipy.signal.lfilter(b, a, y, zi=self._state[i])
            y = y * gain
        y = np.concatenate([self._carry, y])
        whole = y.size // self._hop * self._hop
        if whole:
            self._hops.append(np.square(y[:whole]).reshape(-1, self._hop).sum(axis=1))
        self._carry = y[whole:]

    def result(self) -> Loudness:
        tail = self._upsampler.resample_chunk(np.zeros(0, dtype=np.float32), last=True)
        if tail.size and self._last_peak * INTER_SAMPLE > self._peak:
            self._peak = max(self._peak, float(np.abs(tail).max()))
        hops = np.concatenate(self._hops) if self._hops else np.zeros(0)
        peak_db = 20 * math.log10(self._peak) if self._peak > 0 else -math.inf
        if hops.size < 4:
            return Loudness(-math.inf, peak_db)
        window = np.convolve(hops, np.ones(4), mode="valid")  # 400 ms blocks, a hop apart
        z = window / (4 * self._hop)
        with np.errstate(divide="ignore"):
            block = -0.691 + 10 * np.log10(z)
        gated = z[block >= SILENCE_LUFS]
        if not gated.size:
            return Loudness(-math.inf, peak_db)
        relative = -0.691 + 10 * math.log10(gated.mean()) - 10
        kept = z[(block > relative) & (block > SILENCE_LUFS)]
        return Loudness(-0.691 + 10 * math.log10(kept.mean()), peak_db)


#: The most a book is raised (a nearly silent one would otherwise be noise brought up 60 dB).
MAX_GAIN_DB = 30.0


def normalising_gain_db(measured: Loudness, target_lufs: float) -> float:
    """The gain that brings the book to ``target_lufs`` (the limiter keeps the peaks under the ceiling)."""
    if not math.isfinite(measured.integrated_lufs):
        return 0.0  # silence stays silence
    return min(target_lufs - measured.integrated_lufs, MAX_GAIN_DB)


class PeakLimiter:
    """Gain, then the true peak held under ``ceiling_dbtp``: the reduction each sample needs (from
    the signal oversampled 4x, so inter-sample peaks count), held over ±``hold_ms`` and smoothed
    over the same span, so it is in place before a peak and eases off after it (a 10 ms attack and
    release, look-ahead included). Vectorised per segment (SciPy's max and mean filters); segments
    are limited on their own, which is exact when the pause between them is longer than ``hold_ms``."""

    def __init__(self, rate: int, ceiling_dbtp: float, hold_ms: float = 10.0, margin_db: float = 0.3) -> None:
        self.rate = rate
        self.ceiling_db = ceiling_dbtp - margin_db  # the 4x estimate of the true peak can be a little low
        self.width = 2 * round(hold_ms * rate / 1000) + 1
        self.reduced = 0  # samples whose gain the limiter lowered (for the manifest)

    def apply(self, pcm: np.ndarray, gain_db: float) -> np.ndarray:
        """int16 in, float64 in [-1, 1] out."""
        import scipy.ndimage
        import soxr

        x = pcm.astype(np.float64) / 32768.0 * 10 ** (gain_db / 20)
        if not x.size or 20 * math.log10(max(float(np.abs(x).max()), 1e-12)) + INTER_SAMPLE_DB < self.ceiling_db:
            return x  # no peak can reach the ceiling: nothing to limit (most segments of most books)
        up = np.abs(soxr.resample(x, self.rate, 4 * self.rate))
        peaks = np.maximum(np.abs(x), _groups_max(up, 4, x.size))
        with np.errstate(divide="ignore"):
            over = np.maximum(20 * np.log10(peaks) - self.ceiling_db, 0.0)
        if not over.any():
            return x
        held = scipy.ndimage.maximum_filter1d(over, self.width, mode="constant")
        smooth = scipy.ndimage.uniform_filter1d(held, self.width, mode="constant")
        self.reduced += int(np.count_nonzero(smooth > 0.01))
        return x * 10 ** (-np.maximum(smooth, over) / 20)


def _groups_max(up: np.ndarray, factor: int, n: int) -> np.ndarray:
    """For each original sample, the largest of the ``factor`` oversampled values that start at it."""
    up = np.pad(up, (0, max(n * factor - up.size, 0)))[: n * factor]
    return up.reshape(n, factor).max(axis=1)
