"""Stitching: assembled segments + structural pauses -> one encoded file, streamed (bounded memory).

The file's length is exactly the segments' samples plus the pauses (at the model's rate; resampling
to another output rate goes through one continuous soxr stream, so it stays within a sample). The
chapter marks are known before the first sample is written (from the segments' lengths), so formats
that keep them in their header (MP3, Ogg) get them too (jobs/encoding.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from jobs.encoding import FORMATS, Chapter, CodecRoundTrip, Cover, format_named, open_sink
from jobs.loudness import MAX_GAIN_DB, Loudness, LoudnessMeter, PeakLimiter, normalising_gain_db
from jobs.segmentation import EMPHASIS_CLOSE, EMPHASIS_OPEN, Pause, Plan, Segment
from jobs.segmentation import Chapter as PlanChapter

__all__ = ["FORMATS", "SAMPLE_RATES", "Manifest", "Pauses", "chapter_marks", "format_named", "stitch"]

SAMPLE_RATES = (16_000, 22_050, 24_000, 32_000, 44_100, 48_000)


@dataclass(frozen=True)
class Pauses:
    sentence_ms: int
    paragraph_ms: int
    chapter_ms: int
    scene_ms: int = 2000

    @classmethod
    def of(cls, settings) -> Pauses:
        s = settings
        return cls(s.sentence_pause_ms, s.paragraph_pause_ms, s.chapter_pause_ms, s.scene_pause_ms)

    def samples(self, pause: Pause, rate: int) -> int:
        """The structural pause's length in samples at ``rate``."""
        ms = {
            Pause.SENTENCE: self.sentence_ms,
            Pause.PARAGRAPH: self.paragraph_ms,
            Pause.SCENE: self.scene_ms,
            Pause.CHAPTER: self.chapter_ms,
        }
        return round(ms.get(pause, 0) * rate / 1000)

    def after(self, segment: Segment, rate: int) -> int:
        """The silence after ``segment``, in samples: its explicit pause (``[pause 2s]``), else the
        structure's."""
        if segment.pause_ms >= 0:
            return round(segment.pause_ms * rate / 1000)
        return self.samples(segment.pause_after, rate)


@dataclass
class Manifest:
    sample_rate: int
    samples: int = 0
    chapters: list[dict] = field(default_factory=list)
    segments: list[dict] = field(default_factory=list)
    #: Where the book was normalised: target, ceiling, what was measured, the gain applied.
    loudness: dict | None = None
    #: The job's pronunciation entries and how often each was applied (jobs/lexicon.py).
    lexicon: list[dict] = field(default_factory=list)

    @property
    def duration_s(self) -> float:
        return self.samples / self.sample_rate

    def to_dict(self, job_id: str) -> dict:
        return {
            "job_id": job_id,
            "sample_rate": self.sample_rate,
            "duration_s": self.duration_s,
            "samples": self.samples,
            "chapters": self.chapters,
            "segments": self.segments,
            **({"loudness": self.loudness} if self.loudness is not None else {}),
            **({"lexicon": self.lexicon} if self.lexicon else {}),
        }


def chapter_file_name(number: int, fmt) -> str:
    """The file of chapter ``number`` (from 1) in storage and in the zip of chapters."""
    return f"chapter-{number:03d}.{fmt.extension}"


def chapter_title(chapter: PlanChapter) -> str:
    """A chapter's title as files and manifests show it (the text before the first heading has none)."""
    return chapter.title or f"Chapter {chapter.index + 1}"


def _readable(said: str) -> str:
    """What was said, its emphasis marks as Markdown's *...*."""
    return said.replace(EMPHASIS_OPEN, "*").replace(EMPHASIS_CLOSE, "*")


def chapter_marks(plan: Plan, samples: dict[int, int], pauses: Pauses, model_rate: int) -> list[Chapter]:
    """Each chapter's title and [start, end) in seconds, from the segments' lengths (model-rate
    samples) and the pauses: where ``stitch`` will put them."""
    starts: list[tuple[str, int]] = []
    first_of = {c.first_segment: c for c in plan.chapters}
    position = 0
    for segment in plan.segments:
        if (chapter := first_of.get(segment.index)) is not None:
            starts.append((chapter_title(chapter), position))
        position += samples[segment.index] + pauses.after(segment, model_rate)
    ends = [start for _, start in starts[1:]] + [position]
    return [
        Chapter(title, start / model_rate, end / model_rate)
        for (title, start), end in zip(starts, ends, strict=True)
    ]


