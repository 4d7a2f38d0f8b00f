"""Stitching: assembled segments + structural pauses -> one encoded file, streamed (bounded memory).

The file's length is exactly the segments' samples plus the pauses (at the model's rate; resampling
to another output rate goes through one continuous soxr stream, so it stays within a sample).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import soundfile as sf

from jobs.segmentation import Pause, Plan

#: Output formats: name -> (soundfile format, subtype, content type).
FORMATS: dict[str, tuple[str, str, str]] = {
    "wav": ("WAV", "PCM_16", "audio/wav"),
    "flac": ("FLAC", "PCM_16", "audio/flac"),
}
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


def stitch(
    plan: Plan,
    read_segment: Callable[[int], bytes],
    out_path: Path,
    *,
    fmt: str,
    model_rate: int,
    out_rate: int,
    pauses: Pauses,
) -> Manifest:
    """Write every segment's PCM (int16 mono at ``model_rate``) with pauses into ``out_path``."""
    sf_format, subtype, _ = FORMATS[fmt]
    manifest = Manifest(sample_rate=out_rate)
    chapter_starts = {c.first_segment: c for c in plan.chapters}
    resampler = None
    if out_rate != model_rate:
        import soxr

        resampler = soxr.ResampleStream(model_rate, out_rate, 1, dtype="int16")
    ratio = out_rate / model_rate
    position = 0  # input samples (model rate) written so far

    with sf.SoundFile(
        out_path, "w", samplerate=out_rate, channels=1, format=sf_format, subtype=subtype
    ) as out:

        def write(pcm: np.ndarray, last: bool = False) -> None:
            data = resampler.resample_chunk(pcm, last=last) if resampler is not None else pcm
            if data.size:
                out.write(data)
                manifest.samples += int(data.size)

        for segment in plan.segments:
            if segment.index in chapter_starts:
                chapter = chapter_starts[segment.index]
                manifest.chapters.append(
                    {"index": chapter.index, "title": chapter.title, "start_s": position / model_rate}
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
    return manifest
