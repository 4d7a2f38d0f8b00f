"""Subtitles and speech marks from a finished job's manifest (jobs/audio.py ``Manifest``).

One cue per sentence (segment): its text as narrated, from where its audio starts to where it ends in
the file (the pause after it is not part of the cue). WebVTT also comes as a chapters track (one cue
per chapter, for ``<track kind="chapters">``). Speech marks follow Amazon Polly's JSON-lines shape
(``{"time", "type", "start", "end", "value"}``), with ``start``/``end`` as character offsets in the
submitted text (Polly's are bytes) and ``end_time`` added.
"""

from __future__ import annotations

import json


def _clock(seconds: float, separator: str) -> str:
    ms = max(round(seconds * 1000), 0)
    hours, rest = divmod(ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    secs, millis = divmod(rest, 1000)
    return f"{hours:02d}:{minutes:02d}:{secs:02d}{separator}{millis:03d}"


def _one_line(text: str) -> str:
    # a blank line ends a cue and "-->" starts a timing line: neither may appear in a cue's text
    return " ".join(text.split()).replace("-->", "->")


def _cue_text(text: str) -> str:
    # WebVTT cue text is markup: "<" opens a tag and "&" an entity, so "x < y" would lose its end
    # (SRT has no escapes: players show its text as written)
    return _one_line(text).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _chapter_spans(manifest: dict) -> list[tuple[str, float, float]]:
    chapters = manifest.get("chapters", [])
    ends = [c["start_s"] for c in chapters[1:]] + [manifest["duration_s"]]
    return [(c["title"], c["start_s"], end) for c, end in zip(chapters, ends, strict=True)]


def srt(manifest: dict) -> str:
    cues = []
    for n, seg in enumerate(manifest["segments"], start=1):
        timing = f"{_clock(seg['start_s'], ',')} --> {_clock(seg['end_s'], ',')}"
        cues.append(f"{n}\n{timing}\n{_one_line(seg['text'])}\n")
    return "\n".join(cues)


def vtt(manifest: dict, kind: str = "sentences") -> str:
    """WebVTT: the sentences (each chapter's start noted), or the chapters track."""
    lines = ["WEBVTT", ""]
    if kind == "chapters":
        for n, (title, start, end) in enumerate(_chapter_spans(manifest), start=1):
            lines += [f"chapter-{n}", f"{_clock(start, '.')} --> {_clock(end, '.')}", _cue_text(title), ""]
        return "\n".join(lines)
    chapter_at = {c["start_s"]: c["title"] for c in manifest.get("chapters", [])}
    for seg in manifest["segments"]:
        if (title := chapter_at.pop(seg["start_s"], None)) is not None:
            lines += [f"NOTE chapter: {_one_line(title)}", ""]
        lines += [
            f"s{seg['index']}",
            f"{_clock(seg['start_s'], '.')} --> {_clock(seg['end_s'], '.')}",
            _cue_text(seg["text"]),
            "",
        ]
    return "\n".join(lines)


def speech_marks(manifest: dict) -> str:
    """JSON lines, one per sentence (Polly's speech-marks shape)."""
    out = []
    for seg in manifest["segments"]:
        mark = {
            "time": round(seg["start_s"] * 1000),
            "type": "sentence",
            "start": seg.get("text_start", 0),
            "end": seg.get("text_end", 0),
            "value": seg["text"],
            "end_time": round(seg["end_s"] * 1000),
        }
        out.append(json.dumps(mark, ensure_ascii=False))
    return "\n".join(out) + "\n"
