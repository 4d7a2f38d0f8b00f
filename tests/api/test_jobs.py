"""Request validation and the job routes, in-process: every refusal has a clear status and message
and writes nothing; an accepted job is stored with its tasks in one step."""

from __future__ import annotations

import json

import pytest

from api.errors import STATUS, status_of
from fleet.messages import SegmentTask
from fleet.names import Names
from jobs.errors import InvalidEventId, InvalidRequest, JobNotFound, NotReady, TooLarge
from jobs.store import JobStore

TEXT = "# One\n\nA first sentence. A second one.\n\n# Two\n\nThe end."


def test_a_job_is_accepted_with_its_tasks_and_links(api):
    async def scenario(a):
        r = await a.client.post("/v1/jobs", json={"text": TEXT, "title": "T"})
        assert r.status_code == 202, r.text
        body = r.json()
        names = Names("t")
        job = await a.redis.hgetall(names.job(body["id"]))
        store = JobStore.for_settings(a.redis, a.settings)
        shard = int(job[b"shard"])
        admitted = [SegmentTask.decode(f) for _, f in await a.redis.xrange(names.tasks("tiny", shard))]
        tasks = admitted + await store.scheduler.queued_tasks("tiny", shard, body["id"])
        return body, tasks, job, admitted

    body, tasks, job, admitted = api(scenario)
    assert [t.segment for t in admitted] == [0]  # one admitted at once (an idle worker wakes), the rest queued
    assert body["status"] == "queued" and body["segments_total"] == 5 and body["chapters"] == 2
    links = body["links"]
    assert links["self"] == f"/v1/jobs/{body['id']}"
    assert links["events"].startswith(f"/v1/jobs/{body['id']}/events?token=")
    assert links["audio"].startswith(f"/v1/jobs/{body['id']}/audio?token=")
    assert [t.segment for t in tasks] == [0, 1, 2, 3, 4] and {t.job_id for t in tasks} == {body["id"]}
    assert job[b"status"] == b"queued" and job[b"title"] == b"T"


def b64(data: bytes) -> str:
    import base64

    return base64.b64encode(data).decode()


@pytest.mark.parametrize(
    ("body", "status", "says"),
    [
        ({"text": ""}, 422, "text is empty"),
        ({"text": "   \n "}, 422, "text is empty"),
        ({"text": "x" * 101}, 413, "at most 100"),
        ({"text": "Hi.", "voice": "nobody"}, 422, "unknown voice 'nobody'"),
        ({"text": "Hi.", "model": "nothing"}, 422, "unknown model 'nothing'"),
        ({"text": "Hi.", "format": "ogg"}, 422, "unsupported format 'ogg'; supported: wav, flac, m4b, m4a, mp3, opus, aac"),
        ({"text": "Hi.", "sample_rate": 12345}, 422, "unsupported sample rate 12345"),
        ({"text": "Hi.", "format": "opus", "sample_rate": 22050}, 422, "unsupported sample rate 22050 for opus"),
        ({"text": "Hi.", "format": "m4b", "bitrate_kbps": 8}, 422, "bitrate 8 kb/s is out of range for m4b: 16-320"),
        ({"text": "Hi.", "format": "mp3", "bitrate_kbps": 999}, 422, "out of range for mp3: 32-320"),
        ({"text": "Hi.", "format": "flac", "bitrate_kbps": 64}, 422, "flac is lossless: it takes no bitrate"),
        ({"text": "Hi.", "format": "mp3", "bitrate_kbps": "fast"}, 422, "bitrate_kbps"),
        ({"text": "Hi.", "year": 20260}, 422, "year 20260 is not a year"),
        ({"text": "Hi.", "format": "m4b", "cover": b64(b"GIF89a" + bytes(64))}, 422, "the cover is not a PNG or JPEG picture"),
        ({"text": "Hi.", "format": "m4b", "cover": b64(b"\x89PNG\r\n\x1a\n" + bytes(64))}, 422, "the cover cannot be read"),
        ({"text": "Hi.", "format": "m4b", "cover": b64(b"\xff\xd8\xff" + bytes((2 << 20) + 100))}, 422, "at most 2,097,152"),
        ({"text": "Hi.", "format": "wav", "cover": b64(b"\x89PNG")}, 422, "wav carries no cover picture"),
        ({"text": "Hi.", "format": "m4b", "cover": "not base64!"}, 422, "cover"),
        ({"text": "Hi.", "language": "en"}, 422, "language 'en' is not an ISO 639-2 code (three letters, e.g. eng)"),
        ({"text": "Hi.", "loudness_lufs": -2}, 422, "loudness_lufs -2.0 is out of range: -40 to -5 LUFS"),
        ({"text": "Hi.", "rate": 150}, 422, "has no rate or pitch settings"),
        ({"text": "Hi.", "colour": "red"}, 422, "colour: Extra inputs are not permitted"),
        ({"text": "```\ncode only\n```"}, 422, "nothing to narrate"),
        ({"title": "no text"}, 422, "send either text or a source (a file)"),
    ],
)
def test_a_refused_job_says_why_and_writes_nothing(api, body, status, says):
    async def scenario(a):
        r = await a.client.post("/v1/jobs", json=body)
        return r, await a.keys()

    r, keys = api(scenario, max_text_chars=100)
    assert r.status_code == status and says in r.json()["detail"], r.text
    assert keys == []


