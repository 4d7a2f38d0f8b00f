"""POST /v1/audio/speech with the official ``openai`` client against a real fleet (API, eSpeak NG speech
workers, assembler, finalizer as processes on real Redis): every response format decoded by an
independent decoder (Debian's ffmpeg), streamed responses, the SSE events, speed, and OpenAI-style
errors."""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import time

import numpy as np
import pytest

from models.espeak import unavailable_reason
from testing.fleetkit import espeak_fleet, ffprobe, make_keys
from tests.conftest import require, require_module

require_module("openai", "the official openai client (the test extra installs it)")
import openai  # noqa: E402 - after the check: a missing client fails CI, never skips

pytestmark = pytest.mark.integration
TEXT = "The harbour woke before the town did. Gulls argued over the nets. Nobody answered him."
#: (format, the rate the decoder reads back)
FORMATS = [("mp3", 22_050), ("opus", 48_000), ("aac", 22_050), ("flac", 22_050), ("wav", 22_050)]


@pytest.fixture(scope="module")
def fleet(redis_url, data_dir, tmp_path_factory):
    require(unavailable_reason() is None, f"eSpeak NG: {unavailable_reason()}")
    require(shutil.which("ffmpeg") is not None, "ffmpeg (Debian's; scripts/test.sh installs it)")
    with espeak_fleet(redis_url, data_dir, tmp_path_factory.mktemp("speech-logs"), "speech", auth="required") as running:
        running.key = make_keys(redis_url, running.settings.key_prefix, {"listener": {}})["listener"]
        yield running


@pytest.fixture(scope="module")
def client(fleet):
    with openai.OpenAI(base_url=f"{fleet.base_url}/v1", api_key=fleet.key, max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def voice(fleet):
    with fleet.client(headers={"Authorization": f"Bearer {fleet.key}"}) as http:
        (model,) = http.get("/v1/models").json()
    return model["default_voice"]


def decoded_seconds(data: bytes, tmp_path, fmt: str) -> tuple[float, int]:
    """Seconds of audio and the stream's rate, as Debian's ffmpeg decodes the bytes."""
    path = tmp_path / f"speech.{fmt}"
    path.write_bytes(data)
    rate = int(ffprobe(path, "streams")["streams"][0]["sample_rate"])
    pcm = subprocess.run(
        ["ffmpeg", "-v", "error", "-i", str(path), "-f", "s16le", "-ac", "1", "pipe:1"], capture_output=True, check=True
    ).stdout
    return len(pcm) / 2 / rate, rate


@pytest.fixture(scope="module")
def reference_s(client, voice, tmp_path_factory):
    """The text's length as WAV: every other format is this long, within its codec's framing."""
    wav = client.audio.speech.create(model="espeak", voice=voice, input=TEXT, response_format="wav").read()
    seconds, rate = decoded_seconds(wav, tmp_path_factory.mktemp("ref"), "wav")
    assert rate == 22_050 and 3 < seconds < 15
    return seconds


@pytest.mark.parametrize(("fmt", "rate"), FORMATS)
def test_every_format_decodes_at_the_texts_length(client, voice, reference_s, fmt, rate, tmp_path):
    data = client.audio.speech.create(model="tts-1", voice=voice, input=TEXT, response_format=fmt).read()
    seconds, got_rate = decoded_seconds(data, tmp_path, fmt)
    assert got_rate == rate
    assert abs(seconds - reference_s) < 0.15, (seconds, reference_s)


def test_pcm_is_24_khz_16_bit_mono_without_a_header(client, voice, reference_s):
    data = client.audio.speech.create(model="espeak", voice=voice, input=TEXT, response_format="pcm").read()
    pcm = np.frombuffer(data, dtype="<i2")
    assert abs(pcm.size / 24_000 - reference_s) < 0.05 and np.abs(pcm).max() > 1000


def test_a_streamed_response_arrives_in_pieces_before_the_end(client, voice, tmp_path):
    long_text = " ".join([TEXT] * 8)
    pieces, first_at = [], None
    start = time.monotonic()
    with client.audio.speech.with_streaming_response.create(
        model="espeak", voice={"id": voice}, input=long_text, response_format="mp3"
    ) as response:
        assert response.headers["content-type"] == "audio/mpeg"
        for piece in response.iter_bytes():
            first_at = first_at if first_at is not None else time.monotonic() - start
            pieces.append(piece)
    total = time.monotonic() - start
    assert len(pieces) > 3 and first_at < total / 2, (len(pieces), first_at, total)
    seconds, _ = decoded_seconds(b"".join(pieces), tmp_path, "mp3")
    assert seconds > 20


def test_sse_events_carry_the_audio_then_done(client, voice, reference_s):
    with client.audio.speech.with_streaming_response.create(
        model="espeak", voice=voice, input=TEXT, response_format="pcm", stream_format="sse"
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[len("data: ") :]) for line in response.iter_lines() if line.startswith("data: ")]
    kinds = [e["type"] for e in events]
    assert kinds[-1] == "speech.audio.done" and set(kinds[:-1]) == {"speech.audio.delta"} and len(kinds) > 2
    pcm = np.frombuffer(b"".join(base64.b64decode(e["audio"]) for e in events[:-1]), dtype="<i2")
    assert abs(pcm.size / 24_000 - reference_s) < 0.05
    assert events[-1]["usage"]["input_tokens"] == len(TEXT)


