"""The HTTP API's routes: validate, call the job service, read job state, stream events.

Module-level routes on one router (Starlette's shape); their state comes from ``app_state``, who they
act for from ``caller`` (a key) or ``caller_or_link`` (a key or a signed link), their errors from the
domain (jobs/errors.py), which api/errors.py maps to statuses. Another tenant's job is a 404 on
every route.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from dataclasses import dataclass
from typing import Literal

from fastapi import APIRouter, Depends, Header, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, RedirectResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from sse_starlette import EventSourceResponse
from starlette.datastructures import UploadFile as StarletteUploadFile

from api.auth import caller, caller_or_link
from api.limits import media_type, require_job_body
from api.schemas import (
    BookContents,
    BookSource,
    JobAccepted,
    JobCreate,
    JobList,
    JobView,
    LexiconBody,
    LexiconView,
    Links,
    ModelView,
    Problem,
    job_form_schema,
)
from api.sse import check_resume, event_stream, resume_point
from api.state import AppState, app_state
from fleet.readiness import live_counts
from fleet.storage import StorageError
from jobs import captions, service
from jobs.audio import Pauses, chapter_file_name
from jobs.books import Book
from jobs.encoding import format_named
from jobs.errors import InvalidRequest, JobNotFound, LexiconNotFound, NotReady
from jobs.finalize import enqueue_finalize
from jobs.idempotency import Idempotency
from jobs.lexicon import NAME as LEXICON_NAME
from jobs.lexicon import dumps as lexicon_dumps
from jobs.lexicon import entries_from
from jobs.live import LiveAudio
from jobs.live import encoded as live_encoded
from jobs.model import Job, JobStatus
from jobs.progressive import STREAM_FORMATS
from jobs.tenants import Principal
from jobs.uploads import Upload, read_upload
from models.registry import MODELS, served_models

router = APIRouter()
#: The job body's schema, for the OpenAPI document (the route parses the body itself, in a thread).
JOB_CREATE = JobCreate.model_json_schema(ref_template="#/components/schemas/{model}")
JOB_FORM = job_form_schema()

#: What GET /v1/jobs/{id}/stream offers: what browsers play as it arrives.
LIVE_FORMATS = ("mp3", "opus")

State = Depends(app_state)
Caller = Depends(caller)
#: Statuses a route may answer with when the caller is refused (documented on every route).
AUTH = {401: {"model": Problem}, 429: {"model": Problem}}


def get_and_head(path: str, **options):
    """GET and HEAD on ``path`` as two routes, so each has an operationId of its own. One route of both
    methods gave the OpenAPI document one id twice, named after whichever method its set listed
    first: ``..._get`` in one process, ``..._head`` in the next, which breaks generated clients."""

    def register(endpoint):
        router.get(path, **options)(endpoint)
        return router.head(path, **options)(endpoint)

    return register


def links(st: AppState, job: Job) -> Links:
    return Links.of(job.id, {kind: st.signer.token(job.id, kind) for kind in ("events", "audio")})


@get_and_head("/health")
async def health(st: AppState = State) -> dict:
    await st.store.redis.ping()
    return {"status": "ok"}


@get_and_head("/v1/models", response_model=list[ModelView], responses=AUTH)
async def list_models(st: AppState = State, _: Principal = Caller) -> list[ModelView]:
    specs = list(served_models(st.settings).values())
    wanted = [(kind, spec.name) for spec in specs for kind in spec.worker_kinds]
    live = await live_counts(st.store.redis, st.store.names, wanted, st.settings.heartbeat_s)
    return [ModelView.of(spec, st.settings, live) for spec in specs]


def _parse_body(raw: bytes, model: type[BaseModel], fields: dict | None = None):
    """The body as ``model``: JSON ``raw``, or the form ``fields`` of a multipart request (their
    strings converted to the fields' types: "128" is 128 there, as forms cannot say otherwise)."""
    context = None
    if fields is not None:
        data, strict, context = fields, False, {"file_part": True}
    else:
        try:  # Python's parser: it keeps a lone surrogate (valid JSON), so validation can say what it is
            data, strict = json.loads(raw), None
        except (ValueError, UnicodeDecodeError, RecursionError):  # (nested past the parser's depth)
            raise RequestValidationError(
                [{"type": "json_invalid", "loc": ("body",), "msg": "invalid JSON"}]
            ) from None
    try:
        return model.model_validate(data, strict=strict, context=context)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors(include_url=False, include_input=False)) from None


