"""Output formats and their encoders: PCM in, one file out, written as it comes (bounded memory).

WAV and FLAC go through soundfile (libsndfile); the compressed formats through PyAV (FFmpeg's AAC,
LAME MP3 and libopus encoders and the MP4/MP3/Ogg muxers, all in its wheel): frames are encoded and
muxed as the finalizer hands over each segment, so no format holds the book in memory. Chapters and
tags are given when the file is opened: MP3 (ID3v2 CHAP frames) and Ogg (comments) write them in the
header, MP4 in its index at the end.

Why PyAV and not pydub: pydub runs an ffmpeg binary over whole in-memory segments (and needs the
stdlib ``audioop``, removed in Python 3.13); PyAV streams frames in-process, carries the encoders in
its wheel (BSD licence) and writes chapters (docs/architecture.md, "Output files").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Protocol

import numpy as np


@dataclass(frozen=True)
class Format:
    name: str
    #: The stored file's extension and content type.
    extension: str
    content_type: str
    #: soundfile's (format, subtype), or PyAV's (container, codec).
    soundfile: tuple[str, str] | None = None
    av: tuple[str, str] | None = None
    #: Chapters and tags embedded in the file.
    chapters: bool = False
    #: Bitrate in kb/s: the default (a speech default, mono) and the accepted range; 0: lossless.
    default_kbps: int = 0
    kbps_range: tuple[int, int] = (0, 0)
    #: Sample rates the codec takes (None: any the fleet offers).
    rates: tuple[int, ...] | None = None
    #: The rate used when the model's is not one of ``rates`` and the job names none.
    preferred_rate: int = 0
    aliases: tuple[str, ...] = field(default=())
    #: MP4's major brand (what players take the file for: M4B an audiobook).
    brand: str = ""
    #: A cover picture can be attached.
    cover: bool = False

    @property
    def lossy(self) -> bool:
        return self.default_kbps > 0


# AAC in MP4 (FFmpeg's mp4 muxer: it takes a cover picture, the ipod one does not), chapter marks
# as Nero and QuickTime chapters, as FFmpeg writes them
_AAC = dict(content_type="audio/mp4", chapters=True, cover=True, default_kbps=64, kbps_range=(16, 320))

FORMATS: dict[str, Format] = {
    f.name: f
    for f in (
        Format("wav", "wav", "audio/wav", soundfile=("WAV", "PCM_16")),
        Format("flac", "flac", "audio/flac", soundfile=("FLAC", "PCM_16")),
        # an audiobook (the M4B brand is what players go by)
        Format("m4b", "m4b", av=("mp4", "aac"), brand="M4B ", **_AAC),
        # the same in a music player's extension; "aac" names it too: a raw ADTS stream would have no
        # place for chapters, tags or the exact length (its decoders play the encoder's priming samples)
        Format("m4a", "m4a", av=("mp4", "aac"), brand="M4A ", aliases=("aac",), **_AAC),
        Format(
            "mp3", "mp3", "audio/mpeg", av=("mp3", "libmp3lame"), chapters=True, cover=True,
            default_kbps=64, kbps_range=(32, 320), rates=(16_000, 22_050, 24_000, 32_000, 44_100, 48_000),
        ),  # fmt: skip
        Format(
            "opus", "opus", "audio/ogg", av=("ogg", "libopus"), chapters=True, cover=True,
            default_kbps=32, kbps_range=(6, 256), rates=(16_000, 24_000, 48_000), preferred_rate=48_000,
        ),  # fmt: skip
    )
}
ALIASES = {alias: f.name for f in FORMATS.values() for alias in f.aliases}


def format_named(name: str) -> Format | None:
    """The format called ``name`` (any case, or an alias), or None."""
    key = name.lower()
    return FORMATS.get(ALIASES.get(key, key))


def format_names() -> list[str]:
    return [*FORMATS, *ALIASES]


@dataclass(frozen=True)
class Chapter:
    title: str
    start_s: float
    end_s: float


class AudioSink(Protocol):
    def write(self, pcm: np.ndarray) -> None:
        """Append int16 mono samples at the sink's rate."""

    def close(self) -> None:
        """Flush the encoder and finish the file."""


