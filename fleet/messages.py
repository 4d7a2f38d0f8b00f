"""The wire contract: every message that crosses a Redis stream.

A stream entry has three fields: ``v`` (schema version), ``h`` (a JSON header with the small fields)
and ``p`` (a binary payload: codec codes or PCM, never base64). Workers never read raw entries: they
call ``<Message>.decode(fields)``, which raises ``MessageError`` for anything malformed or of another
schema version (a permanent error: the entry is dead-lettered, not retried).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar, Self

import numpy as np

SCHEMA_VERSION = 1

Fields = dict[bytes, bytes]


class MessageError(ValueError):
    """A stream entry that is not a valid message of the expected kind and version."""


def _pack(kind: str, header: dict[str, Any], payload: bytes = b"") -> Fields:
    head = json.dumps({"kind": kind, **header}, separators=(",", ":")).encode()
    return {b"v": str(SCHEMA_VERSION).encode(), b"h": head, b"p": payload}


def _unpack(fields: Fields, kind: str) -> tuple[dict[str, Any], bytes]:
    try:
        version = int(fields[b"v"])
        header = json.loads(fields[b"h"])
    except (KeyError, ValueError, TypeError) as exc:
        raise MessageError(f"malformed {kind} entry: {exc!r}") from exc
    if version != SCHEMA_VERSION:
        raise MessageError(f"{kind} entry has schema version {version}, this worker speaks {SCHEMA_VERSION}")
    if header.pop("kind", None) != kind:
        raise MessageError(f"expected a {kind} entry")
    return header, fields.get(b"p", b"")


def _construct(cls: type, header: dict[str, Any], **extra: Any) -> Any:
    try:
        return cls(**header, **extra)
    except TypeError as exc:
        raise MessageError(f"bad {cls.__name__} fields: {exc}") from exc


@dataclass(frozen=True, slots=True)
class SegmentTask:
    """One segment to narrate: everything an AR worker needs, nothing it must look up."""

    KIND: ClassVar[str] = "segment"
    job_id: str
    segment: int
    text: str
    model: str
    voice: str
    seed: int
    #: Speaking rate (words per minute) and pitch (0-100) for models that take them; 0: none.
    #: Keyword-only, like retry: optional fields added over time must never shift positions.
    rate: int = field(default=0, kw_only=True)
    pitch: int = field(default=0, kw_only=True)
    #: Runaway retries before this one (0: the first try); the sampling seed derives from it.
    retry: int = field(default=0, kw_only=True)
    #: Its job is interactive (jobs/scheduler.py): it may take an AR engine's reserved slots.
    interactive: bool = field(default=False, kw_only=True)

    def encode(self) -> Fields:
        return _pack(self.KIND, asdict(self))

    def header(self) -> bytes:
        """The entry's JSON header alone (what an admission queue holds; the stream entry is
        ``{v: SCHEMA_VERSION, h: header}``: a task has no payload)."""
        return self.encode()[b"h"]

    @classmethod
    def decode(cls, fields: Fields) -> Self:
        header, _ = _unpack(fields, cls.KIND)
        return _construct(cls, header)

    @classmethod
    def from_header(cls, header: bytes) -> Self:
        return cls.decode({b"v": str(SCHEMA_VERSION).encode(), b"h": header})


@dataclass(frozen=True, slots=True)
class CodeChunk:
    """A window of codec frames for one decode: ``left`` context frames, new frames, ``right`` look-ahead.

    The decoder emits only the audio of the new frames (delta output). ``seq`` numbers the chunks of
    one attempt at a segment from 0; ``final`` marks the last one (which may carry no new frames).
    """

    KIND: ClassVar[str] = "codes"
    job_id: str
    segment: int
    attempt: int
    seq: int
    model: str
    left: int
    right: int
    final: bool
    frames: np.ndarray = field(compare=False)  # int32 [n_frames, codes_per_frame]
    retry: int = 0  # the task's runaway retry number (carried to the assembler's silence check)

    @property
    def new_frames(self) -> int:
        return int(self.frames.shape[0]) - self.left - self.right

    def encode(self) -> Fields:
        header = {
            k: getattr(self, k)
            for k in ("job_id", "segment", "attempt", "seq", "model", "left", "right", "final", "retry")
        }
        header["shape"] = list(self.frames.shape)
        return _pack(self.KIND, header, np.ascontiguousarray(self.frames, dtype="<i4").tobytes())

    @classmethod
    def decode(cls, fields: Fields) -> Self:
        header, payload = _unpack(fields, cls.KIND)
        shape = tuple(header.pop("shape", ()))
        try:
            frames = np.frombuffer(payload, dtype="<i4").reshape(shape)
        except ValueError as exc:
            raise MessageError(f"code chunk payload does not match shape {shape}") from exc
        chunk = _construct(cls, header, frames=frames)
        if chunk.frames.ndim != 2 or chunk.left < 0 or chunk.right < 0 or chunk.new_frames < 0:
            raise MessageError(
                f"code chunk window is inconsistent: shape {shape}, left {chunk.left}, right {chunk.right}"
            )
        return chunk


@dataclass(frozen=True, slots=True)
class AudioChunk:
    """Delta PCM (int16 mono) of one code chunk: only samples no earlier chunk carried."""

    KIND: ClassVar[str] = "audio"
    job_id: str
    segment: int
    attempt: int
    seq: int
    final: bool
    sample_rate: int
    pcm: bytes = field(repr=False)
    retry: int = 0  # the task's runaway retry number

    @property
    def samples(self) -> int:
        return len(self.pcm) // 2

    def encode(self) -> Fields:
        header = {
            k: getattr(self, k)
            for k in ("job_id", "segment", "attempt", "seq", "final", "sample_rate", "retry")
        }
        return _pack(self.KIND, header, self.pcm)

    @classmethod
    def decode(cls, fields: Fields) -> Self:
        header, payload = _unpack(fields, cls.KIND)
        if len(payload) % 2:
            raise MessageError("audio chunk payload is not whole int16 samples")
        return _construct(cls, header, pcm=bytes(payload))


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """A message taken out of circulation, with where it came from and why."""

    KIND: ClassVar[str] = "dead"
    stream: str
    entry_id: str
    job_id: str | None
    error: str
    deliveries: int
    original: bytes = field(repr=False, default=b"")

    def encode(self) -> Fields:
        header = {k: getattr(self, k) for k in ("stream", "entry_id", "job_id", "error", "deliveries")}
        return _pack(self.KIND, header, self.original)

    @classmethod
    def decode(cls, fields: Fields) -> Self:
        header, payload = _unpack(fields, cls.KIND)
        return _construct(cls, header, original=payload)


def header_of(fields: Fields) -> dict | None:
    """Best-effort header of any entry, without reading its payload (None if unreadable)."""
    try:
        header = json.loads(fields[b"h"])
    except (KeyError, ValueError, TypeError):
        return None
    return header if isinstance(header, dict) else None


def job_id_of(fields: Fields) -> str | None:
    """Best-effort job id of any entry, for failing the right job when the entry itself is broken."""
    job_id = (header_of(fields) or {}).get("job_id")
    return job_id if isinstance(job_id, str) else None