def read_job(body: JobCreate, form: FormBody | None, named, tenant: str, settings, max_text_chars: int):
    """The body as a job and its plan: reading an uploaded book, validation and segmentation,
    which for a whole book take long enough that they run in a thread, never on the event loop."""
    request = body.to_request(tenant, settings, form.upload if form else None, named)
    job, plan = service.validate(request, settings, max_text_chars)
    return job, plan, request.cover, service.encode(job, plan, settings.longest_first_window)


@dataclass(frozen=True)
class FormBody:
    """A multipart/form-data body: its file part and its other fields."""

    upload: Upload | None
    fields: dict


#: Fields a form may repeat (or give comma-separated): they are lists.
_LIST_FIELDS = frozenset({"chapters", "lexicons"})
_NUMBER = re.compile(r"[0-9]{1,9}")  # str.isdigit() takes "²", and int() of 5,000 digits raises


async def _read_form(request: Request, settings) -> FormBody:
    """The form of a multipart body: one file part ("file") and fields named like the JSON body's."""
    form = await request.form(max_files=1, max_fields=100, max_part_size=1024 * 1024)  # unreadable: a 400
    upload, fields = None, {}
    try:
        for key, value in form.multi_items():
            if isinstance(value, StarletteUploadFile):
                if key != "file":
                    raise InvalidRequest(f"the file part is named {key[:40]!r}; name it 'file'")
                upload = Upload(await value.read(), value.filename or "", "", value.content_type or "")
            elif key == "lexicon":  # a JSON list in a form field
                try:
                    fields[key] = json.loads(value)
                except (ValueError, RecursionError):
                    raise InvalidRequest("lexicon: a JSON list of entries") from None
            elif key in _LIST_FIELDS:
                items = [v.strip() for v in value.split(",") if v.strip()]
                # chapters by number or title; a lexicon's name is a name even if all digits ("2024")
                number = key == "chapters"
                fields.setdefault(key, []).extend(int(v) if number and _NUMBER.fullmatch(v) else v for v in items)
            else:
                fields[key] = value
    finally:
        await form.close()
    if upload is None:
        raise InvalidRequest("a multipart/form-data job needs a file part named 'file' (an EPUB, .txt or .md)")
    if "text" in fields or "source" in fields:
        raise InvalidRequest("a multipart/form-data job is its file: send text or source as JSON instead")
    return FormBody(upload, fields)


@router.post(
    "/v1/jobs",
    status_code=202,
    response_model=JobAccepted,
    responses={
        **AUTH,
        400: {"model": Problem},
        413: {"model": Problem},
        415: {"model": Problem},
        422: {"model": Problem},
        503: {"model": Problem, "description": "No Redis replica acknowledged the job in time (durable_replicas): nothing kept, try again."},
    },
    dependencies=[Depends(require_job_body)],
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {"schema": JOB_CREATE},
                "multipart/form-data": {"schema": JOB_FORM},
            },
        }
    },
)
async def create_job(
    request: Request,
    st: AppState = State,
    who: Principal = Caller,
    idempotency_key: str | None = Header(
        default=None, description="Retrying with the same key returns the same job (24 h); another body: 422."
    ),
) -> JobAccepted:
    limits = await st.limits(who.tenant)
    raw = await request.body()
    form = await _read_form(request, st.settings) if media_type(request) == "multipart/form-data" else None
    body = await asyncio.to_thread(_parse_body, raw, JobCreate, form.fields if form else None)
    named = await st.lexicons.resolve(who.tenant, body.lexicons) if body.lexicons else []
    job, plan, cover, encoded = await asyncio.to_thread(
        read_job, body, form, named, who.tenant, st.settings, limits.max_text_chars
    )
    claim = None
    if idempotency_key is not None:
        claim = Idempotency(st.store.redis, st.store.names, who.tenant, idempotency_key, _fingerprint(body, form))
        if (earlier := await claim.claim()) is not None:
            return JobAccepted.of(existing := await service.get(st.store, earlier, who), links(st, existing))
    try:
        await submit(st, job, plan, cover, encoded, limits)
    except BaseException:
        if claim is not None:
            await claim.release()
        raise
    if claim is not None:
        await claim.bind(job.id)
    return JobAccepted.of(job, links(st, job))


def _fingerprint(body: JobCreate, form: FormBody | None) -> bytes:
    """What makes a retry the same request: the body as read, not its bytes (a form's boundary is
    new on every try; JSON's key order and spaces say nothing), and the file."""
    parts = [body.model_dump_json().encode()]
    if form is not None and form.upload is not None:
        parts += [form.upload.name.encode(), form.upload.data]
    return b"\0".join(parts)


