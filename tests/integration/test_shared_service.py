"""A fleet many people share, over real HTTP against a real fleet (API, eSpeak NG speech workers,
assembler, finalizer, real Redis): tenants and keys, ownership on every endpoint, quotas and 429s,
idempotent submission, signed links, and every hostile input of issue 16."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import threading
import time

import httpx
import psutil
import pytest
import redis

from api.links import LinkSigner
from fleet.names import Names
from jobs.tenants import TenantStore
from models.espeak import unavailable_reason
from testing.fleetkit import delete_prefix, espeak_settings, make_keys, read_sse, start_fleet, wait_done
from tests.conftest import require

pytestmark = pytest.mark.integration

BOOK = "# One\n\nA short book. Two sentences.\n\n# Two\n\nThe end."


@pytest.fixture(scope="module")
def service(redis_url, data_dir, tmp_path_factory):
    """A fleet with keys required, and keys of tenants alice, bob and an admin."""
    require(unavailable_reason() is None, f"eSpeak NG: {unavailable_reason()}")
    prefix = f"shared-{int(time.time() * 1000) % 10**9}"
    settings = espeak_settings(redis_url, prefix, data_dir, block_ms=200, max_text_chars=300_000, segment_cache="tenant")
    made = make_keys(
        redis_url,
        prefix,
        {
            "alice": {},
            "bob": {},
            "quota": {"concurrent_jobs": 1, "chars_per_day": 60, "max_text_chars": 40},
            "rate": {"requests_per_minute": 5},
            "admin": {"tenant": "ops", "admin": True},
        },
    )
    fleet = start_fleet(settings, tmp_path_factory.mktemp("logs"), speech_workers=1)
    try:
        yield fleet, made
    finally:
        fleet.stop()
        delete_prefix(redis_url, prefix)


def on_tenants(redis_url: str, fleet, action):
    """Run ``action(TenantStore)`` (a coroutine function) on the fleet's Redis."""

    async def main():
        r = redis.asyncio.from_url(redis_url)
        try:
            return await action(TenantStore(r, Names(fleet.settings.key_prefix)))
        finally:
            await r.aclose()

    return asyncio.run(main())


def client(fleet, key: str | None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=fleet.base_url, headers=headers, timeout=60)


def post(c: httpx.Client, **body) -> httpx.Response:
    return c.post("/v1/jobs", json=body)


def test_keys_are_required_and_a_revoked_key_is_refused_at_once(service, redis_url):
    fleet, keys = service
    with client(fleet, None) as anonymous:
        r = anonymous.get("/v1/jobs")
        assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer")
    with client(fleet, "nk_not-a-key") as wrong:
        assert wrong.get("/v1/jobs").status_code == 401
    with client(fleet, "x") as garbage, client(fleet, None) as c:
        assert garbage.get("/v1/jobs").status_code == 401
        assert c.get("/v1/jobs", headers={"Authorization": "Basic abc"}).status_code == 401
    assert client(fleet, None).get("/health").status_code == 200  # liveness needs no key

    key = on_tenants(redis_url, fleet, lambda t: t.create_key("temp"))
    with client(fleet, key) as c:
        assert c.get("/v1/jobs").status_code == 200

        async def revoke(tenants):
            (key_id,) = [k for k, record in (await tenants.keys()).items() if record.tenant == "temp"]
            return await tenants.revoke(key_id)

        assert on_tenants(redis_url, fleet, revoke) == 1
        assert c.get("/v1/jobs").status_code == 401  # the very next request