def test_a_body_that_is_not_json_is_a_400(api):
    async def scenario(a):
        r = await a.client.post(
            "/v1/jobs", content=b"{not json", headers={"content-type": "application/json"}
        )
        return r, await a.keys()

    r, keys = api(scenario)
    assert r.status_code == 400 and r.json() == {"detail": "the request body is not valid JSON"}
    assert keys == []


def test_unknown_jobs_are_404_on_every_route(api):
    async def scenario(a):
        c = a.client
        return [
            await c.get("/v1/jobs/nope"),
            await c.get("/v1/jobs/nope/audio"),
            await c.get("/v1/jobs/nope/events"),
            await c.delete("/v1/jobs/nope"),
        ]

    for r in api(scenario):
        assert r.status_code == 404 and r.json() == {"detail": "no job 'nope'"}, r.text


def test_audio_before_done_is_409_and_a_bad_resume_id_400(api):
    async def scenario(a):
        job = (await a.client.post("/v1/jobs", json={"text": "Hello there."})).json()
        audio = await a.client.get(f"/v1/jobs/{job['id']}/audio")
        resume = await a.client.get(f"/v1/jobs/{job['id']}/events", headers={"last-event-id": "x" * 500})
        return audio, resume

    audio, resume = api(scenario)
    assert (
        audio.status_code == 409 and "is queued; its audio exists once it is done" in audio.json()["detail"]
    )
    assert resume.status_code == 400 and "is not an event id of this API" in resume.json()["detail"]
    assert len(resume.json()["detail"]) < 200  # the bad value is quoted, not echoed whole


def test_delete_cancels_a_queued_job_and_then_it_is_gone(api):
    async def scenario(a):
        job = (await a.client.post("/v1/jobs", json={"text": "Hello there. Twice."})).json()
        deleted = await a.client.delete(f"/v1/jobs/{job['id']}")
        after = await a.client.get(f"/v1/jobs/{job['id']}")
        left = [k for k in await a.keys() if job["id"].encode() in k]
        return deleted, after, left

    deleted, after, left = api(scenario)
    assert deleted.status_code == 202 and deleted.json()["status"] == "cancelled"
    assert after.status_code == 404 and left == []


def test_the_events_of_an_ended_job_are_replayed_and_the_stream_ends(api):
    async def scenario(a):
        job = (await a.client.post("/v1/jobs", json={"text": "Hello there."})).json()
        from jobs.store import JobStore

        await JobStore.for_settings(a.redis, a.settings).fail(job["id"], "a reason")
        r = await a.client.get(f"/v1/jobs/{job['id']}/events")
        return r

    r = api(scenario)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [line.split(": ", 1)[1] for line in r.text.splitlines() if line.startswith("event: ")]
    data = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    assert events == ["queued", "failed"] and data[-1] == {"error": "a reason"}


