"""Stitching: assembled segments + structural pauses -> one encoded file, streamed (bounded memory).

The file's length is exactly the segments' samples plus the pauses (at the model's rate; resampling
to another output rate goes through one continuous soxr stream, so it stays within a sample). The
chapter marks are known before the first sample is written (from the segments' lengths), so formats
that keep them in their header (MP3, Ogg) get them too (jobs/encoding.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from jobs.encoding import FORMATS, Chapter, format_named, open_sink
from jobs.segmentation import Chapter as PlanChapter
from jobs.segmentation import Pause, Plan

__all__ = ["FORMATS", "SAMPLE_RATES", "Manifest", "Pauses", "chapter_marks", "format_named", "stitch"]

SAMPLE_RATES = (16_000, 22_050, 24_000, 32_000, 44_100, 48_000)


@dataclass(frozen=True)
class Pauses:
    sentence_ms: int
    paragraph_ms: int
    chapter_ms: int

    def samples(self, pause: Pause, rate: int) -> int:
        ms = {
            Pause.SENTENCE: self.sentence_ms,
            Pause.PARAGRAPH: self.paragraph_ms,
            Pause.CHAPTER: self.chapter_ms,
        }
        return round(ms.get(pause, 0) * rate / 1000)


@dataclass
class Manifest:
    sample_rate: int
    samples: int = 0
    chapters: list[dict] = field(default_factory=list)
    segments: list[dict] = field(default_factory=list)

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
        }


def chapter_title(chapter: PlanChapter) -> str:
    """A chapter's title as files and manifests show it (the text before the first heading has none)."""
    return chapter.title or f"Chapter {chapter.index + 1}"


def chapter_marks(plan: Plan, samples: dict[int, int], pauses: Pauses, model_rate: int) -> list[Chapter]:
    """Each chapter's title and [start, end) in seconds, from the segments' lengths (model-rate
    samples) and the pauses: where ``stitch`` will put them."""
    starts: list[tuple[str, int]] = []
    first_of = {c.first_segment: c for c in plan.chapters}
    position = 0
    for segment in plan.segments:
        if (chapter := first_of.get(segment.index)) is not None:
            starts.append((chapter_title(chapter), position))
        position += samples[segment.index] + pauses.samples(segment.pause_after, model_rate)
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
) -> Manifest:
    """Write every segment's PCM (int16 mono at ``model_rate``) with pauses into ``out_path``.
    ``samples``: each segment's length (model-rate samples), for the chapter marks of formats that
    embed them; ``kbps``, ``tags``: the encoder's bitrate (0: the format's default) and the file's tags."""
    spec = format_named(fmt)
    marks = chapter_marks(plan, samples, pauses, model_rate) if samples is not None and spec.chapters else []
    manifest = Manifest(sample_rate=out_rate)
    chapter_starts = {c.first_segment: c for c in plan.chapters}
    resampler = None
    if out_rate != model_rate:
        import soxr

        resampler = soxr.ResampleStream(model_rate, out_rate, 1, dtype="int16")
    ratio = out_rate / model_rate
    position = 0  # input samples (model rate) written so far

    out = open_sink(out_path, spec, out_rate, kbps=kbps, tags=tags, chapters=marks)
    try:

        def write(pcm: np.ndarray, last: bool = False) -> None:
            data = resampler.resample_chunk(pcm, last=last) if resampler is not None else pcm
            if data.size:
                out.write(data)
                manifest.samples += int(data.size)

        for segment in plan.segments:
            if segment.index in chapter_starts:
                chapter = chapter_starts[segment.index]
                manifest.chapters.append(
                    {
                        "index": chapter.index,
                        "title": chapter_title(chapter),
                        "start_s": position / model_rate,
                    }
                )
            pcm = np.frombuffer(read_segment(segment.index), dtype="<i2")
            start = position
            write(pcm)
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
                }
            )
            gap = pauses.samples(segment.pause_after, model_rate)
            if gap:
                write(np.zeros(gap, dtype=np.int16))
                position += gap
        if resampler is not None:
            write(np.zeros(0, dtype=np.int16), last=True)
    finally:
        out.close()
    return manifest
