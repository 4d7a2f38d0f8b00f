"""The HTTP API: submit jobs, follow them over server-sent events, download the result.

Thin by design: routes validate, enqueue (through jobs.service), read job state and stream events.
The app never runs a model. Connections are owned by the app's lifespan.
"""

from __future__ import annotations

import json
import re
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Header, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, RedirectResponse
from sse_starlette import EventSourceResponse

from api.schemas import JobAccepted, JobCreate, JobView, Links, ModelView, Problem
from fleet.readiness import live_counts
from fleet.redis import async_client
from fleet.settings import Settings
from fleet.storage import Storage, storage_from_settings
from jobs.audio import FORMATS
from jobs.model import Job, JobStatus
from jobs.service import InvalidRequest, JobRequest, delete, submit
from jobs.store import JobStore
from models.registry import ModelSpec, served_models

_EVENT_ID = re.compile(r"^\d+-\d+$")


class NotFound(Exception):
    pass


class Conflict(Exception):
    pass


@dataclass
class AppState:
    settings: Settings
    store: JobStore
    storage: Storage


def _links(job_id: str) -> Links:
    base = f"/v1/jobs/{job_id}"
    return Links(self=base, events=f"{base}/events", audio=f"{base}/audio")


def _model_view(spec: ModelSpec, settings: Settings, live: dict[tuple[str, str], int]) -> ModelView:
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
            pitch=dict(default=family.default_pitch, min=family.pitch_range[0], max=family.pitch_range[1]),
        )
    return ModelView(**view)


def _view(job: Job) -> JobView:
    return JobView(
        id=job.id,
        status=job.status.value,
        title=job.title,
        model=job.model,
        voice=job.voice,
        format=job.format,
        sample_rate=job.sample_rate,
        rate=job.rate or None,
        pitch=job.pitch if job.rate else None,
        segments_done=job.segments_done,
        segments_total=job.segments_total,
        segments_flagged=job.segments_flagged,
        chapters=job.chapters,
        audio_seconds=round(job.audio_seconds, 3),
        duration_s=job.duration_s if job.status == JobStatus.DONE else None,
        eta_s=job.eta_s(time.time()),
        error=job.error or None,
        created_at=job.created_at,
        started_at=job.started_at or None,
        finished_at=job.finished_at or None,
        links=_links(job.id),
    )


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        redis = async_client(settings)
        store = JobStore.for_settings(redis, settings)
        app.state.fleet = AppState(settings, store, storage_from_settings(settings))
        try:
            yield
        finally:
            await redis.aclose()

    app = FastAPI(
        title="Narration fleet",
        version="0.1.0",
        description="Long texts in, audiobooks out. Submit a job, follow it over SSE, download the file.",
        lifespan=lifespan,
    )
    _install_error_handlers(app)

    def state(request: Request) -> AppState:
        return request.app.state.fleet

    async def existing(request: Request, job_id: str) -> Job:
        job = await state(request).store.get(job_id)
        if job is None:
            raise NotFound(f"no job {job_id!r}")
        return job

    @app.get("/health")
    async def health(request: Request) -> dict:
        await state(request).store.redis.ping()
        return {"status": "ok"}

    @app.get("/v1/models", response_model=list[ModelView])
    async def list_models(request: Request) -> list[ModelView]:
        st = state(request)
        specs = list(served_models(st.settings).values())
        wanted = [(kind, spec.name) for spec in specs for kind in spec.worker_kinds]
        live = await live_counts(st.store.redis, st.store.names, wanted, st.settings.heartbeat_s)
        return [_model_view(spec, st.settings, live) for spec in specs]

    @app.post(
        "/v1/jobs",
        status_code=202,
        response_model=JobAccepted,
        responses={413: {"model": Problem}, 422: {"model": Problem}},
    )
    async def create_job(body: JobCreate, request: Request) -> JobAccepted:
        st = state(request)
        job_request = JobRequest(
            text=body.text,
            title=body.title,
            voice=body.voice,
            model=body.model,
            format=body.format,
            sample_rate=body.sample_rate,
            seed=body.seed,
            markdown=body.text_format == "markdown",
            rate=body.rate,
            pitch=body.pitch,
        )
        job = await submit(st.store, st.settings, job_request)
        return JobAccepted(
            id=job.id,
            status=job.status.value,
            segments_total=job.segments_total,
            chapters=job.chapters,
            links=_links(job.id),
        )

    @app.get("/v1/jobs/{job_id}", response_model=JobView, responses={404: {"model": Problem}})
    async def get_job(job_id: str, request: Request) -> JobView:
        return _view(await existing(request, job_id))

    @app.delete("/v1/jobs/{job_id}", response_model=JobView, responses={404: {"model": Problem}})
    async def delete_job(job_id: str, request: Request) -> JSONResponse:
        """Cancel the job if it is still going, then delete it: its keys, its file, its parts. Answers
        the job's last state: 202 if it was cancelled (workers let go of it within moments), 200 if
        it had already ended. Afterwards the job is unknown (404)."""
        st = state(request)
        job = await existing(request, job_id)
        if await delete(st.store, st.storage, st.settings, job):
            job.status, job.finished_at = JobStatus.CANCELLED, time.time()
            return JSONResponse(_view(job).model_dump(), status_code=202)
        return JSONResponse(_view(job).model_dump(), status_code=200)

    @app.get("/v1/jobs/{job_id}/audio", responses={404: {"model": Problem}, 409: {"model": Problem}, 307: {}})
    async def get_audio(job_id: str, request: Request):
        job = await existing(request, job_id)
        if job.status != JobStatus.DONE:
            raise Conflict(f"job {job_id} is {job.status.value}; its audio exists once it is done")
        storage = state(request).storage
        filename = f"{_safe_name(job.title) or job.id}.{job.format}"
        url = storage.presigned_url(job.audio_key, filename)
        if url is not None:
            return RedirectResponse(url, status_code=307)
        path = storage.local_path(job.audio_key)
        if path is None:
            raise NotFound(f"the audio of job {job_id} is no longer stored")
        return FileResponse(path, media_type=FORMATS[job.format][2], filename=filename)

    @app.get("/v1/jobs/{job_id}/events", responses={404: {"model": Problem}, 400: {"model": Problem}})
    async def job_events(
        job_id: str,
        request: Request,
        last_event_id: str | None = Header(
            default=None, description="Resume after this event id (sent by browsers)."
        ),
        after: str | None = Query(
            default=None, description="Resume after this event id (for clients without headers)."
        ),
    ) -> EventSourceResponse:
        await existing(request, job_id)
        resume = last_event_id or after or "0-0"
        if not _EVENT_ID.match(resume):
            raise InvalidRequest(f"Last-Event-ID {resume!r} is not an event id of this API", 400)
        st = state(request)
        return EventSourceResponse(_event_stream(st.store, job_id, resume), ping=st.settings.sse_ping_s)

    return app


