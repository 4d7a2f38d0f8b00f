"""Captions from a manifest: clock formats past an hour, a cue's text kept on one line and free of
"-->", chapter cues; parsed back by the ``srt`` and ``webvtt-py`` libraries."""

from __future__ import annotations

import html
import io
import json

import srt
import webvtt

from jobs.captions import speech_marks, vtt
from jobs.captions import srt as to_srt

MANIFEST = {
    "duration_s": 3725.5,
    "chapters": [{"index": 0, "title": "One", "start_s": 0.0}, {"index": 1, "title": "Two", "start_s": 3600.25}],
    "segments": [
        {"index": 0, "text": "A line\nbroken --> here.", "start_s": 0.0, "end_s": 1.2345, "text_start": 0, "text_end": 20},
        {"index": 1, "text": "Late.", "start_s": 3600.25, "end_s": 3725.0, "text_start": 21, "text_end": 26},
    ],
}


def test_srt_and_vtt_parse_with_their_libraries():
    cues = list(srt.parse(to_srt(MANIFEST)))
    assert [c.content for c in cues] == ["A line broken -> here.", "Late."]
    assert cues[0].end.total_seconds() == 1.234  # 1.2345 s to the millisecond (round half to even)
    assert cues[1].start.total_seconds() == 3600.25
    captions = webvtt.from_buffer(io.StringIO(vtt(MANIFEST)))
    assert [(c.start, c.end, c.text) for c in captions][1] == ("01:00:00.250", "01:02:05.000", "Late.")
    chapters = webvtt.from_buffer(io.StringIO(vtt(MANIFEST, "chapters")))
    assert [(c.start, c.end, c.text) for c in chapters] == [
        ("00:00:00.000", "01:00:00.250", "One"),
        ("01:00:00.250", "01:02:05.500", "Two"),
    ]


def test_vtt_cue_text_is_escaped_so_players_show_what_was_said():
    said = "If x < y then stop. Use <b> & &amp; as written -> here."
    manifest = {**MANIFEST, "chapters": [{"index": 0, "title": "Q & <A>", "start_s": 0.0}]}
    manifest["segments"] = [{**MANIFEST["segments"][0], "text": said}]
    (cue,) = webvtt.from_buffer(io.StringIO(vtt(manifest)))
    assert html.unescape(cue.text) == said  # webvtt-py drops tags: an unescaped "<b>" would be gone
    (chapter,) = webvtt.from_buffer(io.StringIO(vtt(manifest, "chapters")))
    assert html.unescape(chapter.text) == "Q & <A>"
    assert said in to_srt(manifest)  # SRT has no escapes: as written


def test_speech_marks_are_pollys_shape():
    marks = [json.loads(line) for line in speech_marks(MANIFEST).splitlines()]
    assert marks[1] == {"time": 3600250, "type": "sentence", "start": 21, "end": 26, "value": "Late.", "end_time": 3725000}