def test_another_tenants_job_does_not_exist_for_them_on_any_endpoint(service, redis_url):
    fleet, keys = service
    with (
        client(fleet, keys["alice"]) as alice,
        client(fleet, keys["bob"]) as bob,
        client(fleet, keys["admin"]) as ops,
    ):
        job = post(alice, text=BOOK).json()
        job_id = job["id"]
        assert wait_done(alice, job_id, timeout=120)["status"] == "done"
        for method, path in [
            ("GET", f"/v1/jobs/{job_id}"),
            ("HEAD", f"/v1/jobs/{job_id}"),
            ("GET", f"/v1/jobs/{job_id}/events"),
            ("GET", f"/v1/jobs/{job_id}/audio"),
            ("DELETE", f"/v1/jobs/{job_id}"),
        ]:
            r = bob.request(method, path)
            assert r.status_code == 404, (method, path, r.status_code)
            if method != "HEAD":
                assert r.json() == {"detail": f"no job {job_id!r}"}  # the same as for a job that never was
        assert (
            bob.get(f"/v1/jobs/{job_id}/audio?token=forged").status_code == 404
        )  # ownership before the token
        assert job_id not in [j["id"] for j in bob.get("/v1/jobs").json()["jobs"]]
        assert job_id in [j["id"] for j in alice.get("/v1/jobs").json()["jobs"]]
        assert job_id in [j["id"] for j in ops.get("/v1/jobs").json()["jobs"]]  # admins see every tenant
        assert ops.get(f"/v1/jobs/{job_id}").json()["tenant"] == "alice"
        audio = alice.get(f"/v1/jobs/{job_id}/audio")
        assert audio.status_code == 200 and audio.content[:4] == b"RIFF"
        key = alice.get(f"/v1/jobs/{job_id}").json()
    r = redis.Redis.from_url(redis_url)
    audio_key = r.hget(Names(fleet.settings.key_prefix).job(job_id), "audio_key").decode()
    assert audio_key == f"tenants/alice/audio/{job_id}.wav"  # storage is under the owner's prefix
    assert key["links"]["audio"].startswith(f"/v1/jobs/{job_id}/audio?token=")


def test_listing_pages_with_a_cursor_and_filters_by_status(service):
    fleet, keys = service
    with client(fleet, keys["bob"]) as bob:
        made = [post(bob, text=f"Job number {i}.").json()["id"] for i in range(5)]
        for job_id in made:
            wait_done(bob, job_id, timeout=120)
        seen, cursor = [], None
        while True:
            page = bob.get("/v1/jobs", params={"limit": 2, **({"cursor": cursor} if cursor else {})}).json()
            seen += [j["id"] for j in page["jobs"]]
            if not (cursor := page["next_cursor"]):
                break
        assert seen[:5] == made[::-1] and len(seen) == len(set(seen))  # newest first, each once
        done = bob.get("/v1/jobs", params={"status": "done"}).json()["jobs"]
        assert {j["status"] for j in done} == {"done"} and set(made) <= {j["id"] for j in done}
        assert bob.get("/v1/jobs", params={"status": "queued"}).json()["jobs"] == []
        assert bob.get("/v1/jobs", params={"status": "nonsense"}).status_code == 422
        assert bob.get("/v1/jobs", params={"cursor": "garbage"}).status_code == 422


def test_quotas_answer_429_with_retry_after(service):
    fleet, keys = service
    with client(fleet, keys["quota"]) as q:
        too_long = post(q, text="x" * 41 + ".")
        assert too_long.status_code == 413 and "at most 40" in too_long.json()["detail"]
        first = post(q, text="One sentence here.")  # 18 characters of 60 a day
        assert first.status_code == 202
        second = post(q, text="Another one.")
        assert second.status_code == 429 and int(second.headers["retry-after"]) > 0
        assert "jobs still going, its limit" in second.json()["detail"]
        wait_done(q, first.json()["id"], timeout=120)
        third = post(q, text="Now a third one here...")  # 18 + 23: fits the day
        assert third.status_code == 202
        wait_done(q, third.json()["id"], timeout=120)
        over = post(q, text="And this is too much now.")  # 41 + 25 > 60
        assert over.status_code == 429 and "characters a day left" in over.json()["detail"]
        assert int(over.headers["retry-after"]) > 3600
    with client(fleet, keys["rate"]) as r:
        codes = [r.get("/v1/jobs").status_code for _ in range(8)]
        assert codes[:5] == [200] * 5 and codes[5:] == [429] * 3
        assert int(r.get("/v1/jobs").headers["retry-after"]) >= 1


def test_an_idempotency_key_makes_concurrent_retries_one_job(service, redis_url):
    fleet, keys = service
    body = {"text": "Exactly once, please."}
    headers = {"Idempotency-Key": "order-123"}

    def attempt(_):
        with client(fleet, keys["alice"]) as c:
            return c.post("/v1/jobs", json=body, headers=headers)

    with concurrent.futures.ThreadPoolExecutor(10) as pool:
        answers = list(pool.map(attempt, range(10)))
    assert [a.status_code for a in answers] == [202] * 10
    ids = {a.json()["id"] for a in answers}
    assert len(ids) == 1
    r = redis.Redis.from_url(redis_url)
    names = Names(fleet.settings.key_prefix)
    stored = [j.decode() for j in r.zrange(names.tenant_jobs("alice"), 0, -1)]
    assert sum(1 for j in stored if j in ids) == 1  # one job stored, with one set of tasks
    tasks = [json.loads(f[b"h"]) for _, f in r.xrange(names.tasks("espeak"))]
    assert sum(1 for t in tasks if t["job_id"] in ids) <= 1  # (taken already, or queued once)
    with client(fleet, keys["alice"]) as c:
        other = c.post("/v1/jobs", json={"text": "Another body."}, headers=headers)
        assert other.status_code == 422 and "different request body" in other.json()["detail"]
        with client(fleet, keys["bob"]) as bob:  # keys are per tenant
            assert bob.post("/v1/jobs", json=body, headers=headers).json()["id"] not in ids


