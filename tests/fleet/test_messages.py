from __future__ import annotations

import json

import numpy as np
import pytest

from fleet.messages import AudioChunk, CodeChunk, DeadLetter, MessageError, SegmentTask, job_id_of


def test_segment_task_round_trip():
    task = SegmentTask(job_id="j1", segment=3, text="Héllo — wörld.", model="tiny", voice="tara", seed=42)
    fields = task.encode()
    assert set(fields) == {b"v", b"h", b"p"}
    assert SegmentTask.decode(fields) == task


def test_code_chunk_round_trip_keeps_codes_exactly():
    frames = np.arange(35, dtype=np.int32).reshape(5, 7) * 100
    chunk = CodeChunk("j", 1, 2, 0, "tiny", left=1, right=1, final=False, frames=frames)
    back = CodeChunk.decode(chunk.encode())
    assert (back.job_id, back.segment, back.attempt, back.seq, back.left, back.right, back.final) == (
        "j",
        1,
        2,
        0,
        1,
        1,
        False,
    )
    assert back.frames.dtype == np.int32 and back.frames.shape == (5, 7)
    np.testing.assert_array_equal(back.frames, frames)
    assert back.new_frames == 3


def test_audio_chunk_round_trip_is_binary():
    pcm = np.array([0, 1, -1, 32767, -32768], dtype="<i2").tobytes()
    chunk = AudioChunk("j", 0, 1, 4, True, 24000, pcm)
    fields = chunk.encode()
    assert fields[b"p"] == pcm  # raw bytes on the wire, no base64
    back = AudioChunk.decode(fields)
    assert back == chunk and back.samples == 5


def test_dead_letter_round_trip():
    letter = DeadLetter("s", "1-0", "j", "boom", 5, b'{"x":1}')
    assert DeadLetter.decode(letter.encode()) == letter


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {b"v": b"1"},
        {b"v": b"x", b"h": b"{}"},
        {b"v": b"2", b"h": b'{"kind":"segment"}'},
        {b"v": b"1", b"h": b"not json"},
        {b"v": b"1", b"h": b'{"kind":"codes","job_id":"j"}'},
        {b"v": b"1", b"h": b'{"kind":"segment","job_id":"j","segment":1}'},
    ],
)
def test_malformed_entries_raise_message_error(fields):
    with pytest.raises(MessageError):
        SegmentTask.decode(fields)


def test_code_chunk_with_inconsistent_window_is_rejected():
    frames = np.zeros((2, 7), dtype=np.int32)
    bad = CodeChunk("j", 0, 1, 0, "tiny", left=2, right=1, final=False, frames=frames).encode()
    with pytest.raises(MessageError, match="inconsistent"):
        CodeChunk.decode(bad)
    truncated = dict(CodeChunk("j", 0, 1, 0, "tiny", 0, 0, True, frames).encode())
    truncated[b"p"] = truncated[b"p"][:-4]
    with pytest.raises(MessageError):
        CodeChunk.decode(truncated)


def test_odd_audio_payload_is_rejected():
    fields = AudioChunk("j", 0, 1, 0, True, 24000, b"\x00\x01").encode()
    fields[b"p"] = b"\x00\x01\x02"
    with pytest.raises(MessageError):
        AudioChunk.decode(fields)


def test_job_id_of_reads_broken_entries_best_effort():
    assert job_id_of({b"h": json.dumps({"job_id": "abc"}).encode()}) == "abc"
    assert job_id_of({b"h": b"garbage"}) is None
    assert job_id_of({}) is None


def test_runaway_retry_numbers_travel_and_default_to_a_first_try():
    task = SegmentTask("j", 3, "Hi.", "tiny", "tara", seed=42, retry=2)
    assert SegmentTask.decode(task.encode()).retry == 2
    chunk = CodeChunk("j", 3, 5, 0, "tiny", 0, 0, True, np.zeros((1, 1), np.int32), retry=2)
    assert CodeChunk.decode(chunk.encode()).retry == 2
    audio = AudioChunk("j", 3, 5, 0, True, 16000, b"\x00\x00", retry=2)
    assert AudioChunk.decode(audio.encode()) == audio
    # a message from a worker that predates retries is a first try
    fields = SegmentTask("j", 3, "Hi.", "tiny", "tara", seed=42).encode()
    header = json.loads(fields[b"h"])
    del header["retry"]
    fields[b"h"] = json.dumps(header).encode()
    assert SegmentTask.decode(fields).retry == 0
