"""The HTTP API's routes: validate, call the job service, read job state, stream events.

Module-level routes on one router (Starlette's shape); their state comes from ``app_state``, their
errors from the domain (jobs/errors.py), which api/errors.py maps to statuses.
"""

from __future__ import annotations

import re
import time

from fastapi import APIRouter, Depends, Header, Query
from fastapi.responses import FileResponse, JSONResponse, RedirectResponse
from sse_starlette import EventSourceResponse

from api.schemas import JobAccepted, JobCreate, JobView, ModelView, Problem
from api.sse import event_stream, resume_point
from api.state import AppState, app_state
from fleet.readiness import live_counts
from jobs import service
from jobs.audio import FORMATS
from jobs.errors import JobNotFound, NotReady
from jobs.model import JobStatus
from models.registry import served_models

router = APIRouter()

State = Depends(app_state)


@router.get("/health")
async def health(st: AppState = State) -> dict:
    await st.store.redis.ping()
    return {"status": "ok"}


@router.get("/v1/models", response_model=list[ModelView])
async def list_models(st: AppState = State) -> list[ModelView]:
    specs = list(served_models(st.settings).values())
    wanted = [(kind, spec.name) for spec in specs for kind in spec.worker_kinds]
    live = await live_counts(st.store.redis, st.store.names, wanted, st.settings.heartbeat_s)
    return [ModelView.of(spec, st.settings, live) for spec in specs]


@router.post(
    "/v1/jobs",
    status_code=202,
    response_model=JobAccepted,
    responses={413: {"model": Problem}, 422: {"model": Problem}},
)
async def create_job(body: JobCreate, st: AppState = State) -> JobAccepted:
    job = await service.submit(st.store, st.settings, body.to_request())
    return JobAccepted.of(job)


@router.get("/v1/jobs/{job_id}", response_model=JobView, responses={404: {"model": Problem}})
async def get_job(job_id: str, st: AppState = State) -> JobView:
    return JobView.of(await service.get(st.store, job_id))


@router.delete("/v1/jobs/{job_id}", response_model=JobView, responses={404: {"model": Problem}})
async def delete_job(job_id: str, st: AppState = State) -> JSONResponse:
    """Cancel the job if it is still going, then delete it: its keys, its file, its parts. Answers
    the job's last state: 202 if it was cancelled (workers let go of it within moments), 200 if it
    had already ended. Afterwards the job is unknown (404)."""
    job = await service.get(st.store, job_id)
    if await service.delete(st.store, st.storage, st.settings, job, st.rq):
        job.status, job.finished_at = JobStatus.CANCELLED, time.time()
        return JSONResponse(JobView.of(job).model_dump(), status_code=202)
    return JSONResponse(JobView.of(job).model_dump(), status_code=200)


@router.get("/v1/jobs/{job_id}/audio", responses={404: {"model": Problem}, 409: {"model": Problem}, 307: {}})
async def get_audio(job_id: str, st: AppState = State):
    job = await service.get(st.store, job_id)
    if job.status != JobStatus.DONE:
        raise NotReady(f"job {job_id} is {job.status.value}; its audio exists once it is done")
    filename = f"{_safe_name(job.title) or job.id}.{job.format}"
    url = st.storage.presigned_url(job.audio_key, filename)
    if url is not None:
        return RedirectResponse(url, status_code=307)
    path = st.storage.local_path(job.audio_key)
    if path is None:
        raise JobNotFound(f"the audio of job {job_id} is no longer stored")
    return FileResponse(path, media_type=FORMATS[job.format][2], filename=filename)


@router.get("/v1/jobs/{job_id}/events", responses={404: {"model": Problem}, 400: {"model": Problem}})
async def job_events(
    job_id: str,
    st: AppState = State,
    last_event_id: str | None = Header(
        default=None, description="Resume after this event id (sent by browsers)."
    ),
    after: str | None = Query(
        default=None, description="Resume after this event id (for clients without headers)."
    ),
) -> EventSourceResponse:
    await service.get(st.store, job_id)
    resume = resume_point(last_event_id, after)
    return EventSourceResponse(event_stream(st.store, job_id, resume), ping=st.settings.sse_ping_s)


def _safe_name(title: str) -> str:
    return re.sub(r"[^\w.-]+", "_", title).strip("._")[:80]
