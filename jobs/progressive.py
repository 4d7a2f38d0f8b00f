"""Progressive encoders: int16 PCM in, the bytes of a playable stream out as soon as they are encoded.

What a listener's player (or an HTTP client) receives while a job still renders: each format is a
stream that needs no seek back to finish (MP3 frames without a Xing header, Ogg pages of 20 ms, ADTS
AAC, FLAC and WAV with the "unknown length" headers of streamed files, raw PCM). PyAV (FFmpeg's
muxers, writing into a non-seekable sink) does every container, so bytes leave with each frame.
An optional tempo (FFmpeg's ``atempo`` filter: speed without a pitch change) serves the speech API's
``speed``. The finished file's encoders are elsewhere (jobs/encoding.py: they write chapters, tags and
headers that need the whole book).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from dataclasses import dataclass
from fractions import Fraction

import numpy as np


@dataclass(frozen=True)
class StreamFormat:
    name: str
    content_type: str
    #: PyAV's (container, codec); None: raw PCM (no container, no encoder).
    av: tuple[str, str] | None
    #: Muxer options for streaming.
    options: tuple[tuple[str, str], ...] = ()
    #: Rates the codec takes (None: any); otherwise the stream is resampled to ``preferred_rate``.
    rates: tuple[int, ...] | None = None
    preferred_rate: int = 24_000
    kbps: int = 0


STREAM_FORMATS: dict[str, StreamFormat] = {
    f.name: f
    for f in (
        # no ID3 tag and no Xing frame: the first bytes are the first audio frame
        StreamFormat(
            "mp3", "audio/mpeg", ("mp3", "libmp3lame"), (("write_xing", "0"), ("id3v2_version", "0")),
            rates=(16_000, 22_050, 24_000, 32_000, 44_100, 48_000), kbps=64,
        ),  # fmt: skip
        # Ogg pages of 20 ms (the muxer's default holds a page for a second)
        StreamFormat(
            "opus", "audio/ogg", ("ogg", "libopus"), (("page_duration", "20000"),),
            rates=(16_000, 24_000, 48_000), kbps=32,
        ),  # fmt: skip
        StreamFormat("aac", "audio/aac", ("adts", "aac"), kbps=64),
        StreamFormat("flac", "audio/flac", ("flac", "flac")),
        StreamFormat("wav", "audio/wav", ("wav", "pcm_s16le")),
        # OpenAI's "pcm": 24 kHz, 16-bit signed little-endian, mono, no header
        StreamFormat("pcm", "audio/pcm", None, rates=(24_000,)),
    )
}

#: Speeds ``atempo`` takes in one filter; slower ones chain two.
TEMPO_RANGE = (0.25, 4.0)


class _Sink:
    """A write-only, non-seekable file for PyAV: muxers then write streaming headers."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def write(self, data) -> int:
        self.parts.append(bytes(data))
        return len(data)

    def take(self) -> bytes:
        out, self.parts = b"".join(self.parts), []
        return out