async def submit(st: AppState, job: Job, plan, cover, encoded, limits) -> None:
    """1) a job slot, 2) the day's characters (a refused job spends none), 3) store and queue; what
    was taken is given back if a step fails (``enqueue`` fails only if the job was not stored)."""
    counted = False
    try:
        await service.reserve_slot(st.store, job, limits.concurrent_jobs)
        await st.quotas.characters(job.tenant, limits.chars_per_day, job.text_chars)
        counted = True
        await service.store_cover(st.storage, job, cover)
        reuse = service.Reuse(st.cache, lambda job_id: asyncio.to_thread(enqueue_finalize, st.settings, job_id, st.rq))
        await service.enqueue(st.store, job, plan, weight=limits.weight, encoded=encoded, reuse=reuse)
    except BaseException:
        await st.store.release_job_slot(job.tenant, job.id)
        if counted:  # "try again" (a 503) must not spend the day's budget
            await st.quotas.give_back_characters(job.tenant, limits.chars_per_day, job.text_chars)
        if job.cover:
            await asyncio.to_thread(st.storage.delete_prefix, job.objects.outputs_prefix)
        raise


def _read_contents(raw: bytes, form: FormBody | None, settings) -> BookContents:
    if form is not None:
        upload = form.upload
        alt_text = str(form.fields.get("alt_text", "")).lower() in ("1", "true", "yes", "on")
    else:
        body = _parse_body(raw, BookSource)
        upload, alt_text = body.source.upload(), body.alt_text
    read = read_upload(upload, settings, alt_text=alt_text)
    if not isinstance(read, Book):
        raise InvalidRequest("only a book (an EPUB) has contents to list; a text file is narrated whole")
    return BookContents.of(read)


@router.post(
    "/v1/books/contents",
    response_model=BookContents,
    responses={**AUTH, 400: {"model": Problem}, 413: {"model": Problem}, 415: {"model": Problem}, 422: {"model": Problem}},
    dependencies=[Depends(require_job_body)],
)
async def book_contents(request: Request, st: AppState = State, _: Principal = Caller) -> BookContents:
    """What a job would read of an EPUB: its metadata and chapters, numbered as a job's ``chapters``
    selection takes them, each saying whether it is narrated by default. Nothing is stored."""
    raw = await request.body()
    form = await _read_form(request, st.settings) if media_type(request) == "multipart/form-data" else None
    return await asyncio.to_thread(_read_contents, raw, form, st.settings)


def _lexicon_name(name: str) -> str:
    if not LEXICON_NAME.match(name):
        raise InvalidRequest(f"lexicon name {name[:70]!r}: 1-63 of a-z, 0-9, - and _, starting with a letter or digit")
    return name


@router.put(
    "/v1/lexicons/{name}",
    response_model=LexiconView,
    responses={**AUTH, 201: {"model": LexiconView}, 422: {"model": Problem}},
)
async def put_lexicon(name: str, body: LexiconBody, st: AppState = State, who: Principal = Caller) -> JSONResponse:
    """Create or replace one of the tenant's lexicons (201 when new)."""
    entries = entries_from(body.entries, f"lexicon {_lexicon_name(name)!r}")
    created = await st.lexicons.put(who.tenant, name, entries)
    view = LexiconView(name=name, entries=json.loads(lexicon_dumps(entries)))
    return JSONResponse(view.model_dump(), status_code=201 if created else 200)


@get_and_head("/v1/lexicons/{name}", response_model=LexiconView, responses={**AUTH, 404: {"model": Problem}})
async def get_lexicon(name: str, st: AppState = State, who: Principal = Caller) -> LexiconView:
    entries = await st.lexicons.get(who.tenant, _lexicon_name(name))
    if entries is None:
        raise LexiconNotFound(f"no lexicon {name!r}")
    return LexiconView(name=name, entries=json.loads(lexicon_dumps(entries)))


@router.delete("/v1/lexicons/{name}", status_code=204, responses={**AUTH, 404: {"model": Problem}})
async def delete_lexicon(name: str, st: AppState = State, who: Principal = Caller) -> Response:
    if not await st.lexicons.delete(who.tenant, _lexicon_name(name)):
        raise LexiconNotFound(f"no lexicon {name!r}")
    return Response(status_code=204)


