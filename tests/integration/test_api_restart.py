"""The API process dies mid-job (SIGKILL): the supervisor starts it again on the same port, the job
completes, a client's SSE stream resumes from its Last-Event-ID with no event lost or repeated, and
the live stream and the finished file are served by the new process."""

from __future__ import annotations

import signal
import time

import httpx
import pytest

from testing.fleetkit import read_sse, short_sentences, start_fleet, submit, wait_done

pytestmark = pytest.mark.integration

SEGMENTS = 120


def wait_for_api(fleet, timeout: float = 60) -> None:
    """Poll the supervisor (it restarts what died) until the API answers again."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        fleet.supervisor.poll()
        try:
            if httpx.get(f"{fleet.base_url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"the API did not come back\n{fleet.logs()}")


def test_a_killed_api_is_restarted_and_its_clients_resume(make_settings, key_prefix, tmp_path):
    fleet = start_fleet(make_settings(key_prefix), tmp_path / "logs", max_backoff_s=1.0)
    try:
        api = next(c for c in fleet.supervisor.children if c.name == "api")
        with fleet.client() as client:
            job = submit(client, text=short_sentences(SEGMENTS, per_paragraph=10))
            first = list(read_sse(client, f"/v1/jobs/{job['id']}/events", stop_after=8))
            assert first and first[-1].id
            old_pid = api.process.pid
            api.process.send_signal(signal.SIGKILL)
            api.process.wait(10)
            with pytest.raises(httpx.HTTPError):
                client.get("/health", timeout=1)
            wait_for_api(fleet)
            assert api.process.pid != old_pid and api.exits == [-signal.SIGKILL]
            # the rest of the events from where the client was, each once, to the job's end
            rest = list(read_sse(client, f"/v1/jobs/{job['id']}/events", last_event_id=first[-1].id, timeout=300))
            done = wait_done(client, job["id"], timeout=300)
            assert done["status"] == "done" and done["segments_done"] == SEGMENTS, fleet.logs()
            whole = list(read_sse(client, f"/v1/jobs/{job['id']}/events", timeout=60))
            assert [e.id for e in first + rest] == [e.id for e in whole]
            assert rest[-1].event == "done"
            # the new process serves the job's audio: the live stream (MP3 of a done job) and the file
            with client.stream("GET", done["links"]["stream"], timeout=120) as response:
                assert response.status_code == 200 and response.headers["content-type"] == "audio/mpeg"
                assert sum(len(piece) for piece in response.iter_bytes()) > 10_000
            audio = client.get(f"/v1/jobs/{job['id']}/audio")
            assert audio.status_code == 200 and audio.content[:4] == b"RIFF"
    finally:
        fleet.stop()