def open_sink(
    path: Path,
    fmt: Format,
    rate: int,
    *,
    kbps: int = 0,
    tags: dict[str, str] | None = None,
    chapters: list[Chapter] = (),
    cover: Cover | None = None,
) -> AudioSink:
    """A sink that writes ``path`` in ``fmt``; ``kbps`` 0: the format's default; ``cover``: the
    picture attached (formats whose ``cover`` is true)."""
    if fmt.soundfile is not None:
        return _SoundFileSink(path, fmt, rate)
    return _AvSink(path, fmt, rate, kbps or fmt.default_kbps, tags or {}, list(chapters), cover if fmt.cover else None)


class _SoundFileSink:
    def __init__(self, path: Path, fmt: Format, rate: int) -> None:
        import soundfile as sf

        sf_format, subtype = fmt.soundfile
        self._file = sf.SoundFile(path, "w", samplerate=rate, channels=1, format=sf_format, subtype=subtype)

    def write(self, pcm: np.ndarray) -> None:
        if pcm.size:
            self._file.write(pcm)

    def close(self) -> None:
        self._file.close()


def vorbis_chapters(chapters: list[Chapter]) -> dict[str, str]:
    """Chapters as Ogg comments (the Vorbis chapter extension: CHAPTER001=HH:MM:SS.mmm, CHAPTER001NAME).
    Written here, not by FFmpeg's muxer: FFmpeg 8's writer rounds the seconds field to the nearest
    second (12.972 s is written 00:00:13.972)."""
    comments = {}
    for i, chapter in enumerate(chapters):
        ms = round(chapter.start_s * 1000)
        hours, rest = divmod(ms, 3_600_000)
        minutes, rest = divmod(rest, 60_000)
        seconds, millis = divmod(rest, 1000)
        comments[f"CHAPTER{i:03d}"] = f"{hours:02d}:{minutes:02d}:{seconds:02d}.{millis:03d}"
        comments[f"CHAPTER{i:03d}NAME"] = chapter.title
    return comments


@dataclass(frozen=True)
class Cover:
    data: bytes
    mime: str  # image/png or image/jpeg
    width: int
    height: int

    @property
    def codec(self) -> str:
        return "png" if self.mime == "image/png" else "mjpeg"


class CoverError(ValueError):
    """Not a picture a file can carry (the reason is the message)."""


_MAGIC = {b"\x89PNG\r\n\x1a\n": "image/png", b"\xff\xd8\xff": "image/jpeg"}


def read_cover(data: bytes, max_bytes: int, max_side: int = 4096) -> Cover:
    """A cover picture checked: PNG or JPEG by its bytes, at most ``max_bytes``, and decodable
    (FFmpeg's own decoder reads it; its size comes from there)."""
    if len(data) > max_bytes:
        raise CoverError(f"the cover is {len(data):,} bytes; at most {max_bytes:,}")
    mime = next((m for magic, m in _MAGIC.items() if data.startswith(magic)), None)
    if mime is None:
        raise CoverError("the cover is not a PNG or JPEG picture")
    import av

    decoder = av.CodecContext.create("png" if mime == "image/png" else "mjpeg", "r")
    try:
        frames = decoder.decode(av.Packet(data))
    except av.FFmpegError as exc:
        raise CoverError(f"the cover cannot be read as {mime}: {exc}") from None
    if not frames:
        raise CoverError(f"the cover cannot be read as {mime}")
    width, height = frames[0].width, frames[0].height
    if max(width, height) > max_side:
        raise CoverError(f"the cover is {width}x{height}; at most {max_side} pixels a side")
    return Cover(data, mime, width, height)


def flac_picture_block(cover: Cover) -> str:
    """The cover as Ogg's METADATA_BLOCK_PICTURE comment (a FLAC picture block, base64): front cover."""
    import base64
    import struct

    mime = cover.mime.encode()
    block = (
        struct.pack(">II", 3, len(mime)) + mime + struct.pack(">I", 0)
        + struct.pack(">IIIII", cover.width, cover.height, 24, 0, len(cover.data)) + cover.data
    )  # fmt: skip
    return base64.b64encode(block).decode()