def stitch(
    plan: Plan,
    read_segment: Callable[[int], bytes],
    out_path: Path,
    *,
    fmt: str,
    model_rate: int,
    out_rate: int,
    pauses: Pauses,
    samples: dict[int, int] | None = None,
    kbps: int = 0,
    tags: dict[str, str] | None = None,
    loudness: tuple[float, float] | None = None,
    cover: Cover | None = None,
    chapter_dir: Path | None = None,
) -> Manifest:
    """Write every segment's PCM (int16 mono at ``model_rate``) with pauses into ``out_path``.
    ``samples``: each segment's length (model-rate samples), for the chapter marks of formats that
    embed them; ``kbps``, ``tags``: the encoder's bitrate (0: the format's default) and the file's tags;
    ``loudness``: (target LUFS, true-peak ceiling dBTP) to normalise to (``normalisation``: three
    measuring passes before this one, so ``read_segment`` is called four times per segment);
    ``chapter_dir``: also one file per chapter there (``chapter_file_name``), cut where the chapter
    marks are, with the same encoding, gain and cover, tagged with the chapter's title and number."""
    spec = format_named(fmt)
    limiter = plan_gain = None
    if loudness is not None:
        codec = (lambda: CodecRoundTrip(spec, out_rate, kbps)) if spec.lossy else None
        plan_gain = normalisation(
            plan, read_segment, model_rate, pauses, *loudness, codec=codec, out_rate=out_rate
        )
        limiter = PeakLimiter(model_rate, plan_gain.ceiling_dbtp)
    marks = chapter_marks(plan, samples, pauses, model_rate) if samples is not None and spec.chapters else []
    manifest = Manifest(sample_rate=out_rate, lexicon=plan.lexicon)
    chapter_starts = {c.first_segment: c for c in plan.chapters}
    resampler = None
    if out_rate != model_rate:
        import soxr

        resampler = soxr.ResampleStream(model_rate, out_rate, 1, dtype="int16")
    ratio = out_rate / model_rate
    position = 0  # input samples (model rate) written so far

    out = open_sink(out_path, spec, out_rate, kbps=kbps, tags=tags, chapters=marks, cover=cover)
    part: list = [None]  # the open chapter file's sink

    def next_chapter(chapter: PlanChapter) -> None:
        if part[0] is not None:
            part[0].close()
        number = chapter.index + 1
        chapter_tags = {**(tags or {}), "title": chapter_title(chapter), "track": f"{number}/{len(plan.chapters)}"}
        chapter_tags["album"] = (tags or {}).get("title", "")
        path = chapter_dir / chapter_file_name(number, spec)
        part[0] = open_sink(path, spec, out_rate, kbps=kbps, tags=chapter_tags, cover=cover)

    # chapter files to open at an output sample (the resampler holds some back: the last of a
    # chapter may come out after the next one's first input)
    opening: list[tuple[int, PlanChapter]] = []

    try:

        def emit(data: np.ndarray) -> None:
            if data.size:
                out.write(data)
                if part[0] is not None:
                    part[0].write(data)
                manifest.samples += int(data.size)

        def write(pcm: np.ndarray, last: bool = False) -> None:
            data = resampler.resample_chunk(pcm, last=last) if resampler is not None else pcm
            while opening and manifest.samples + data.size >= opening[0][0]:
                cut = max(opening[0][0] - manifest.samples, 0)
                emit(data[:cut])
                data = data[cut:]
                next_chapter(opening.pop(0)[1])
            emit(data)

        for segment in plan.segments:
            if segment.index in chapter_starts:
                chapter = chapter_starts[segment.index]
                if chapter_dir is not None:
                    opening.append((round(position * ratio), chapter))
                manifest.chapters.append(
                    {
                        "index": chapter.index,
                        "title": chapter_title(chapter),
                        "start_s": position / model_rate,
                    }
                )
            pcm = np.frombuffer(read_segment(segment.index), dtype="<i2")
            start = position
            write(pcm if limiter is None else to_int16(limiter.apply(pcm, plan_gain.gain_db)))
            position += pcm.size
            manifest.segments.append(
                {
                    "index": segment.index,
                    "chapter": segment.chapter,
                    "text": segment.text,
                    "text_start": segment.start,
                    "text_end": segment.end,
                    "start_s": start / model_rate,
                    "end_s": position / model_rate,
                    "start_sample": round(start * ratio),
                    "samples": round(pcm.size * ratio),
                    **({"said": _readable(segment.say)} if segment.say else {}),
                    **({"said_map": segment.say_map} if segment.say_map else {}),
                }
            )
            gap = pauses.after(segment, model_rate)
            if gap:
                write(np.zeros(gap, dtype=np.int16))
                position += gap
        if resampler is not None:
            write(np.zeros(0, dtype=np.int16), last=True)
    finally:
        out.close()
        if part[0] is not None:
            part[0].close()
    if plan_gain is not None:
        manifest.loudness = {
            "target_lufs": loudness[0],
            "ceiling_dbtp": loudness[1],
            "measured_lufs": round(plan_gain.measured.integrated_lufs, 2),
            "measured_true_peak_dbtp": round(plan_gain.measured.true_peak_dbtp, 2),
            "gain_db": round(plan_gain.gain_db, 2),
            "limiter_ceiling_dbtp": round(plan_gain.ceiling_dbtp, 2),
            "limited_s": round(limiter.reduced / model_rate, 2),
        }
    return manifest


