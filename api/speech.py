"""OpenAI's speech endpoint, ``POST /v1/audio/speech``, served by the fleet (the official ``openai``
client works against it: tests/integration/test_openai_speech.py).

A request is a job like any other (same admission, quotas and workers, so a laptop fleet and a GPU
fleet both serve it), of interactive priority, whose audio streams back as it is decoded
(jobs/live.py, jobs/progressive.py) instead of waiting for a file; the job is deleted when the
response ends or the client leaves. Errors have OpenAI's shape (``{"error": {"message", "type",
"param", "code"}}``, api/errors.py). ``model``: a model of this fleet, or one of OpenAI's names
(``tts-1``, ``tts-1-hd``, ``gpt-4o-mini-tts``), which mean the fleet's default model; ``voice``: a voice of
that model (GET /v1/models); ``speed``: 0.25 to 4, by FFmpeg's atempo (the pitch stays).
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
from collections.abc import AsyncIterator
from typing import Literal

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from api.auth import caller
from api.errors import OpenAIError
from api.routes import read_job, submit
from api.schemas import JobCreate
from api.state import AppState, app_state
from jobs import service
from jobs.audio import Pauses
from jobs.errors import InvalidRequest
from jobs.live import LiveAudio, encoded
from jobs.model import Job, JobStatus
from jobs.progressive import STREAM_FORMATS, TEMPO_RANGE
from jobs.tenants import Principal
from models.registry import MODELS

log = logging.getLogger(__name__)
router = APIRouter()

#: OpenAI's model names: the fleet's default model serves them.
OPENAI_MODELS = ("tts-1", "tts-1-hd", "gpt-4o-mini-tts")


class VoiceRef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str = Field(max_length=100)


class SpeechRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(max_length=100, description=f"A model of this fleet, or {', '.join(OPENAI_MODELS)} (the default).")
    input: str = Field(description="The text, up to 4,096 characters.")
    voice: str | VoiceRef = Field(description="A voice of the model (GET /v1/models), or {\"id\": voice}.")
    instructions: str | None = Field(default=None, description="Not supported: a voice here is not steered by text.")
    response_format: Literal["mp3", "opus", "aac", "flac", "wav", "pcm"] = "mp3"
    speed: float = Field(default=1.0, description="0.25 to 4.0.")
    stream_format: Literal["audio", "sse"] = "audio"


def openai_model(name: str) -> bool:
    """One of OpenAI's speech models (dated versions included)."""
    return name in OPENAI_MODELS or name.startswith("gpt-4o-mini-tts-")


#: Requests whose job is still being deleted (kept so the tasks are not collected mid-way).
_deleting: set[asyncio.Task] = set()


@router.post(
    "/v1/audio/speech",
    responses={200: {"content": {f.content_type: {} for f in STREAM_FORMATS.values()} | {"text/event-stream": {}}}},
)
async def create_speech(request: Request, st: AppState = Depends(app_state), who: Principal = Depends(caller)):
    """Speech from text, as it is rendered: the bytes of ``response_format`` as they are decoded, or
    (``stream_format: sse``) ``speech.audio.delta`` events of base64 audio and a ``speech.audio.done``."""
    body = _speech_request(await request.body(), st.settings.speech_max_chars)
    model = st.settings.default_model if openai_model(body.model) else body.model
    voice = body.voice.id if isinstance(body.voice, VoiceRef) else body.voice
    create = JobCreate(
        text=body.input, model=model, voice=voice[:100], format="wav", priority="interactive",
        text_format="plain", title="speech",
    )  # fmt: skip
    try:
        job, plan, cover, job_bytes = await asyncio.to_thread(
            read_job, create, None, [], who.tenant, st.settings, st.settings.speech_max_chars
        )
    except InvalidRequest as exc:
        message = str(exc)
        param = next((p for p in ("voice", "model") if p in message.split("'")[0]), None)
        raise OpenAIError(400, message, param=param, code="invalid_value") from None
    await submit(st, job, plan, cover, job_bytes, await st.limits(who.tenant))
    live = LiveAudio(
        st.store, st.storage, job, plan, Pauses.of(st.settings), MODELS[job.model].family.sample_rate,
        st.settings.live_poll_s,
    )  # fmt: skip
    fmt = STREAM_FORMATS[body.response_format]
    audio = _deleting_after(st, job, encoded(live, fmt, tempo=body.speed))
    headers = {"Cache-Control": "no-store", "X-Accel-Buffering": "no"}
    if body.stream_format == "sse":
        return StreamingResponse(_sse(audio, len(body.input)), media_type="text/event-stream", headers=headers)
    return StreamingResponse(audio, media_type=fmt.content_type, headers=headers)


