"""The one table from domain errors to HTTP statuses, and the handlers that answer with it.

Every error body is ``{"detail": "..."}`` (``Problem`` in api/schemas.py), except under
``/v1/audio/`` (the OpenAI-compatible routes): there it is OpenAI's ``{"error": {"message", "type",
"param", "code"}}``, which its clients read."""

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
    NotDurable,
    NotReady,
    QuotaExceeded,
    TooLarge,
    UnsupportedFile,
)


class UnsupportedMediaType(Exception):
    """A body in a content type the route does not read (415)."""


class OpenAIError(Exception):
    """An error of an OpenAI-compatible route, with OpenAI's ``param`` and ``code``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


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
    NotDurable: 503,
}


def status_of(error: JobError) -> int:
    for cls in type(error).__mro__:
        if cls in STATUS:
            return STATUS[cls]
    return 400


#: OpenAI's error types by status.
_OPENAI_TYPES = {401: "invalid_request_error", 404: "invalid_request_error", 429: "rate_limit_exceeded"}
OPENAI_PREFIX = "/v1/audio/"


def problem(status: int, detail: str, request: Request | None = None, headers: dict | None = None) -> JSONResponse:
    if request is not None and request.url.path.startswith(OPENAI_PREFIX):
        return openai_problem(status, detail, headers=headers)
    return JSONResponse({"detail": detail}, status_code=status, headers=headers)


def openai_problem(
    status: int, message: str, param: str | None = None, code: str | None = None, headers: dict | None = None
) -> JSONResponse:
    # OpenAI answers a request it cannot take with 400 where this API says 422
    status = 400 if status == 422 else status
    kind = _OPENAI_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


async def openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
    return openai_problem(exc.status, str(exc), exc.param, exc.code)


async def job_error(request: Request, exc: JobError) -> JSONResponse:
    response = problem(status_of(exc), str(exc), request)
    if isinstance(exc, QuotaExceeded | NotDurable):
        response.headers["Retry-After"] = str(exc.retry_after_s)
    return response


async def bad_body(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    if any(e.get("type") == "json_invalid" for e in errors):
        return problem(400, "the request body is not valid JSON", request)
    parts = []
    for e in errors:
        where = ".".join(str(p) for p in e.get("loc", ()) if p != "body")
        parts.append(f"{where or 'body'}: {e.get('msg')}")
    return problem(422, "; ".join(parts), request)


async def unsupported_media(request: Request, exc: UnsupportedMediaType) -> JSONResponse:
    return problem(415, str(exc), request)


async def unauthorized(request: Request, exc: Unauthorized) -> JSONResponse:
    return problem(401, str(exc), request, headers={"WWW-Authenticate": 'Bearer realm="narrate"'})


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
        if methods:  # else a mounted app's answer (static files: its own Allow, GET and HEAD)
            headers["Allow"] = ", ".join(sorted(methods))
    return problem(exc.status_code, str(exc.detail), request, headers=headers)


def install(app: FastAPI) -> None:
    app.add_exception_handler(JobError, job_error)
    app.add_exception_handler(RequestValidationError, bad_body)
    app.add_exception_handler(UnsupportedMediaType, unsupported_media)
    app.add_exception_handler(Unauthorized, unauthorized)
    app.add_exception_handler(OpenAIError, openai_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