def _book_loudness(plan: Plan, read_segment, rate: int, pauses: Pauses, shape=None) -> Loudness:
    """The stitched book's loudness (segments and pauses as they will be written; ``shape``: what
    the writing pass does to each segment), one segment in memory at a time."""
    meter = LoudnessMeter(rate)
    for segment in plan.segments:
        pcm = np.frombuffer(read_segment(segment.index), dtype="<i2")
        meter.feed(pcm if shape is None else shape(pcm))
        if gap := pauses.after(segment, rate):
            meter.feed(np.zeros(gap, dtype=np.int16))
    return meter.result()


#: Passes of the limiter alone to bring the loudness within this of the target (LU).
MAX_LIMITER_PASSES = 3
LOUDNESS_TOLERANCE_LU = 0.15
CODEC_PEAK_MARGIN_DB = 0.25
#: The codec's effect is measured on at most this many segments spread over the book (~11 minutes
#: of 3.3 s sentences): it is a property of the codec and the voice, and encoding the whole book
#: twice would double a long book's finalize.
CODEC_SAMPLE_SEGMENTS = 200


@dataclass(frozen=True)
class Normalisation:
    measured: Loudness  # the book as narrated
    gain_db: float
    ceiling_dbtp: float  # the limiter's: below the asked one by what the codec adds to the peaks


