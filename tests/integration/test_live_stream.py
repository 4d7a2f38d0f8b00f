"""GET /v1/jobs/{id}/stream on a real fleet (API, eSpeak NG speech workers, assembler, finalizer as
processes on real Redis): audio arrives while the job renders, in book order with its pauses, and an
independent decoder (Debian's ffmpeg) reads the stream back at the length of the finished book."""

from __future__ import annotations

import shutil
import subprocess
import threading

import httpx
import numpy as np
import pytest

from models.espeak import unavailable_reason
from testing.fleetkit import BOOK, espeak_fleet, manifest, submit, wait_done
from tests.conftest import require

pytestmark = pytest.mark.integration
RATE = 22_050
#: An MP3 stream's length differs from the PCM it was made of by LAME's padding: under two frames.
MP3_SLACK = 2 * 1152


@pytest.fixture(scope="module")
def fleet(redis_url, data_dir, tmp_path_factory):
    require(unavailable_reason() is None, f"eSpeak NG: {unavailable_reason()}")
    require(shutil.which("ffmpeg") is not None, "ffmpeg (Debian's; scripts/test.sh installs it)")
    with espeak_fleet(redis_url, data_dir, tmp_path_factory.mktemp("live-logs"), "live") as running:
        yield running


@pytest.fixture
def client(fleet):
    with fleet.client(timeout=120) as c:
        yield c


def decode(data: bytes) -> np.ndarray:
    """The stream as Debian's ffmpeg decodes it (int16 at the model's rate)."""
    out = subprocess.run(
        ["ffmpeg", "-v", "error", "-i", "pipe:0", "-f", "s16le", "-ac", "1", "-ar", str(RATE), "pipe:1"],
        input=data, capture_output=True, check=True,
    )  # fmt: skip
    return np.frombuffer(out.stdout, dtype="<i2")


def read_stream(client: httpx.Client, url: str, job_id: str | None = None) -> tuple[bytes, list[str]]:
    """The whole stream, and the job's status each time bytes arrived."""
    data, statuses = bytearray(), []
    with client.stream("GET", url) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"] == "audio/mpeg"
        for piece in response.iter_bytes():
            if job_id is not None and len(statuses) < 3:
                statuses.append(client.get(f"/v1/jobs/{job_id}").json()["status"])
            data += piece
    return bytes(data), statuses


def long_book(chapters: int = 3, sentences: int = 12) -> str:
    return "\n\n".join(
        f"# Chapter {c}\n\n"
        + " ".join(f"Sentence {s} of chapter {c} goes on for a little while, as sentences do." for s in range(sentences))
        for c in range(1, chapters + 1)
    )


def test_a_stream_plays_while_the_job_renders_and_has_the_books_length(fleet, client):
    job = submit(client, text=long_book(), format="flac")
    assert job["links"]["stream"].startswith(f"/v1/jobs/{job['id']}/stream?token=")
    data, statuses = read_stream(client, job["links"]["stream"], job["id"])
    # the first bytes came before the job was done: a listener hears it as it renders
    assert statuses and statuses[0] in ("queued", "running"), statuses
    done = wait_done(client, job["id"])
    assert done["status"] == "done"
    book = manifest(fleet.settings, job["id"])
    heard = decode(data)
    assert book["samples"] <= heard.size <= book["samples"] + MP3_SLACK, (heard.size, book["samples"])
    # speech where the book has a segment, silence in its pauses (the stream is not loudness-normalised)
    for segment in book["segments"][:5]:
        inside = heard[int(segment["start_s"] * RATE) : int(segment["end_s"] * RATE)]
        assert np.abs(inside.astype(np.int32)).max() > 1000, segment["index"]
    gap_start, gap_end = book["segments"][0]["end_s"], book["segments"][1]["start_s"]
    assert gap_end - gap_start > 0.2
    pause = heard[int((gap_start + 0.05) * RATE) : int((gap_end - 0.05) * RATE)]
    assert np.abs(pause.astype(np.int32)).max() < 300


def test_listeners_at_once_hear_the_same_bytes_and_a_chapter_starts_where_it_is(fleet, client):
    job = submit(client, text=long_book(), format="wav")
    url = job["links"]["stream"]
    results: dict[str, bytes] = {}

    def listen(name: str, path: str) -> None:
        with fleet.client(timeout=120) as own:
            results[name] = read_stream(own, path)[0]

    threads = [
        threading.Thread(target=listen, args=(name, path))
        for name, path in (("a", url), ("b", url), ("chapter2", f"{url}&chapter=2"))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    assert wait_done(client, job["id"])["status"] == "done"
    assert results["a"] == results["b"] and len(results["a"]) > 10_000  # one encode, copied to each
    book = manifest(fleet.settings, job["id"])
    start = round(book["chapters"][1]["start_s"] * RATE)
    heard = decode(results["chapter2"])
    assert book["samples"] - start <= heard.size <= book["samples"] - start + MP3_SLACK
    # the finished job streams too (from its file now: the parts are gone), from the same place
    again = decode(read_stream(client, f"{url}&chapter=2")[0])
    assert abs(again.size - heard.size) <= MP3_SLACK
    # Opus in Ogg, for players that prefer it
    with client.stream("GET", f"{url}&format=opus") as response:
        assert response.headers["content-type"] == "audio/ogg"
        assert response.read()[:4] == b"OggS"


def test_bad_streams_are_refused_with_a_reason(fleet, client):
    assert client.get("/v1/jobs/no-such-job/stream").status_code == 404
    job = submit(client, text=BOOK)
    response = client.get(f"/v1/jobs/{job['id']}/stream?chapter=9")
    assert response.status_code == 422 and "chapter 9" in response.json()["detail"]
    assert client.get(f"/v1/jobs/{job['id']}/stream?format=wma").status_code == 422
    client.delete(f"/v1/jobs/{job['id']}")
    assert client.get(f"/v1/jobs/{job['id']}/stream").status_code == 404