def _speech_request(raw: bytes, max_chars: int) -> SpeechRequest:
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):  # (nested past the parser's depth)
        raise OpenAIError(400, "the request body is not valid JSON") from None
    try:
        body = SpeechRequest.model_validate(data)
    except ValidationError as exc:
        first = exc.errors(include_url=False, include_input=False)[0]
        param = ".".join(str(p) for p in first.get("loc", ())) or None
        code = "unknown_parameter" if first.get("type") == "extra_forbidden" else "invalid_value"
        if code == "unknown_parameter":
            raise OpenAIError(400, f"Unrecognized request argument supplied: {param}", param=param, code=code) from None
        raise OpenAIError(400, f"{param}: {first.get('msg')}", param=param, code=code) from None
    if not body.input.strip():
        raise OpenAIError(400, "input is empty", param="input", code="invalid_value")
    if len(body.input) > max_chars:
        raise OpenAIError(
            400, f"input is {len(body.input)} characters; at most {max_chars}", param="input", code="string_above_max_length"
        )
    if body.instructions:
        raise OpenAIError(400, "instructions are not supported: choose a voice instead", param="instructions", code="unsupported_parameter")
    lo, hi = TEMPO_RANGE
    if not lo <= body.speed <= hi:
        raise OpenAIError(400, f"speed {body.speed} is outside {lo} to {hi}", param="speed", code="invalid_value")
    return body


class SpeechFailed(RuntimeError):
    """The job ended without all its audio (failed, or cancelled by someone else)."""


async def _deleting_after(st: AppState, job: Job, audio: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """``audio``, then the job goes (also when the client leaves part-way: it is cancelled first).
    ``SpeechFailed`` after the last byte if the job failed or was cancelled: the answer must not pass
    for whole (the live stream ends what it has as a playable file). Finalizing is whole: every
    segment is in, only the finished file (not needed here) is still being written."""
    try:
        async for data in audio:
            if data:
                yield data
        ended = await st.store.get(job.id)
        if ended is None or ended.status not in (JobStatus.FINALIZING, JobStatus.DONE):
            status = ended.status.value if ended else "gone"
            raise SpeechFailed(f"the speech was not made whole: job {status}{': ' + ended.error if ended and ended.error else ''}")
    finally:
        task = asyncio.create_task(service.delete(st.store, st.storage, st.settings, job, st.rq))
        _deleting.add(task)
        task.add_done_callback(_deleting.discard)


async def _sse(audio: AsyncIterator[bytes], characters: int) -> AsyncIterator[bytes]:
    """OpenAI's speech events: one ``speech.audio.delta`` per piece of audio, then ``speech.audio.done``
    (or, for speech that could not be made whole, an ``error`` event instead)."""
    try:
        async for data in audio:
            event = {"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()}
            yield f"event: speech.audio.delta\ndata: {json.dumps(event)}\n\n".encode()
    except SpeechFailed as exc:
        error = {"type": "error", "error": {"message": str(exc), "type": "server_error", "param": None, "code": None}}
        yield f"event: error\ndata: {json.dumps(error)}\n\n".encode()
        return
    # usage: this fleet counts characters (what its quotas count), not a tokenizer's tokens
    usage = {"input_tokens": characters, "output_tokens": 0, "total_tokens": characters}
    yield f"event: speech.audio.done\ndata: {json.dumps({'type': 'speech.audio.done', 'usage': usage})}\n\n".encode()
