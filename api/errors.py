"""The one table from domain errors to HTTP statuses, and the handlers that answer with it.

Every error body is ``{"detail": "..."}`` (``Problem`` in api/schemas.py)."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from jobs.errors import InvalidEventId, InvalidRequest, JobError, JobNotFound, NotReady, TooLarge

#: Domain error -> HTTP status; the most specific class of an error decides (its MRO).
STATUS: dict[type[JobError], int] = {
    TooLarge: 413,
    InvalidEventId: 400,
    InvalidRequest: 422,
    JobNotFound: 404,
    NotReady: 409,
}


def status_of(error: JobError) -> int:
    for cls in type(error).__mro__:
        if cls in STATUS:
            return STATUS[cls]
    return 400


def problem(status: int, detail: str) -> JSONResponse:
    return JSONResponse({"detail": detail}, status_code=status)


async def job_error(_: Request, exc: JobError) -> JSONResponse:
    return problem(status_of(exc), str(exc))


async def bad_body(_: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    if any(e.get("type") == "json_invalid" for e in errors):
        return problem(400, "the request body is not valid JSON")
    parts = []
    for e in errors:
        where = ".".join(str(p) for p in e.get("loc", ()) if p != "body")
        parts.append(f"{where or 'body'}: {e.get('msg')}")
    return problem(422, "; ".join(parts))


def install(app: FastAPI) -> None:
    app.add_exception_handler(JobError, job_error)
    app.add_exception_handler(RequestValidationError, bad_body)
