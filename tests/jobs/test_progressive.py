"""The progressive encoders (jobs/progressive.py): bytes as soon as a frame is encoded, a stream an
independent decoder (Debian's ffmpeg) reads at the fed length, atempo's speed, and a listener who
leaves while a piece is encoded in a thread (the muxer must not close under it)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from jobs.progressive import STREAM_FORMATS, StreamEncoder
from tests.conftest import require

RATE = 22_050


def tone(seconds: float, rate: int = RATE) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (np.sin(2 * np.pi * 220 * t) * 8000).astype(np.int16)


def encode(fmt: str, pcm: np.ndarray, piece: int = 2205, tempo: float = 1.0) -> tuple[bytes, list[int]]:
    encoder = StreamEncoder(STREAM_FORMATS[fmt], RATE, tempo)
    out, sizes = bytearray(), []
    for i in range(0, pcm.size, piece):
        data = encoder.feed(pcm[i : i + piece])
        sizes.append(len(data))
        out += data
    out += encoder.close()
    return bytes(out), sizes


def decoded_seconds(data: bytes, fmt: str) -> float:
    if fmt == "pcm":
        return len(data) / 2 / 24_000
    pcm = subprocess.run(
        ["ffmpeg", "-v", "error", "-i", "pipe:0", "-f", "s16le", "-ac", "1", "-ar", "48000", "pipe:1"],
        input=data, capture_output=True, check=True,
    ).stdout  # fmt: skip
    return len(pcm) / 2 / 48_000


@pytest.mark.parametrize("fmt", sorted(STREAM_FORMATS))
def test_each_format_streams_and_decodes_at_its_length(fmt):
    require(shutil.which("ffmpeg") is not None, "ffmpeg (Debian's; scripts/test.sh installs it)")
    data, sizes = encode(fmt, tone(2.0))
    assert sum(1 for s in sizes[:5] if s) >= 3, sizes  # bytes leave with the first pieces, not at the end
    # ADTS has no place for the encoder's priming: its decoders play ~2 AAC frames more (93 ms here)
    slack = 2 * 1024 / RATE + 0.01 if fmt == "aac" else 0.08
    assert abs(decoded_seconds(data, fmt) - 2.0) < slack


def test_the_first_mp3_frame_needs_no_more_than_one_codec_frame_of_audio():
    """A codec LM's first chunk is one SNAC frame (2,048 samples at 24 kHz): enough for LAME's
    first frame, so a listener's first byte does not wait for the second chunk."""
    encoder = StreamEncoder(STREAM_FORMATS["mp3"], 24_000)
    assert encoder.feed(tone(2048 / 24_000, 24_000))[:2] == b"\xff\xf3"  # an MPEG-2 layer III frame


def test_speed_two_halves_the_length_and_a_quarter_quadruples_it():
    require(shutil.which("ffmpeg") is not None, "ffmpeg (Debian's; scripts/test.sh installs it)")
    assert abs(decoded_seconds(encode("wav", tone(2.0), tempo=2.0)[0], "wav") - 1.0) < 0.05
    assert abs(decoded_seconds(encode("wav", tone(1.0), tempo=0.25)[0], "wav") - 4.0) < 0.1
    with pytest.raises(ValueError, match="speed 5"):
        StreamEncoder(STREAM_FORMATS["mp3"], RATE, 5.0)


def test_leaving_while_a_piece_encodes_in_a_thread_does_not_crash_the_process():
    """In a child process: FFmpeg closed under a running mux was a segfault (the API died)."""
    script = textwrap.dedent(
        """
        import threading, time
        import numpy as np
        from jobs.progressive import STREAM_FORMATS, StreamEncoder
        pcm = (np.random.default_rng(0).standard_normal(22050 * 5) * 3000).astype(np.int16)
        for fmt in ("mp3", "opus"):
            e = StreamEncoder(STREAM_FORMATS[fmt], 22050)
            t = threading.Thread(target=lambda: [e.feed(pcm) for _ in range(30)])
            t.start(); time.sleep(0.2); e.abort(); t.join()
            assert e.feed(pcm) == b"" and e.close() == b""
        print("survived")
        """
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "survived" in run.stdout, (run.returncode, run.stderr[-2000:])
