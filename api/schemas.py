"""Request and response bodies of the HTTP API (they make the OpenAPI document at /docs)."""

from __future__ import annotations

import base64
import binascii
import time
from dataclasses import replace
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, model_validator

from fleet.settings import Settings
from jobs.books import Book
from jobs.encoding import format_names
from jobs.errors import InvalidRequest
from jobs.lexicon import Entry, entries_from
from jobs.model import Job, JobStatus
from jobs.service import JobRequest, from_book
from jobs.uploads import Upload, read_upload
from models.registry import ModelSpec


class Source(BaseModel):
    """A file to narrate, sent inside the JSON body (multipart/form-data sends it as a file part)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    kind: Literal["epub", "text", "markdown"] = Field(description="What the file is.")
    data: str = Field(description="The file's bytes, base64.")
    name: str = Field(default="", max_length=300, description="Its file name (for messages).")

    def upload(self) -> Upload:
        try:
            data = base64.b64decode(self.data, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidRequest("source.data is not base64 (the file's bytes, base64-encoded)") from None
        return Upload(data, self.name, self.kind)


class JobCreate(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        strict=True,  # "5" is not an integer, true is not a number
        json_schema_extra={
            "examples": [
                {
                    "text": "# Chapter 1\n\nIt was a dark and stormy night.",
                    "title": "A Novel",
                    "voice": "tara",
                }
            ]
        },
    )

    text: str | None = Field(
        default=None,
        description="The text to narrate: plain text or Markdown (headings start chapters). Or send a source.",
    )
    source: Source | None = Field(
        default=None, description="A file to narrate instead of text: an EPUB, or a .txt or .md file (base64)."
    )
    chapters: list[int | str] | None = Field(
        default=None,
        max_length=10_000,
        description="EPUB: the chapters to narrate, by number (from 1, as POST /v1/books/contents lists them) "
        "or title; default: all but the front and back matter (cover, title page, copyright, contents, index).",
    )
    alt_text: bool = Field(default=False, description="EPUB: read images' alt text.")
    lexicon: list[dict] | None = Field(
        default=None,
        description='Pronunciations for this job: [{"match": "Nguyen", "say": "Win"}, {"regex": "\\bSQL\\b", '
        '"say": "sequel"}]; whole words, case-insensitive unless "case_sensitive": true; regex is RE2. '
        "Applied before the tenant's named lexicons.",
    )
    text_normalization: bool | None = Field(
        default=None,
        description="Write numbers, dates, currencies, units and abbreviations as words before synthesis "
        "(English); default: on for codec-LM models, off for espeak (which reads them itself).",
    )
    lexicons: list[str] | None = Field(
        default=None, max_length=20, description="Names of the tenant's lexicons (PUT /v1/lexicons/{name}) to apply, in order."
    )
    title: str | None = Field(default=None, max_length=500)
    voice: str | None = Field(
        default=None,
        max_length=100,
        description="A voice of the model (GET /v1/models); default: the model's.",
    )
    model: str | None = Field(
        default=None, max_length=100, description="A model this fleet serves; default: the fleet's default."
    )
    format: str = Field(default="wav", max_length=20, description=f"Output format: {', '.join(format_names())}.")
    bitrate_kbps: int | None = Field(
        default=None, description="Compressed formats: kb/s (default: a speech default, e.g. 64 for AAC, 32 for Opus)."
    )
    author: str = Field(default="", max_length=500, description="The file's author (artist) tag.")
    narrator: str | None = Field(
        default=None, max_length=500, description="The file's narrator (composer) tag; default: the voice's name."
    )
    year: int | None = Field(default=None, description="The file's year (date) tag.")
    language: str = Field(
        default="", max_length=35, description="The file's language tag: ISO 639-2, three letters (e.g. eng, deu)."
    )
    normalize: bool | None = Field(
        default=None,
        description="Normalise the book's loudness (two passes, BS.1770-4); default: on for m4b, m4a, mp3, "
        "opus, off for wav and flac (exact samples).",
    )
    loudness_lufs: float = Field(default=-18.0, description="Target integrated loudness, -40 to -5 LUFS.")
    true_peak_dbtp: float = Field(default=-3.0, description="True-peak ceiling, -12 to 0 dBTP.")
    chapter_files: bool = Field(
        default=False, description="Also one file per chapter (GET .../audio?chapter=N) and a zip (?chapters=zip)."
    )
    cover: str | None = Field(
        default=None,
        description="A cover picture, PNG or JPEG, base64 or a data: URL (m4b, m4a, mp3, opus; at most 2 MiB).",
    )
    sample_rate: int | None = Field(
        default=None, gt=0, description="Output sample rate; default: the model's."
    )
    seed: int = Field(
        default=0,
        ge=0,
        le=2**31 - 1,
        description="Sampling seed; the same seed and text give the same audio.",
    )
    text_format: Literal["markdown", "plain"] = "markdown"
    rate: int | None = Field(
        default=None, description="Speaking rate in words per minute (single-stage models, e.g. espeak)."
    )
    pitch: int | None = Field(default=None, description="Pitch 0-100 (single-stage models, e.g. espeak).")
    priority: Literal["interactive", "batch"] | None = Field(
        default=None,
        description="interactive: its segments go before every batch job's; default: interactive when short.",
    )

    @model_validator(mode="after")
    def _text_or_source(self, info: ValidationInfo) -> JobCreate:
        if (info.context or {}).get("file_part"):  # multipart: the file is the text
            return self
        if (self.text is None) == (self.source is None):
            raise ValueError("send either text or a source (a file), not both or neither")
        return self

    def to_request(
        self, tenant: str, settings: Settings, upload: Upload | None = None, named: list[Entry] | None = None
    ) -> JobRequest:
        """The job request; ``upload``: a file sent beside the fields (multipart), else ``source``'s;
        ``named``: the entries of the named lexicons. Reads the file (an EPUB's chapters, a text
        file's text): CPU work, run it in a thread."""
        own = entries_from(self.lexicon) if self.lexicon is not None else []
        request = replace(self._request(tenant, self.text or ""), lexicon=own + (named or []))
        upload = upload or (self.source.upload() if self.source is not None else None)
        if upload is None:
            if self.chapters is not None:
                raise InvalidRequest("chapters: only a book (an EPUB source or file) has chapters to choose")
            return request
        read = read_upload(upload, settings, alt_text=self.alt_text)
        if isinstance(read, Book):
            return from_book(request, read, self.chapters)
        if self.chapters is not None:
            raise InvalidRequest("chapters: only a book (an EPUB) has chapters to choose; this file is text")
        text, is_markdown = read
        return replace(request, text=text, markdown=is_markdown)

    def _request(self, tenant: str, text: str) -> JobRequest:
        return JobRequest(
            tenant=tenant,
            priority=self.priority,
            text=text,
            title=self.title,
            voice=self.voice,
            model=self.model,
            format=self.format,
            sample_rate=self.sample_rate,
            bitrate_kbps=self.bitrate_kbps,
            author=self.author,
            narrator=self.narrator,
            year=self.year,
            language=self.language,
            normalize=self.normalize,
            loudness_lufs=self.loudness_lufs,
            true_peak_dbtp=self.true_peak_dbtp,
            cover=decode_cover(self.cover),
            chapter_files=self.chapter_files,
            normalize_text=self.text_normalization,
            seed=self.seed,
            markdown=self.text_format == "markdown",
            rate=self.rate,
            pitch=self.pitch,
        )


def job_form_schema() -> dict:
    """The multipart/form-data job for the OpenAPI document: a file part and JobCreate's fields."""
    fields = JobCreate.model_json_schema()["properties"]
    properties = {k: v for k, v in fields.items() if k not in ("text", "source")}
    properties["chapters"] = {"type": "string", "description": "Comma-separated numbers or titles (or repeat the field)."}
    file = {"type": "string", "format": "binary", "description": "An EPUB, .txt or .md file."}
    return {"type": "object", "required": ["file"], "properties": {"file": file, **properties}}


class LexiconBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    entries: list[dict] = Field(
        description='[{"match": "Nguyen", "say": "Win"}, {"regex": "\\bv(\\d+)\\b", "say": "version"}, ...]; '
        "at most 1,000"
    )


class LexiconView(BaseModel):
    name: str
    entries: list[dict]


class BookSource(BaseModel):
    """A book to list the contents of (POST /v1/books/contents, JSON)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    source: Source
    alt_text: bool = False


class BookChapterView(BaseModel):
    number: int = Field(description="What a job's chapters selection names it by.")
    title: str
    matter: str = Field(description='"" for the body; else cover, titlepage, copyright-page, toc, index, unlisted...')
    narrated_by_default: bool
    chars: int = Field(description="Characters of text (the title aside).")


class BookContents(BaseModel):
    title: str
    author: str
    language: str = Field(description="ISO 639-2, or empty.")
    cover: bool = Field(description="Whether the book has a cover picture (used for m4b, m4a, mp3, opus).")
    chapters: list[BookChapterView]

    @classmethod
    def of(cls, book: Book) -> BookContents:
        return cls(
            title=book.title,
            author=book.author,
            language=book.language,
            cover=book.cover is not None,
            chapters=[BookChapterView(**c) for c in book.contents()],
        )


def decode_cover(text: str | None) -> bytes | None:
    """The cover's bytes from base64 (or a ``data:image/...;base64,`` URL); what they are, the job's
    validation checks."""
    if text is None:
        return None
    if text.startswith("data:"):
        text = text.partition(",")[2]
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequest("cover is not base64 (a PNG or JPEG picture, base64-encoded)") from None


class Links(BaseModel):
    self: str
    events: str = Field(description="SSE; its token lets a browser's EventSource in without a header.")
    audio: str = Field(
        description="The finished file; its token lets an <audio> element in without a header."
    )
    captions: str = Field(
        default="", description="WebVTT (or ?format=srt) of the finished file; the audio token opens it too."
    )
    marks: str = Field(default="", description="Per-sentence speech marks (JSON lines) of the finished file.")
    stream: str = Field(
        default="",
        description="The audio as it renders (MP3; ?chapter=N starts at a chapter); the audio token opens it.",
    )

    @classmethod
    def of(cls, job_id: str, tokens: dict[str, str] | None = None) -> Links:
        """The job's links; ``tokens`` (kind -> signed token) are added to the events and audio links."""
        base = f"/v1/jobs/{job_id}"
        tokens = tokens or {}

        def link(kind: str) -> str:
            return f"{base}/{kind}" + (f"?token={tokens[kind]}" if kind in tokens else "")

        audio_token = f"?token={tokens['audio']}" if "audio" in tokens else ""
        return cls(
            self=base,
            events=link("events"),
            audio=link("audio"),
            captions=f"{base}/captions{audio_token}",
            marks=f"{base}/marks{audio_token}",
            stream=f"{base}/stream{audio_token}",
        )


class JobAccepted(BaseModel):
    id: str
    status: str
    segments_total: int
    segments_reused: int = Field(default=0, description="Of those, already rendered by earlier jobs: not rendered again.")
    chapters: int
    links: Links

    @classmethod
    def of(cls, job: Job, links: Links) -> JobAccepted:
        return cls(
            id=job.id,
            status=job.status.value,
            segments_total=job.segments_total,
            segments_reused=job.segments_reused,
            chapters=job.chapters,
            links=links,
        )


class Place(BaseModel):
    queued: int = Field(description="The job's segments not yet taken by an engine.")
    segments_ahead: int = Field(description="An estimate of the segments that go before its next one.")


class JobView(BaseModel):
    id: str
    tenant: str
    status: str
    priority: str = Field(description="interactive or batch (admission class).")
    place: Place | None = Field(default=None, description="Where it waits, while it has queued segments.")
    title: str
    model: str
    voice: str
    format: str
    sample_rate: int
    bitrate_kbps: int | None = Field(default=None, description="The encoder's bitrate, for compressed formats.")
    author: str = ""
    narrator: str = ""
    loudness_lufs: float | None = Field(default=None, description="The loudness it is normalised to, if it is.")
    chapter_files: bool = Field(default=False, description="It has a file per chapter too.")
    rate: int | None = Field(
        default=None, description="Speaking rate (words per minute), if the model has one."
    )
    pitch: int | None = Field(default=None, description="Pitch (0-100), if the model has one.")
    segments_done: int
    segments_total: int
    segments_reused: int = Field(
        default=0,
        description="Of segments_total, those taken from earlier jobs' rendered segments (same text, voice, "
        "model, seed and settings) instead of rendered again.",
    )
    segments_flagged: int = Field(
        description="Segments that ran away (never stopped, looped, near-silent) on every try: kept, "
        "listed in the manifest's flagged_segments, each announced by a 'warning' event."
    )
    chapters: int
    audio_seconds: float = Field(description="Seconds of narrated audio assembled so far.")
    duration_s: float | None = Field(description="Length of the finished file (with pauses), once done.")
    eta_s: float | None = Field(description="Estimated seconds until every segment is narrated.")
    error: str | None
    created_at: float
    started_at: float | None
    finished_at: float | None
    links: Links

    @classmethod
    def of(cls, job: Job, links: Links, place: tuple[int, int] | None = None) -> JobView:
        return cls(
            id=job.id,
            tenant=job.tenant,
            status=job.status.value,
            priority=job.priority,
            place=Place(queued=place[0], segments_ahead=place[1]) if place and place[0] else None,
            title=job.title,
            model=job.model,
            voice=job.voice,
            format=job.format,
            sample_rate=job.sample_rate,
            bitrate_kbps=job.bitrate_kbps or None,
            author=job.author,
            narrator=job.narrator,
            loudness_lufs=job.loudness_lufs or None,
            chapter_files=bool(job.chapter_files),
            rate=job.rate or None,
            pitch=job.pitch if job.rate else None,
            segments_done=job.segments_done,
            segments_total=job.segments_total,
            segments_reused=job.segments_reused,
            segments_flagged=job.segments_flagged,
            chapters=job.chapters,
            audio_seconds=round(job.audio_seconds, 3),
            duration_s=job.duration_s if job.status == JobStatus.DONE else None,
            eta_s=job.eta_s(time.time()),
            error=job.error or None,
            created_at=job.created_at,
            started_at=job.started_at or None,
            finished_at=job.finished_at or None,
            links=links,
        )


class JobList(BaseModel):
    jobs: list[JobView]
    next_cursor: str | None = Field(description="Pass as ?cursor= for the next page; null on the last page.")


class ModelView(BaseModel):
    name: str
    description: str
    kind: Literal["two-stage", "single-stage"] = Field(
        description="two-stage: AR + decoder workers; single-stage: speech workers."
    )
    sample_rate: int
    voices: list[str] = Field(description="Voice ids a job may name.")
    variants: list[str] = Field(
        default_factory=list, description="Single-stage models: a voice may be '<voice>+<variant>'."
    )
    default_voice: str
    default: bool
    rate: dict[str, int] | None = Field(
        default=None, description="Speaking rate in words per minute: default, min, max (if settable)."
    )
    pitch: dict[str, int] | None = Field(
        default=None, description="Pitch: default, min, max; null where the model has no pitch setting."
    )
    ready: bool = Field(description="Every worker kind this model needs has a live worker right now.")
    workers: dict[str, int] = Field(description="Live workers per kind this model needs.")

    @classmethod
    def of(cls, spec: ModelSpec, settings: Settings, live: dict[tuple[str, str], int]) -> ModelView:
        family = spec.family
        workers = {kind: live[(kind, spec.name)] for kind in spec.worker_kinds}
        view = dict(
            name=spec.name,
            description=spec.description,
            kind="single-stage" if spec.single_stage else "two-stage",
            sample_rate=family.sample_rate,
            voices=list(family.voices),
            default_voice=family.default_voice,
            default=spec.name == settings.default_model,
            ready=all(workers.values()),
            workers=workers,
        )
        if spec.single_stage:
            view.update(
                variants=list(family.variants),
                rate=dict(default=family.default_rate, min=family.rate_range[0], max=family.rate_range[1]),
                pitch=dict(
                    default=family.default_pitch, min=family.pitch_range[0], max=family.pitch_range[1]
                )
                if family.has_pitch
                else None,
            )
        return cls(**view)


class Problem(BaseModel):
    detail: str