class StreamEncoder:
    """``feed`` int16 mono PCM at ``in_rate``; each call returns the stream's new bytes (maybe none
    yet: codecs keep a frame back); ``close`` returns the rest. Thread-safe: a long piece is fed
    from a worker thread while the listener may leave (``abort`` on the event loop); FFmpeg's muxer
    closed under a running ``mux`` crashes the process, so one lock orders them."""

    def __init__(self, fmt: StreamFormat, in_rate: int, tempo: float = 1.0) -> None:
        self.format = fmt
        self.rate = in_rate if fmt.rates is None or in_rate in fmt.rates else fmt.preferred_rate
        self._resampler = None
        if self.rate != in_rate:
            import soxr

            self._resampler = soxr.ResampleStream(in_rate, self.rate, 1, dtype="int16")
        self._tempo = _Tempo(self.rate, tempo) if abs(tempo - 1.0) > 1e-6 else None
        self._sink = _Sink()
        self._container = self._stream = None
        if fmt.av is not None:
            import av

            container, codec = fmt.av
            self._container = av.open(self._sink, "w", format=container, options=dict(fmt.options))
            self._stream = self._container.add_stream(codec, rate=self.rate, layout="mono")
            if fmt.kbps:
                self._stream.bit_rate = fmt.kbps * 1000
        self._written = 0
        self.samples = 0  # at self.rate, before the tempo
        self._lock = threading.Lock()
        self._ended = False

    def feed(self, pcm: np.ndarray) -> bytes:
        with self._lock:
            return b"" if self._ended else self._feed(pcm)

    def _feed(self, pcm: np.ndarray) -> bytes:
        if self._resampler is not None:
            pcm = self._resampler.resample_chunk(pcm)
        self.samples += int(pcm.size)
        if self._tempo is not None:
            pcm = self._tempo.apply(pcm)
        self._encode(pcm)
        return self._sink.take()

    def close(self) -> bytes:
        with self._lock:
            if self._ended:
                return b""
            self._ended = True
            return self._close()

    def _close(self) -> bytes:
        if self._resampler is not None:
            tail = self._resampler.resample_chunk(np.zeros(0, dtype=np.int16), last=True)
            self.samples += int(tail.size)
            self._encode(self._tempo.apply(tail) if self._tempo is not None else tail)
        if self._tempo is not None:
            self._encode(self._tempo.apply(None))
        if self._container is not None:
            for packet in self._stream.encode(None):
                self._container.mux(packet)
            self._container.close()
        return self._sink.take()

    def abort(self) -> None:
        """Drop the encoder without finishing the stream (the listener left); waits for a ``feed``
        under way (one piece's encode)."""
        with self._lock:
            if self._ended:
                return
            self._ended = True
            if self._container is not None:
                with contextlib.suppress(Exception):  # nothing is listening any more
                    self._container.close()

    def _encode(self, pcm: np.ndarray) -> None:
        if not pcm.size:
            return
        pcm = np.ascontiguousarray(pcm, dtype=np.int16)
        if self._container is None:
            self._sink.write(pcm.astype("<i2").tobytes())
            return
        import av

        frame = av.AudioFrame.from_ndarray(pcm.reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate = self.rate
        frame.pts = self._written
        frame.time_base = Fraction(1, self.rate)
        self._written += int(pcm.size)
        for packet in self._stream.encode(frame):
            self._container.mux(packet)


class _Tempo:
    """FFmpeg's atempo (WSOLA): the same voice, faster or slower. One filter takes 0.5 to 100; a
    speed below 0.5 is two filters of its square root."""

    def __init__(self, rate: int, tempo: float) -> None:
        import av.filter

        lo, hi = TEMPO_RANGE
        if not lo <= tempo <= hi:
            raise ValueError(f"speed {tempo} is outside {lo} to {hi}")
        self._graph = av.filter.Graph()
        source = self._graph.add_abuffer(format="s16", sample_rate=rate, layout="mono", time_base=Fraction(1, rate))
        steps = [tempo] if tempo >= 0.5 else [tempo**0.5, tempo**0.5]
        nodes = [source, *(self._graph.add("atempo", f"{step:.6f}") for step in steps)]
        nodes.append(self._graph.add("aformat", "sample_fmts=s16:channel_layouts=mono"))
        nodes.append(self._graph.add("abuffersink"))
        for a, b in itertools.pairwise(nodes):
            a.link_to(b)
        self._graph.configure()
        self._rate = rate
        self._pts = 0

    def apply(self, pcm: np.ndarray | None) -> np.ndarray:
        import av

        if pcm is None:
            self._graph.push(None)
        elif pcm.size:
            frame = av.AudioFrame.from_ndarray(
                np.ascontiguousarray(pcm, dtype=np.int16).reshape(1, -1), format="s16", layout="mono"
            )
            frame.sample_rate, frame.pts, frame.time_base = self._rate, self._pts, Fraction(1, self._rate)
            self._pts += int(pcm.size)
            self._graph.push(frame)
        else:
            return np.zeros(0, dtype=np.int16)
        out = []
        while True:
            try:
                out.append(self._graph.pull().to_ndarray().reshape(-1))
            except (av.error.BlockingIOError, av.error.EOFError):
                break
        return np.concatenate(out).astype(np.int16) if out else np.zeros(0, dtype=np.int16)
