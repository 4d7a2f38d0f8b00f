"""The one table from domain errors to HTTP statuses, and the handlers that answer with it.

Every error body is ``{"detail": "..."}`` (``Problem`` in api/schemas.py)."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from jobs.errors import (
    InvalidEventId,
    InvalidRequest,
    JobError,
    JobNotFound,
    NotReady,
    QuotaExceeded,
    TooLarge,
    UnsupportedFile,
)


class UnsupportedMediaType(Exception):
    """A body in a content type the route does not read (415)."""


class Unauthorized(Exception):
    """No key, a wrong or revoked key, or a link token that is not valid (401)."""


#: Domain error -> HTTP status; the most specific class of an error decides (its MRO).
STATUS: dict[type[JobError], int] = {
    QuotaExceeded: 429,
    TooLarge: 413,
    UnsupportedFile: 415,
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
    response = problem(status_of(exc), str(exc))
    if isinstance(exc, QuotaExceeded):
        response.headers["Retry-After"] = str(exc.retry_after_s)
    return response


async def bad_body(_: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    if any(e.get("type") == "json_invalid" for e in errors):
        return problem(400, "the request body is not valid JSON")
    parts = []
    for e in errors:
        where = ".".join(str(p) for p in e.get("loc", ()) if p != "body")
        parts.append(f"{where or 'body'}: {e.get('msg')}")
    return problem(422, "; ".join(parts))


async def unsupported_media(_: Request, exc: UnsupportedMediaType) -> JSONResponse:
    return problem(415, str(exc))


async def unauthorized(_: Request, exc: Unauthorized) -> JSONResponse:
    response = problem(401, str(exc))
    response.headers["WWW-Authenticate"] = 'Bearer realm="narrate"'
    return response


async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Starlette's own answers (404 of an unknown path, 405), with ``Allow`` listing every method the
    path has (Starlette names only those of the first route that matched it)."""
    headers = dict(exc.headers or {})
    if exc.status_code == 405:
        methods = set()
        for route in request.app.router.routes:
            match, _ = route.matches({**request.scope, "method": "GET"})
            if match != Match.NONE:
                methods |= set(getattr(route, "methods", None) or ())
        headers["Allow"] = ", ".join(sorted(methods))
    return JSONResponse({"detail": str(exc.detail)}, status_code=exc.status_code, headers=headers)


def install(app: FastAPI) -> None:
    app.add_exception_handler(JobError, job_error)
    app.add_exception_handler(RequestValidationError, bad_body)
    app.add_exception_handler(UnsupportedMediaType, unsupported_media)
    app.add_exception_handler(Unauthorized, unauthorized)
    app.add_exception_handler(StarletteHTTPException, http_error)