def test_signed_links_open_one_job_until_they_expire(service, redis_url):
    fleet, keys = service
    with client(fleet, keys["alice"]) as alice, client(fleet, None) as browser:
        job = post(alice, text=BOOK).json()
        other = post(alice, text="Another job.").json()
        events = list(read_sse(browser, job["links"]["events"], timeout=120))  # no header: the token
        assert events[-1].event == "done"
        audio = browser.get(job["links"]["audio"])
        assert audio.status_code == 200 and audio.content[:4] == b"RIFF"
        token = job["links"]["audio"].split("token=")[1]
        tampered = token[:-1] + ("A" if token[-1] != "A" else "B")
        assert browser.get(f"/v1/jobs/{job['id']}/audio?token={tampered}").status_code == 401
        assert browser.get(f"/v1/jobs/{other['id']}/audio?token={token}").status_code == 401  # another job
        assert (
            browser.get(f"/v1/jobs/{job['id']}/events?token={token}").status_code == 401
        )  # another resource
        assert browser.get(f"/v1/jobs/{job['id']}?token={token}").status_code == 401  # only events and audio
        secret = redis.Redis.from_url(redis_url).get(Names(fleet.settings.key_prefix).link_secret())
        expired = LinkSigner(secret, ttl_s=60).token(job["id"], "audio", now=time.time() - 120)
        r = browser.get(f"/v1/jobs/{job['id']}/audio?token={expired}")
        assert r.status_code == 401 and "expired" in r.json()["detail"]


def test_hostile_input_is_refused_clearly_and_nothing_refused_is_enqueued(service, redis_url):
    fleet, keys = service
    names = Names(fleet.settings.key_prefix)
    r = redis.Redis.from_url(redis_url)
    jobs_before = r.zcard(names.jobs_index())
    with client(fleet, keys["bob"]) as c:
        cases = {
            "lone surrogate": (  # what a client's JSON escape (\\ud800 alone) decodes to
                c.post(
                    "/v1/jobs",
                    content=b'{"text": "Hello \\ud800 there."}',
                    headers={"content-type": "application/json"},
                ),
                422,
                "lone surrogate (U+D800)",
            ),
            "only NULs": (post(c, text="\x00\x00\x00"), 422, "nothing to narrate"),
            "only controls": (post(c, text="\x01\x02\x1f\x7f"), 422, "nothing to narrate"),
            "only zero-width": (post(c, text="\u200b\u200c\u200d\ufeff"), 422, "nothing to narrate"),
            "only punctuation": (post(c, text="... !!! ??? --- ;;;"), 422, "nothing to narrate"),
            "string for int": (post(c, text="Hi.", seed="5"), 422, "seed"),
            "bool for int": (post(c, text="Hi.", seed=True), 422, "seed"),
            "sample rate 0": (post(c, text="Hi.", sample_rate=0), 422, "sample_rate"),
            "form body": (c.post("/v1/jobs", data={"text": "Hi."}), 415, "application/json"),
            "no content type": (c.post("/v1/jobs", content=b'{"text": "Hi."}'), 415, "application/json"),
            "bad JSON": (
                c.post("/v1/jobs", content=b"{", headers={"content-type": "application/json"}),
                400,
                "not valid JSON",
            ),
            "1 MB voice": (post(c, text="Hi.", voice="v" * 1_000_000), 422, "voice"),
        }
        for name, (response, status, says) in cases.items():
            assert response.status_code == status, (name, response.status_code, response.text[:300])
            assert says in response.text and len(response.text) < 400, (name, response.text[:400])
        job = post(c, text="A fine job.").json()
        done = wait_done(c, job["id"], timeout=120)
        last = list(read_sse(c, f"/v1/jobs/{job['id']}/events"))[-1].id
        beyond = f"{int(last.split('-')[0]) + 10}-0"
        r400 = c.get(f"/v1/jobs/{job['id']}/events", headers={"Last-Event-ID": beyond})
        assert r400.status_code == 400 and "past this job's last event" in r400.json()["detail"]
        huge = c.get(f"/v1/jobs/{job['id']}/events", headers={"Last-Event-ID": "99999999999999999999999-0"})
        assert huge.status_code == 400
        started = time.monotonic()
        after_done = c.get(f"/v1/jobs/{job['id']}/events", headers={"Last-Event-ID": last})
        assert after_done.status_code == 200 and time.monotonic() - started < 1.0  # ends at once
        assert c.head(f"/v1/jobs/{job['id']}").status_code == 200
        assert c.head("/v1/models").status_code == 200
        put = c.put(f"/v1/jobs/{job['id']}")
        assert put.status_code == 405 and set(put.headers["allow"].split(", ")) >= {"GET", "HEAD", "DELETE"}
        assert done["status"] == "done"
    assert r.zcard(names.jobs_index()) == jobs_before + 1  # only the fine job was stored