def test_models_lists_the_served_models_and_their_readiness(api):
    async def scenario(a):
        return await a.client.get("/v1/models")

    r = api(scenario)
    assert r.status_code == 200
    (tiny,) = r.json()
    assert tiny["name"] == "tiny" and tiny["kind"] == "two-stage" and tiny["ready"] is False
    assert tiny["workers"] == {"ar": 0, "decoder": 0} and tiny["default"] is True


def test_the_error_table_gives_the_most_specific_status():
    assert STATUS[InvalidRequest] == 422
    assert status_of(TooLarge("x")) == 413 and status_of(InvalidEventId("x")) == 400
    assert status_of(JobNotFound("x")) == 404 and status_of(NotReady("x")) == 409
    assert status_of(InvalidRequest("x")) == 422


def test_a_compressed_format_keeps_its_bitrate_tags_and_a_rate_its_codec_takes(api):
    async def scenario(a):
        body = {"text": "Hi there.", "format": "AAC", "bitrate_kbps": 48, "author": "Ann", "year": 2026}
        made = await a.client.post("/v1/jobs", json=body)
        assert made.status_code == 202, made.text
        aac = await a.client.get(f"/v1/jobs/{made.json()['id']}")
        made = await a.client.post("/v1/jobs", json={"text": "Hi there.", "format": "opus"})
        opus = await a.client.get(f"/v1/jobs/{made.json()['id']}")
        return aac, opus

    aac, opus = api(scenario)
    job = aac.json()
    assert (job["format"], job["bitrate_kbps"], job["author"], job["narrator"]) == ("m4a", 48, "Ann", job["voice"])
    assert opus.json()["sample_rate"] in (16_000, 24_000, 48_000)  # the model's if Opus takes it, else 48 kHz


def test_a_cover_is_kept_for_the_finalize_as_its_bytes(api, tmp_path):
    from fleet.names import JobObjects
    from tests.jobs.test_encoding import picture

    png = picture()

    async def scenario(a):
        made = await a.client.post("/v1/jobs", json={"text": "Hi there.", "format": "m4b", "cover": b64(png)})
        assert made.status_code == 202, made.text
        job = await a.client.get(f"/v1/jobs/{made.json()['id']}")
        return job.json(), a.settings

    job, settings = api(scenario)
    stored = settings.storage_dir / JobObjects(job["tenant"], job["id"]).cover
    assert stored.read_bytes() == png


def test_a_filtered_list_holds_at_most_limit_jobs_and_its_cursor_skips_none(api):
    async def scenario(a):
        ids = [(await a.client.post("/v1/jobs", json={"text": f"Hi there {i}."})).json()["id"] for i in range(6)]
        every = [j["id"] for j in (await a.client.get("/v1/jobs", params={"limit": 100})).json()["jobs"]]
        # the second newest and one further down end up in another state
        for job_id in (every[1], every[4]):
            await a.redis.hset(Names("t").job(job_id), "status", "failed")
        walks = {}
        for limit in (1, 2, 3):
            pages, cursor = [], None
            while True:
                params = {"status": "queued", "limit": limit} | ({"cursor": cursor} if cursor else {})
                r = await a.client.get("/v1/jobs", params=params)
                assert r.status_code == 200, r.text
                pages.append([j["id"] for j in r.json()["jobs"]])
                cursor = r.json()["next_cursor"]
                if cursor is None or len(pages) > 10:
                    break
            walks[limit] = pages
        return ids, every, walks

    ids, every, walks = api(scenario)
    assert sorted(every) == sorted(ids)
    queued = [job_id for i, job_id in enumerate(every) if i not in (1, 4)]
    for limit, pages in walks.items():
        assert all(len(page) <= limit for page in pages), (limit, pages)
        assert [job_id for page in pages for job_id in page] == queued, (limit, pages)
    assert walks[2][0] == [every[0], every[2]]


@pytest.mark.parametrize("cursor", ["nan:x", "NaN:x", "inf:x", "-inf:x", "infinity:x", "not-a-number:x"])
def test_a_cursor_that_is_no_finite_time_is_a_422(api, cursor):
    async def scenario(a):
        await a.client.post("/v1/jobs", json={"text": "Hi there."})
        return await a.client.get("/v1/jobs", params={"cursor": cursor})

    r = api(scenario)
    assert r.status_code == 422 and "is not a cursor of this API" in r.json()["detail"], r.text