class _AvSink:
    def __init__(
        self,
        path: Path,
        fmt: Format,
        rate: int,
        kbps: int,
        tags: dict[str, str],
        chapters: list[Chapter],
        cover: Cover | None = None,
    ) -> None:
        import av

        container, codec = fmt.av
        self._container = av.open(str(path), "w", format=container, options={"brand": fmt.brand} if fmt.brand else {})
        try:
            tags = {k: v for k, v in tags.items() if v}
            self._container.metadata.update(tags)
            self._stream = self._container.add_stream(codec, rate=rate, layout="mono")
            self._stream.bit_rate = kbps * 1000
            self._stream.metadata.update(tags)  # Ogg keeps its comments with the stream
            if chapters and fmt.chapters and container == "ogg":
                self._stream.metadata.update(vorbis_chapters(chapters))
            elif chapters and fmt.chapters:
                ms = Fraction(1, 1000)
                self._container.set_chapters(
                    [
                        {
                            "id": i + 1,
                            "start": round(c.start_s * 1000),
                            "end": round(c.end_s * 1000),
                            "time_base": ms,
                            "metadata": {"title": c.title},
                        }
                        for i, c in enumerate(chapters)
                    ]
                )
            # the cover last: muxing its packet writes the header, which holds MP3's chapters
            if cover is not None and container == "ogg":
                self._stream.metadata["METADATA_BLOCK_PICTURE"] = flac_picture_block(cover)
            elif cover is not None:  # an attached picture: a video stream of one packet
                picture = self._container.add_stream(cover.codec)
                picture.width, picture.height = cover.width, cover.height
                picture.pix_fmt = "rgb24" if cover.codec == "png" else "yuvj420p"
                picture.disposition = av.stream.Disposition.attached_pic
                self._container.start_encoding()
                packet = av.Packet(cover.data)
                packet.stream, packet.pts, packet.dts = picture, 0, 0
                self._container.mux(packet)
        except Exception:
            self._container.close()
            raise
        self._rate = rate
        self._written = 0
        self._frame = av.AudioFrame

    def write(self, pcm: np.ndarray) -> None:
        if not pcm.size:
            return
        frame = self._frame.from_ndarray(
            np.ascontiguousarray(pcm, dtype=np.int16).reshape(1, -1), format="s16", layout="mono"
        )
        frame.sample_rate = self._rate
        frame.pts = self._written
        frame.time_base = Fraction(1, self._rate)
        self._written += int(pcm.size)
        # PyAV's encoder converts to the codec's sample format and cuts its frame size (a FIFO inside)
        for packet in self._stream.encode(frame):
            self._container.mux(packet)

    def close(self) -> None:
        try:
            for packet in self._stream.encode(None):
                self._container.mux(packet)
        finally:
            self._container.close()


#: The decoder of each encoder (what a listener's player runs).
_DECODERS = {"aac": "aac", "libmp3lame": "mp3float", "libopus": "opus"}


class CodecRoundTrip:
    """The format's encoder and decoder in memory: what the listener will hear, without writing a
    file (the loudness pass measures it: lossy codecs move the loudness and the peaks a little)."""

    def __init__(self, fmt: Format, rate: int, kbps: int = 0) -> None:
        import av

        _, codec = fmt.av
        self._encoder = av.CodecContext.create(codec, "w")
        self._encoder.sample_rate = rate
        self._encoder.layout = "mono"
        self._encoder.format = self._encoder.codec.audio_formats[0].name
        self._encoder.bit_rate = (kbps or fmt.default_kbps) * 1000
        self._encoder.time_base = Fraction(1, rate)
        self._encoder.open()
        self._decoder = av.CodecContext.create(_DECODERS[codec], "r")
        if self._encoder.extradata:
            self._decoder.extradata = self._encoder.extradata
        self._frame = av.AudioFrame
        self._rate = rate
        self._written = 0

    @property
    def decoded_rate(self) -> int:
        """The decoder's output rate (Opus always decodes at 48 kHz)."""
        return 48_000 if _DECODERS.get(self._encoder.codec.name) == "opus" else self._rate

    def feed(self, pcm: np.ndarray) -> np.ndarray:
        """int16 mono in; the decoded samples that came out so far (float64 in [-1, 1])."""
        if not pcm.size:
            return np.zeros(0)
        frame = self._frame.from_ndarray(np.ascontiguousarray(pcm, dtype=np.int16).reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate = self._rate
        frame.pts = self._written
        self._written += int(pcm.size)
        return self._decode(self._encoder.encode(frame))

    def flush(self) -> np.ndarray:
        return self._decode(self._encoder.encode(None))

    def _decode(self, packets) -> np.ndarray:
        out = []
        for packet in packets:
            for frame in self._decoder.decode(packet):
                x = frame.to_ndarray().reshape(-1)
                out.append(x.astype(np.float64) / 32768.0 if x.dtype == np.int16 else x.astype(np.float64))
        return np.concatenate(out) if out else np.zeros(0)
