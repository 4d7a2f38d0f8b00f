"""Accepting a job (validate the request, plan its segments, store it, enqueue its tasks) and deleting one.

Shared by the HTTP API and the ``narrate file`` command, so both accept and refuse the same things.
Validation happens entirely before anything is written: a refused request leaves no trace.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
import uuid
from dataclasses import dataclass

from fleet.messages import SegmentTask
from fleet.settings import Settings
from fleet.storage import Storage
from jobs.audio import FORMATS, SAMPLE_RATES
from jobs.errors import InvalidRequest, JobNotFound, TooLarge
from jobs.finalize import delete_outputs, forget_finalize
from jobs.model import Job, JobStatus
from jobs.segmentation import Plan, Segment, plan_text
from jobs.store import JobStore
from models.registry import UnknownModelError, get_model


@dataclass(frozen=True)
class JobRequest:
    text: str
    title: str | None = None
    voice: str | None = None
    model: str | None = None
    format: str = "wav"
    sample_rate: int | None = None
    seed: int = 0
    markdown: bool = True
    #: Speaking rate (words per minute) and pitch (0-100): single-stage models only; None: default.
    rate: int | None = None
    pitch: int | None = None


def segment_seed(job_seed: int, voice: str, text: str) -> int:
    """The sampling seed of a segment: the same sentence in the same voice sounds the same anywhere,
    and a retried segment reproduces its codes."""
    digest = hashlib.blake2b(f"{job_seed}\x1f{voice}\x1f{text}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") & 0x7FFF_FFFF


def validate(request: JobRequest, settings: Settings) -> tuple[Job, Plan]:
    if not request.text or not request.text.strip():
        raise InvalidRequest("text is empty: send the text to narrate")
    if len(request.text) > settings.max_text_chars:
        raise TooLarge(
            f"text has {len(request.text):,} characters; this fleet accepts at most {settings.max_text_chars:,}"
        )
    try:
        spec = get_model(request.model or settings.default_model, settings)
    except UnknownModelError as exc:
        raise InvalidRequest(str(exc)) from exc
    family = spec.family
    voice = request.voice or family.default_voice
    speech_rate, pitch = _prosody(spec, request)
    if spec.single_stage:
        if problem := family.voice_problem(voice):
            raise InvalidRequest(f"{problem} (model {spec.name!r})")
    elif voice not in family.voices:
        raise InvalidRequest(
            f"unknown voice {voice!r} for model {spec.name!r}; voices: {', '.join(family.voices)}"
        )
    fmt = request.format.lower()
    if fmt not in FORMATS:
        raise InvalidRequest(f"unsupported format {request.format!r}; supported: {', '.join(FORMATS)}")
    rate = request.sample_rate or family.sample_rate
    if rate not in SAMPLE_RATES:
        raise InvalidRequest(
            f"unsupported sample rate {rate}; supported: {', '.join(map(str, SAMPLE_RATES))}"
        )
    plan = plan_text(request.text, markdown=request.markdown, max_chars=settings.max_segment_chars)
    if not plan.segments:
        raise InvalidRequest("text has nothing to narrate (only markup or code)")
    job = Job(
        id=uuid.uuid4().hex,
        status=JobStatus.QUEUED,
        model=spec.name,
        voice=voice,
        format=fmt,
        sample_rate=rate,
        seed=request.seed,
        title=(request.title or (plan.chapters[0].title if plan.chapters else ""))[:500],
        text_chars=len(request.text),
        segments_total=len(plan.segments),
        chapters=len(plan.chapters),
        created_at=time.time(),
        rate=speech_rate,
        pitch=pitch,
    )
    return job, plan


def _prosody(spec, request: JobRequest) -> tuple[int, int]:
    """The job's (rate, pitch): the single-stage family's defaults, or (0, 0) for a model without them."""
    if not spec.single_stage:
        if request.rate is not None or request.pitch is not None:
            raise InvalidRequest(f"model {spec.name!r} has no rate or pitch settings")
        return 0, 0
    family = spec.family
    rate = family.default_rate if request.rate is None else request.rate
    pitch = family.default_pitch if request.pitch is None else request.pitch
    if problem := family.prosody_problem(rate, pitch):
        raise InvalidRequest(problem)
    return rate, pitch


def segment_task(job: Job, segment: Segment, retry: int = 0) -> SegmentTask:
    return SegmentTask(
        job_id=job.id,
        segment=segment.index,
        text=segment.text,
        model=job.model,
        voice=job.voice,
        seed=segment_seed(job.seed, job.voice, segment.text),
        rate=job.rate,
        pitch=job.pitch,
        retry=retry,
    )


def tasks_for(job: Job, plan: Plan) -> list[SegmentTask]:
    return [segment_task(job, s) for s in plan.segments]


async def submit(store: JobStore, settings: Settings, request: JobRequest) -> Job:
    job, plan = validate(request, settings)
    await enqueue(store, job, plan)
    return job


async def enqueue(store: JobStore, job: Job, plan: Plan) -> None:
    """Store a validated job and queue its segments (all or nothing); it is created now."""
    job.created_at = time.time()
    await store.create(job, plan, tasks_for(job, plan))


async def get(store: JobStore, job_id: str) -> Job:
    """The job, or ``JobNotFound``."""
    job = await store.get(job_id)
    if job is None:
        raise JobNotFound(f"no job {job_id!r}")
    return job


async def delete(store: JobStore, storage: Storage, settings: Settings, job: Job, rq_connection=None) -> bool:
    """Release everything a job holds: a job still going is cancelled first (from then on every worker
    drops its work, and a worker caught mid-write removes what it wrote), then its objects leave
    storage, RQ forgets its finalize, and its keys leave Redis. Storage goes before the keys, so a
    failure part-way leaves the job visible and the DELETE can be repeated. Returns whether it cancelled.
    ``rq_connection``: RQ's Redis client (a sync one; default: a new client for the settings' Redis).
    """
    cancelled = await store.cancel(job.id)
    await asyncio.to_thread(delete_outputs, storage, job.id, job.format)
    await asyncio.to_thread(forget_finalize, settings, job.id, rq_connection)
    await store.purge(job.id)
    return cancelled