def test_speed_two_is_half_as_long(client, voice, reference_s):
    data = client.audio.speech.create(model="espeak", voice=voice, input=TEXT, response_format="pcm", speed=2.0).read()
    assert abs(np.frombuffer(data, dtype="<i2").size / 24_000 - reference_s / 2) < 0.1


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"input": "x" * 4097}, "input"),
        ({"voice": "no-such-voice"}, "voice"),
        ({"model": "no-such-model"}, "model"),
        ({"response_format": "wma"}, "response_format"),
        ({"speed": 5.0}, "speed"),
        ({"instructions": "Speak like a pirate."}, "instructions"),
    ],
)
def test_bad_requests_get_openai_errors(client, voice, change, param):
    request = {"model": "espeak", "voice": voice, "input": TEXT, **change}
    with pytest.raises(openai.BadRequestError) as caught:
        client.audio.speech.create(**request)
    error = caught.value.body
    assert caught.value.status_code == 400 and error["param"] == param and error["message"], error
    assert error["type"] == "invalid_request_error"


def test_a_wrong_key_is_refused_in_openais_shape(fleet):
    wrong = openai.OpenAI(base_url=f"{fleet.base_url}/v1", api_key="wrong", max_retries=0)
    with wrong, pytest.raises(openai.AuthenticationError) as caught:
        wrong.audio.speech.create(model="espeak", voice="en", input=TEXT)
    assert caught.value.status_code == 401 and "not valid" in caught.value.body["message"]


def test_an_unknown_parameter_is_named(client, voice):
    with pytest.raises(openai.BadRequestError) as caught:
        client.audio.speech.create(model="espeak", voice=voice, input=TEXT, extra_body={"temperature": 0.3})
    assert caught.value.body["param"] == "temperature" and caught.value.body["code"] == "unknown_parameter"


def test_the_requests_jobs_are_gone_afterwards(fleet, client, voice):
    client.audio.speech.create(model="espeak", voice=voice, input=TEXT, response_format="wav").read()
    deadline = time.monotonic() + 30
    with fleet.client(headers={"Authorization": f"Bearer {fleet.key}"}) as http:
        while (jobs := http.get("/v1/jobs").json()["jobs"]) and time.monotonic() < deadline:
            time.sleep(0.2)
    assert jobs == []


def fail_the_running_job(fleet, redis_url: str) -> None:
    """Fail the listener's one job, as a dead-lettered segment would (JobStore.fail)."""
    import asyncio

    import redis.asyncio as aioredis

    from fleet.names import Names
    from jobs.store import JobStore

    with fleet.client(headers={"Authorization": f"Bearer {fleet.key}"}) as http:
        (job,) = http.get("/v1/jobs").json()["jobs"]

    async def fail():
        r = aioredis.from_url(redis_url)
        try:
            store = JobStore(r, Names(fleet.settings.key_prefix), events_maxlen=1000, result_ttl_s=60)
            assert await store.fail(job["id"], "a segment could not be rendered")
        finally:
            await r.aclose()

    asyncio.run(fail())


@pytest.mark.parametrize("stream_format", ["audio", "sse"])
def test_speech_whose_job_fails_midway_is_no_answer_that_passes_for_whole(fleet, client, voice, redis_url, stream_format):
    long = " ".join([TEXT] * 45)[:4096]
    with client.audio.speech.with_streaming_response.create(
        model="espeak", voice=voice, input=long, response_format="pcm", stream_format=stream_format
    ) as response:
        pieces = response.iter_bytes() if stream_format == "audio" else response.iter_lines()
        first = next(pieces)
        assert first
        fail_the_running_job(fleet, redis_url)
        if stream_format == "audio":  # the body is cut off: the client cannot take it for complete
            # (the client's own httpx: its RemoteProtocolError)
            with pytest.raises(Exception, match="peer closed connection without sending complete message body"):
                for _ in pieces:
                    pass
            return
        events = [json.loads(line[len("data: ") :]) for line in pieces if line.startswith("data: ")]
    assert events[-1]["type"] == "error" and "job failed: a segment could not be rendered" in events[-1]["error"]["message"]
    assert "speech.audio.done" not in [e["type"] for e in events]