async def _event_stream(store: JobStore, job_id: str, after: str):
    """Events after ``after`` until a terminal one; the stream entry id is each event's SSE id."""
    while True:
        try:
            events = await store.read_events(job_id, after, block_ms=5000)
        except Exception as exc:  # noqa: BLE001 - end the stream with an error event, never hang
            yield {"event": "error", "data": json.dumps({"error": f"event stream failed: {exc}"})}
            return
        for event in events:
            yield {"id": event.id, "event": event.type.value, "data": json.dumps(event.data)}
            after = event.id
            if event.type.terminal:
                return
        if not events:
            status = await store.status(job_id)
            if status is None or status.terminal:  # nothing more will come
                return


def _safe_name(title: str) -> str:
    return re.sub(r"[^\w.-]+", "_", title).strip("._")[:80]


def _install_error_handlers(app: FastAPI) -> None:
    def problem(status: int, detail: str) -> JSONResponse:
        return JSONResponse({"detail": detail}, status_code=status)

    @app.exception_handler(InvalidRequest)
    async def invalid(_: Request, exc: InvalidRequest) -> JSONResponse:
        return problem(exc.status, str(exc))

    @app.exception_handler(NotFound)
    async def not_found(_: Request, exc: NotFound) -> JSONResponse:
        return problem(404, str(exc))

    @app.exception_handler(Conflict)
    async def conflict(_: Request, exc: Conflict) -> JSONResponse:
        return problem(409, str(exc))

    @app.exception_handler(RequestValidationError)
    async def bad_body(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        if any(e.get("type") == "json_invalid" for e in errors):
            return problem(400, "the request body is not valid JSON")
        parts = []
        for e in errors:
            where = ".".join(str(p) for p in e.get("loc", ()) if p != "body")
            parts.append(f"{where or 'body'}: {e.get('msg')}")
        return problem(422, "; ".join(parts))