@get_and_head("/v1/lexicons", responses=AUTH)
async def list_lexicons(st: AppState = State, who: Principal = Caller) -> dict:
    """The tenant's lexicons and their sizes."""
    return {"lexicons": [{"name": n, "entries": c} for n, c in (await st.lexicons.names_and_sizes(who.tenant)).items()]}


@get_and_head("/v1/jobs", response_model=JobList, responses=AUTH)
async def list_jobs(
    st: AppState = State,
    who: Principal = Caller,
    status: JobStatus | None = Query(default=None, description="Only jobs in this state."),
    cursor: str | None = Query(default=None, max_length=200, description="next_cursor of the previous page."),
    limit: int = Query(default=50, ge=1, le=500),
    tenant: str | None = Query(default=None, max_length=63, description="Admin keys: one tenant's jobs."),
) -> JobList:
    page = await service.list_jobs(st.store, who, status=status, tenant=tenant, cursor=cursor, limit=limit)
    return JobList(jobs=[JobView.of(job, links(st, job)) for job in page.jobs], next_cursor=page.next_cursor)


@get_and_head(
    "/v1/jobs/{job_id}",
    response_model=JobView,
    responses={**AUTH, 404: {"model": Problem}},
)
async def get_job(job_id: str, st: AppState = State, who: Principal = Caller) -> JobView:
    job = await service.get(st.store, job_id, who)
    return JobView.of(job, links(st, job), await service.place(st.store, job))


@router.delete("/v1/jobs/{job_id}", response_model=JobView, responses={**AUTH, 404: {"model": Problem}})
async def delete_job(job_id: str, st: AppState = State, who: Principal = Caller) -> JSONResponse:
    """Cancel the job if it is still going, then delete it: its keys, its file, its parts. Answers
    the job's last state: 202 if it was cancelled (workers let go of it within moments), 200 if it
    had already ended. Afterwards the job is unknown (404)."""
    job = await service.get(st.store, job_id, who)
    status = 200
    if await service.delete(st.store, st.storage, st.settings, job, st.rq):
        job.status, job.finished_at, status = JobStatus.CANCELLED, time.time(), 202
    return JSONResponse(JobView.of(job, Links.of(job.id)).model_dump(), status_code=status)


@get_and_head(
    "/v1/jobs/{job_id}/audio",
    responses={**AUTH, 404: {"model": Problem}, 409: {"model": Problem}, 307: {}},
)
async def get_audio(
    job_id: str,
    st: AppState = State,
    who: Principal = Depends(caller_or_link("audio")),
    chapter: int | None = Query(
        default=None, description="One chapter's file, 1 to the job's chapters (jobs with chapter_files)."
    ),
    chapters: Literal["zip"] | None = Query(
        default=None, description="zip: every chapter's file in one zip (jobs with chapter_files)."
    ),
):
    """The finished file (or one chapter's, or a zip of them): a redirect to a presigned URL, or the file."""
    job = await service.get(st.store, job_id, who)
    if job.status != JobStatus.DONE:
        raise NotReady(f"job {job_id} is {job.status.value}; its audio exists once it is done")
    name = _safe_name(job.title) or job.id
    key, filename, media_type = job.audio_key, f"{name}.{job.format}", format_named(job.format).content_type
    if chapter is not None or chapters is not None:
        if not job.chapter_files:
            raise InvalidRequest(f"job {job_id} has no chapter files: submit it with chapter_files: true")
        if chapters is not None:
            key, filename, media_type = job.objects.chapters_zip, f"{name}.zip", "application/zip"
        elif not 1 <= chapter <= job.chapters:
            raise InvalidRequest(f"chapter {chapter} is out of range: this book has chapters 1 to {job.chapters}")
        else:
            file_name = chapter_file_name(chapter, format_named(job.format))
            key, filename = job.objects.chapter(file_name), f"{name} - {file_name}"
    url = st.storage.presigned_url(key, filename)
    if url is not None:
        return RedirectResponse(url, status_code=307)
    path = st.storage.local_path(key)
    if path is None or not path.exists():
        raise JobNotFound(f"the audio of job {job_id} is no longer stored")
    return FileResponse(path, media_type=media_type, filename=filename)


async def _manifest(st: AppState, job_id: str, who: Principal) -> dict:
    """A finished job's manifest (chapters, sentence times), or why there is none."""
    job = await service.get(st.store, job_id, who)
    if job.status != JobStatus.DONE:
        raise NotReady(f"job {job_id} is {job.status.value}; its captions exist once it is done")
    try:
        raw = await asyncio.to_thread(st.storage.get_bytes, job.objects.manifest)
    except StorageError as exc:
        raise JobNotFound(f"the manifest of job {job_id} is no longer stored") from exc
    return json.loads(raw)


