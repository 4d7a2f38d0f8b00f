"""Request and response bodies of the HTTP API (they make the OpenAPI document at /docs)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class JobCreate(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
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

    text: str = Field(description="The text to narrate: plain text or Markdown (headings start chapters).")
    title: str | None = Field(default=None, max_length=500)
    voice: str | None = Field(
        default=None, description="A voice of the model (GET /v1/models); default: the model's."
    )
    model: str | None = Field(
        default=None, description="A model this fleet serves; default: the fleet's default."
    )
    format: str = Field(default="wav", description="Output format: wav or flac.")
    sample_rate: int | None = Field(default=None, description="Output sample rate; default: the model's.")
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


class Links(BaseModel):
    self: str
    events: str
    audio: str


class JobAccepted(BaseModel):
    id: str
    status: str
    segments_total: int
    chapters: int
    links: Links


class JobView(BaseModel):
    id: str
    status: str
    title: str
    model: str
    voice: str
    format: str
    sample_rate: int
    rate: int | None = Field(
        default=None, description="Speaking rate (words per minute), if the model has one."
    )
    pitch: int | None = Field(default=None, description="Pitch (0-100), if the model has one.")
    segments_done: int
    segments_total: int
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
    pitch: dict[str, int] | None = Field(default=None, description="Pitch: default, min, max (if settable).")
    ready: bool = Field(description="Every worker kind this model needs has a live worker right now.")
    workers: dict[str, int] = Field(description="Live workers per kind this model needs.")


class Problem(BaseModel):
    detail: str
