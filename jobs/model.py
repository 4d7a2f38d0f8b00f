"""A narration job: its request, its state machine and the events it emits.

    queued ──> running ──> finalizing ──> done
       │          │             │
       └──────────┴─────────────┴──> failed | cancelled

``queued``: accepted, segments enqueued. ``running``: an AR worker started its first segment.
``finalizing``: every segment is assembled; the RQ finalize job stitches, encodes and uploads.
``done``/``failed``/``cancelled`` are terminal; the job's keys expire ``result_ttl_s`` later.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from enum import StrEnum

from fleet.names import JobObjects


class JobStatus(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    FINALIZING = "finalizing"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in (JobStatus.DONE, JobStatus.FAILED, JobStatus.CANCELLED)


class EventType(StrEnum):
    QUEUED = "queued"
    STARTED = "started"
    SEGMENT = "segment"
    PROGRESS = "progress"
    RUNAWAY = "runaway"  # a try of a segment ran away and is retried with another seed
    WARNING = "warning"  # a segment ran away on every try: kept, flagged in the manifest
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in (EventType.DONE, EventType.FAILED, EventType.CANCELLED)


@dataclass(slots=True)
class Job:
    """The job hash, typed. Numbers are stored as strings in Redis and parsed here."""

    id: str
    status: JobStatus
    model: str
    voice: str
    format: str
    sample_rate: int
    seed: int
    title: str = ""
    text_chars: int = 0
    segments_total: int = 0
    segments_done: int = 0
    #: Of those, taken from the segment cache instead of rendered (jobs/segcache.py).
    segments_reused: int = 0
    #: Segments kept after running away on every try (see models/runaway.py).
    segments_flagged: int = 0
    chapters: int = 0
    audio_seconds: float = 0.0
    created_at: float = 0.0
    started_at: float = 0.0
    finished_at: float = 0.0
    error: str = ""
    audio_key: str = ""
    duration_s: float = 0.0
    #: Speaking rate and pitch (single-stage models); 0 for models without these settings.
    rate: int = 0
    pitch: int = 0
    #: Who owns it (jobs/tenants.py); its storage objects are under this tenant's prefix.
    tenant: str = "default"
    #: Its admission class ("interactive" or "batch") and shard (jobs/scheduler.py).
    priority: str = "batch"
    shard: int = 0
    #: The encoder's bitrate (kb/s; 0: the format's default or lossless) and the file's tags.
    bitrate_kbps: int = 0
    author: str = ""
    narrator: str = ""
    year: int = 0
    language: str = ""
    #: Normalised to this integrated loudness (LUFS) under this true-peak ceiling (dBTP); 0: not.
    loudness_lufs: float = 0.0
    true_peak_dbtp: float = -3.0
    #: The cover picture's type (image/png, image/jpeg), stored at ``objects.cover``; "": none.
    cover: str = ""
    #: 1: also a file per chapter and a zip of them (``objects.chapter``, ``objects.chapters_zip``).
    chapter_files: int = 0

    def tags(self) -> dict[str, str]:
        """The finished file's tags, by FFmpeg's names (it maps them to ©nam/©ART/…, TIT2/TPE1/…,
        Vorbis comments): an audiobook's, as players read them."""
        return {
            "title": self.title,
            "album": self.title,
            "artist": self.author,
            "album_artist": self.author,
            "composer": self.narrator,  # audiobook players show the narrator from here
            "genre": "Audiobook",
            "date": str(self.year) if self.year else "",
            "language": self.language,
        }

    @property
    def objects(self) -> JobObjects:
        return JobObjects(self.tenant, self.id)

    def to_hash(self) -> dict[str, str]:
        return {f.name: str(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_hash(cls, raw: dict[bytes, bytes]) -> Job:
        data = {k.decode(): v.decode() for k, v in raw.items()}
        values = {}
        for f in fields(cls):
            if f.name not in data:
                continue
            value = data[f.name]
            if f.type in ("int",):
                values[f.name] = int(float(value))
            elif f.type in ("float",):
                values[f.name] = float(value)
            elif f.name == "status":
                values[f.name] = JobStatus(value)
            else:
                values[f.name] = value
        return cls(**values)

    def eta_s(self, now: float) -> float | None:
        """Seconds to the last segment at the pace so far (None before the first segment is done)."""
        if self.status.terminal or not self.segments_done or not self.started_at:
            return None
        elapsed = max(now - self.started_at, 0.0)
        return elapsed / self.segments_done * (self.segments_total - self.segments_done)