@get_and_head(
    "/v1/jobs/{job_id}/captions",
    responses={**AUTH, 404: {"model": Problem}, 409: {"model": Problem}, 422: {"model": Problem}},
)
async def get_captions(
    job_id: str,
    st: AppState = State,
    who: Principal = Depends(caller_or_link("audio")),
    format: Literal["vtt", "srt"] = Query(default="vtt", description="WebVTT or SubRip."),
    kind: Literal["sentences", "chapters"] = Query(
        default="sentences", description="A cue per sentence, or (WebVTT) per chapter: a chapters track."
    ),
) -> Response:
    """Subtitles of the finished file: one cue per sentence, its text and exact times."""
    if kind == "chapters" and format != "vtt":
        raise InvalidRequest("a chapters track is WebVTT: ask format=vtt with kind=chapters")
    manifest = await _manifest(st, job_id, who)
    if format == "srt":
        return Response(captions.srt(manifest), media_type="application/x-subrip; charset=utf-8")
    return Response(captions.vtt(manifest, kind), media_type="text/vtt; charset=utf-8")


@get_and_head(
    "/v1/jobs/{job_id}/marks",
    responses={**AUTH, 404: {"model": Problem}, 409: {"model": Problem}},
)
async def get_marks(job_id: str, st: AppState = State, who: Principal = Depends(caller_or_link("audio"))):
    """Speech marks of the finished file (Amazon Polly's shape, JSON lines): one per sentence."""
    manifest = await _manifest(st, job_id, who)
    return Response(captions.speech_marks(manifest), media_type="application/x-ndjson")


@get_and_head(
    "/v1/jobs/{job_id}/events",
    responses={**AUTH, 404: {"model": Problem}, 400: {"model": Problem}},
)
async def job_events(
    job_id: str,
    request: Request,
    st: AppState = State,
    who: Principal = Depends(caller_or_link("events")),
    last_event_id: str | None = Header(
        default=None, description="Resume after this event id (sent by browsers)."
    ),
    after: str | None = Query(
        default=None, description="Resume after this event id (for clients without headers)."
    ),
) -> EventSourceResponse:
    await service.get(st.store, job_id, who)
    resume = resume_point(last_event_id, after)
    await check_resume(st.store, job_id, resume)
    if request.method == "HEAD":
        return Response(media_type="text/event-stream")
    return EventSourceResponse(event_stream(st.hub, job_id, resume), ping=st.settings.sse_ping_s)


@get_and_head(
    "/v1/jobs/{job_id}/stream",
    responses={
        **AUTH,
        200: {"content": {f.content_type: {} for f in STREAM_FORMATS.values() if f.name in LIVE_FORMATS}},
        404: {"model": Problem},
        409: {"model": Problem},
        422: {"model": Problem},
    },
)
async def stream_job(
    job_id: str,
    request: Request,
    st: AppState = State,
    who: Principal = Depends(caller_or_link("audio")),
    chapter: int = Query(default=1, description="Start at this chapter (from 1)."),
    format: Literal["mp3", "opus"] = Query(default="mp3", description="MP3, or Opus in Ogg."),
):
    """The job's audio while it renders, for an <audio> element: from the first decoded audio, in book
    order with its pauses; it waits (the player buffers) where rendering has not got to yet and ends
    with the job. A finished job streams from its file. Listeners of the same stream share one encode."""
    job = await service.get(st.store, job_id, who)
    if job.status in (JobStatus.FAILED, JobStatus.CANCELLED):
        raise NotReady(f"job {job_id} is {job.status.value}: it has no audio to stream")
    live = LiveAudio(
        st.store, st.storage, job, await st.store.plan(job_id), Pauses.of(st.settings),
        MODELS[job.model].family.sample_rate, st.settings.live_poll_s,
    )  # fmt: skip
    live.first_segment(chapter)  # a chapter out of range is refused before any byte
    fmt = STREAM_FORMATS[format]
    headers = {"Cache-Control": "no-store", "X-Accel-Buffering": "no"}
    if request.method == "HEAD":
        return Response(media_type=fmt.content_type, headers=headers)
    body = st.broadcasts.listen((job_id, chapter, format), lambda: live_encoded(live, fmt, chapter))
    return StreamingResponse(body, media_type=fmt.content_type, headers=headers)


def _safe_name(title: str) -> str:
    return re.sub(r"[^\w.-]+", "_", title).strip("._")[:80]
