"""What a client can send before it is refused: the body size, held while the body is read.

``BodyLimit`` is pure ASGI middleware: a request whose Content-Length is over the limit is answered
413 before any of its body is read; a chunked (or lying) body is counted as it arrives and answered
413 the moment it passes the limit, so the API never holds more than the limit of any body. Routes
that take a body also name the content types they accept (``require_job_body``: 415 otherwise).
"""

from __future__ import annotations

import json

from fastapi import Request

from api.errors import UnsupportedMediaType

#: JSON escapes a non-ASCII character in at most 6 bytes ("\\u00e9"; 12 for a surrogate pair).
JSON_BYTES_PER_CHAR = 6
#: Room for the rest of a job request (title, voice, options) besides its text.
ENVELOPE_BYTES = 64 * 1024


def max_body_bytes(max_text_chars: int, max_cover_bytes: int = 0, max_upload_bytes: int = 0) -> int:
    """The largest body a request of ``max_text_chars`` characters of text, or a file of
    ``max_upload_bytes`` (base64 in JSON), with a cover picture of ``max_cover_bytes`` (base64), can
    need."""
    content = max(max_text_chars * JSON_BYTES_PER_CHAR, -(-max_upload_bytes // 3) * 4)
    return content + -(-max_cover_bytes // 3) * 4 + ENVELOPE_BYTES


async def _refuse(send, status: int, detail: str, path: str = "") -> None:
    # the OpenAI-compatible routes answer in OpenAI's shape (api/errors.py)
    if path.startswith("/v1/audio/"):
        body = json.dumps({"error": {"message": detail, "type": "invalid_request_error", "param": None, "code": None}}).encode()
    else:
        body = json.dumps({"detail": detail}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send(
        {"type": "http.response.start", "status": status, "headers": headers + [(b"connection", b"close")]}
    )
    await send({"type": "http.response.body", "body": body})


class BodyLimit:
    def __init__(self, app, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "DELETE", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        too_large = f"the request body is over {self.max_bytes:,} bytes, the most this API reads"
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None:
            if not length.isdigit():
                await _refuse(send, 400, "Content-Length is not a number", scope["path"])
                return
            if int(length) > self.max_bytes:
                await _refuse(send, 413, too_large, scope["path"])
                return
        # 1) read the body, counting; 2) hand it to the app as one message
        chunks: list[bytes] = []
        size, more = 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await _refuse(send, 413, too_large, scope["path"])
                return
            chunks.append(chunk)
            more = message.get("more_body", False)
        body = b"".join(chunks)
        delivered = False

        async def replay():
            nonlocal delivered
            if delivered:
                return await receive()
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


def media_type(request: Request) -> str:
    return request.headers.get("content-type", "").split(";")[0].strip().lower()


def require_job_body(request: Request) -> None:
    """A FastAPI dependency of routes that take a job or a book: JSON, or multipart/form-data with a
    file (checked before the body is parsed)."""
    media = media_type(request)
    if media not in ("application/json", "multipart/form-data"):
        raise UnsupportedMediaType(
            f"send it as application/json or multipart/form-data, not {media or 'a body without a content type'}"
        )