def test_a_300_mb_chunked_body_is_refused_while_reading_and_memory_stays_flat(service):
    fleet, keys = service
    api = next(child for child in fleet.supervisor.children if child.name == "api")
    process = psutil.Process(api.process.pid)
    before = process.memory_info().rss

    def body():
        chunk = b'{"text": "' + b"a" * (1024 * 1024 - 10)
        yield chunk
        for _ in range(299):
            yield b"a" * (1024 * 1024)

    with client(fleet, keys["bob"]) as c:
        try:
            r = c.post("/v1/jobs", content=body(), headers={"content-type": "application/json"})
            status = r.status_code
        except httpx.HTTPError:  # the server may close while the client is still sending
            status = 413
        assert status == 413
    # a declared 300 MB body: refused on its headers, before any of it is read
    import socket
    from urllib.parse import urlparse

    url = urlparse(fleet.base_url)
    with socket.create_connection((url.hostname, url.port), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {keys['bob']}\r\nContent-Length: 300000000\r\n\r\n".encode()
        )
        assert sock.recv(4096).startswith(b"HTTP/1.1 413")
    after = process.memory_info().rss
    print(f"API RSS before {before / 2**20:.0f} MiB, after a 300 MB body {after / 2**20:.0f} MiB")
    assert after - before < 50 * 2**20


def test_the_event_loop_keeps_answering_while_a_maximum_size_text_is_segmented(service):
    """Parsing, validating and segmenting a whole book run off the event loop: /health keeps
    answering throughout the submit. (A blocked loop would hold every probe for the whole submit;
    the < 100 ms figure on a quiet machine is measured by bench/api_load.py.)"""
    fleet, keys = service
    text = "word " * (fleet.settings.max_text_chars // 5 - 1)  # one unpunctuated text of the maximum size
    latencies: list[float] = []
    submitting = threading.Event()
    done = threading.Event()

    def probe():
        with httpx.Client(base_url=fleet.base_url, timeout=30) as h:
            submitting.wait()
            while not done.is_set():
                t = time.monotonic()
                h.get("/health")
                latencies.append(time.monotonic() - t)
                time.sleep(0.01)

    thread = threading.Thread(target=probe)
    thread.start()
    try:
        with client(fleet, keys["alice"]) as c:
            started = time.monotonic()
            submitting.set()
            r = post(c, text=text)
            took = time.monotonic() - started
            done.set()
            assert r.status_code == 202, r.text[:300]
            c.delete(f"/v1/jobs/{r.json()['id']}")
    finally:
        done.set()
        submitting.set()
        thread.join()
    print(
        f"submit {took * 1000:.0f} ms; /health: {len(latencies)} probes, max {max(latencies) * 1000:.0f} ms"
    )
    assert len(latencies) >= 3 and max(latencies) < took / 2


def test_rendered_segments_are_reused_within_a_tenant_never_across(service):
    """The same book again: alice's second job takes every segment from her cache; bob's identical
    job renders its own (tenants never share audio unless the fleet is configured to)."""
    fleet, keys = service
    text = "# Kept\n\nOnly alice hears this twice. Nobody else does."
    with client(fleet, keys["alice"]) as alice, client(fleet, keys["bob"]) as bob:
        first = post(alice, text=text).json()
        assert first["segments_reused"] == 0
        assert wait_done(alice, first["id"])["status"] == "done"
        again = post(alice, text=text).json()
        other = post(bob, text=text).json()
        assert (again["segments_reused"], again["segments_total"]) == (3, 3)
        assert other["segments_reused"] == 0
        assert wait_done(alice, again["id"])["status"] == "done" and wait_done(bob, other["id"])["status"] == "done"
        assert alice.get(f"/v1/jobs/{again['id']}/audio").content == alice.get(f"/v1/jobs/{first['id']}/audio").content