def normalisation(
    plan: Plan,
    read_segment,
    rate: int,
    pauses: Pauses,
    target: float,
    ceiling: float,
    codec=None,
    out_rate: int | None = None,
) -> Normalisation:
    """The gain that brings the book to ``target`` with its peaks held under ``ceiling`` by the
    limiter, as the listener hears it. Passes over the segments, one segment in memory at a time:
    1. the book as narrated: the first gain;
    2. with that gain and the limiter, and (a lossy format: ``codec``, a CodecRoundTrip factory at
       ``out_rate``) through the encoder and decoder: what the codec moves (loudness, peaks, over
       CODEC_SAMPLE_SEGMENTS spread over the book), and the limiter's ceiling lowered by what it
       adds to the peaks;
    3. with the corrected gain and ceiling, the limiter alone (the codec's offset added), until the
       loudness is within LOUDNESS_TOLERANCE_LU (at most MAX_LIMITER_PASSES; one when the limiter
       has little to do).
    The writing pass is the next."""
    measured = _book_loudness(plan, read_segment, rate, pauses)
    if not math.isfinite(measured.integrated_lufs):
        return Normalisation(measured, 0.0, ceiling)
    gain = normalising_gain_db(measured, target)
    limiter = PeakLimiter(rate, ceiling)
    if codec is None:
        heard = _book_loudness(plan, read_segment, rate, pauses, lambda pcm: limiter.apply(pcm, gain))
        offset, limit = 0.0, ceiling
    else:
        before = LoudnessMeter(rate)  # the same signal before the codec
        heard = _heard_through(
            codec(), _spread(plan.segments, CODEC_SAMPLE_SEGMENTS), read_segment, rate, out_rate or rate,
            pauses, lambda pcm: limiter.apply(pcm, gain), before,
        )  # fmt: skip
        ahead = before.result()
        offset = heard.integrated_lufs - ahead.integrated_lufs  # what the codec does to the loudness
        # ... and to the peaks (with a margin: the codec's overshoot moves a little with the gain)
        limit = ceiling - max(heard.true_peak_dbtp - ahead.true_peak_dbtp, 0.0) - CODEC_PEAK_MARGIN_DB
    if not math.isfinite(heard.integrated_lufs):
        return Normalisation(measured, gain, ceiling)
    # then the limiter alone (the codec's offset kept), by the secant through the last two points:
    # the loudness grows more slowly than the gain once the limiter works
    points = [(gain, heard.integrated_lufs)]
    gain = min(gain + target - heard.integrated_lufs, MAX_GAIN_DB)
    for _ in range(MAX_LIMITER_PASSES):
        loud = _limited_loudness(plan, read_segment, rate, pauses, limit, gain)
        if not math.isfinite(loud):
            break
        points.append((gain, loud + offset))
        error = target - points[-1][1]
        if abs(error) <= LOUDNESS_TOLERANCE_LU:
            break
        (g0, l0), (g1, l1) = points[-2:]
        slope = (l1 - l0) / (g1 - g0) if abs(g1 - g0) > 1e-6 else 1.0
        gain = min(gain + error / min(max(slope, 0.2), 1.0), MAX_GAIN_DB)
    return Normalisation(measured, gain, limit)


def _limited_loudness(plan: Plan, read_segment, rate: int, pauses: Pauses, ceiling: float, gain: float) -> float:
    limiter = PeakLimiter(rate, ceiling)
    return _book_loudness(plan, read_segment, rate, pauses, lambda pcm: limiter.apply(pcm, gain)).integrated_lufs


def _spread(segments: list, n: int) -> list:
    """At most ``n`` of ``segments``, evenly spread over the book."""
    step = max(1, math.ceil(len(segments) / n))
    return segments[::step]


def _heard_through(
    round_trip, segments: list, read_segment, rate: int, out_rate: int, pauses: Pauses, shape, before: LoudnessMeter
) -> Loudness:
    """The loudness of ``segments`` (with their pauses) after ``shape``, resampling to ``out_rate``
    as the file is, and the codec (``before`` meters them ahead of the resampling and the codec)."""
    import soxr

    resampler = soxr.ResampleStream(rate, out_rate, 1, dtype="int16") if out_rate != rate else None
    meter = LoudnessMeter(round_trip.decoded_rate)

    def through(pcm: np.ndarray, last: bool = False) -> None:
        data = resampler.resample_chunk(pcm, last=last) if resampler is not None else pcm
        meter.feed(round_trip.feed(data))

    for segment in segments:
        shaped = to_int16(shape(np.frombuffer(read_segment(segment.index), dtype="<i2")))
        before.feed(shaped)
        through(shaped)
        if gap := pauses.after(segment, rate):
            before.feed(np.zeros(gap, dtype=np.int16))
            through(np.zeros(gap, dtype=np.int16))
    if resampler is not None:
        through(np.zeros(0, dtype=np.int16), last=True)
    meter.feed(round_trip.flush())
    return meter.result()


def to_int16(x: np.ndarray) -> np.ndarray:
    return np.clip(np.rint(x * 32768.0), -32768, 32767).astype(np.int16)
