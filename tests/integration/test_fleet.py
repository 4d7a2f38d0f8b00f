"""The fleet end to end: API and every worker as real processes, a real Redis, real HTTP and SSE."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import redis

from fleet.names import Names
from jobs.audio import Pauses
from jobs.segmentation import plan_text
from jobs.service import JobRequest, validate
from testing.fleetkit import (
    BOOK,
    SSEStream,
    download,
    offline_segment_audio,
    read_sse,
    start_fleet,
    submit,
    wait_done,
    wait_until,
)
from testing.fleetkit import manifest as fleetkit_manifest

pytestmark = pytest.mark.integration


def _running_fleet(redis_url: str, data_dir, log_dir, **overrides):
    from fleet.settings import Settings
    from testing.fleetkit import delete_prefix

    prefix = f"itest-{int(time.time() * 1000) % 10**9}"
    settings = Settings(
        redis_url=redis_url,
        key_prefix=prefix,
        data_dir=data_dir,
        max_text_chars=20_000,
        sse_ping_s=1,
        block_ms=200,
        reclaim_idle_ms=10_000,
        **overrides,
    )
    running = start_fleet(settings, log_dir)
    yield running
    running.stop()
    delete_prefix(redis_url, prefix, settings.rq_redis_url)


@pytest.fixture(scope="module")
def fleet(redis_url, data_dir, tiny_dir, tmp_path_factory):
    yield from _running_fleet(redis_url, data_dir, tmp_path_factory.mktemp("fleet-logs"))


@pytest.fixture(scope="module")
def cluster_fleet(valkey_cluster, redis_url, data_dir, tiny_dir, tmp_path_factory):
    """The same fleet on a Valkey Cluster, RQ on the machine's Redis; three task shards, so that the
    AR worker reads streams of three slots."""
    log_dir = tmp_path_factory.mktemp("cluster-fleet-logs")
    yield from _running_fleet(valkey_cluster.url, data_dir, log_dir, rq_redis_url=redis_url, task_shards=3)


@pytest.fixture
def raw_redis(fleet):
    r = redis.Redis.from_url(fleet.settings.redis_url)
    yield r
    r.close()


@pytest.mark.parametrize("where", ["server", "cluster"])
def test_a_book_end_to_end(where, request):
    import contextlib

    from testing.fleetkit import connect

    fleet = request.getfixturevalue("fleet" if where == "server" else "cluster_fleet")
    with fleet.client() as client, contextlib.closing(connect(fleet.settings.redis_url)) as raw_redis:
        _a_book_end_to_end(fleet, client, raw_redis)


_REFERENCES: dict[tuple[str, ...], list] = {}


def _a_book_end_to_end(fleet, client, raw_redis):
    accepted = submit(client, text=BOOK, title="The Lighthouse", voice="leo")
    job_id = accepted["id"]
    plan = plan_text(BOOK)
    assert accepted["segments_total"] == len(plan.segments) == 51 and accepted["chapters"] == 3
    links = accepted["links"]
    assert links["self"] == f"/v1/jobs/{job_id}"
    assert links["events"].startswith(f"/v1/jobs/{job_id}/events?token=")  # signed: usable without a key
    assert links["audio"].startswith(f"/v1/jobs/{job_id}/audio?token=")

    events = list(read_sse(client, accepted["links"]["events"]))
    kinds = [e.event for e in events]
    assert kinds[0] == "queued" and kinds[-1] == "done", kinds
    assert "started" in kinds and "progress" in kinds
    segments = [json.loads(e.data) for e in events if e.event == "segment"]
    assert sorted(s["index"] for s in segments) == list(range(51))  # each segment reported once
    assert all(e.id for e in events) and len({e.id for e in events}) == len(events)
    done = json.loads(events[-1].data)
    assert done["audio_url"] == f"/v1/jobs/{job_id}/audio"

    status = client.get(f"/v1/jobs/{job_id}").json()
    assert status["status"] == "done" and status["segments_done"] == 51 and status["error"] is None
    assert status["audio_seconds"] == pytest.approx(sum(s["duration_s"] for s in segments), abs=1e-3)

    audio, rate = download(client, job_id)
    assert rate == 24000 and audio.dtype == np.int16 and audio.ndim == 1
    s = fleet.settings
    pauses = Pauses(s.sentence_pause_ms, s.paragraph_pause_ms, s.chapter_pause_ms)
    seg_samples = {x["index"]: round(x["duration_s"] * rate) for x in segments}
    expected = sum(seg_samples.values()) + sum(pauses.samples(x.pause_after, rate) for x in plan.segments)
    assert audio.shape[0] == expected  # the segments plus the pauses, nothing else
    assert status["duration_s"] == pytest.approx(expected / rate)

    # every segment's audio is there, once, in order: compare each slice to an offline decode
    # what the engine was given: the plan as the fleet made it (numbers and abbreviations as words)
    _, spoken = validate(JobRequest(text=BOOK, voice="leo"), s)
    texts = tuple(x.spoken_text for x in spoken.segments)
    if texts not in _REFERENCES:  # the same for either Redis: decoded once
        _REFERENCES[texts] = offline_segment_audio(s, list(texts), "leo")
    reference = _REFERENCES[texts]
    position = 0
    for seg, ref in zip(plan.segments, reference, strict=True):
        piece = audio[position : position + ref.shape[0]]
        assert ref.shape[0] == seg_samples[seg.index] > 0
        assert np.max(np.abs(piece.astype(np.int32) - ref)) <= 2, f"segment {seg.index} differs"
        position += ref.shape[0]
        gap = pauses.samples(seg.pause_after, rate)
        assert not audio[position : position + gap].any()  # the pause is silence
        position += gap
    assert position == audio.shape[0]

    # nothing of the job is left in flight: streams drained, deltas gone, parts deleted
    names = Names(s.key_prefix)
    assert all(raw_redis.xlen(names.tasks("tiny", shard)) == 0 for shard in range(s.task_shards))
    assert all(raw_redis.xlen(names.codes("tiny", shard)) == 0 for shard in range(s.task_shards))
    assert all(raw_redis.xlen(names.audio(shard)) == 0 for shard in range(s.task_shards))
    assert raw_redis.keys(f"{names.job(job_id)}:deltas:*") == [] and not raw_redis.exists(
        names.scratch_keys(job_id)
    )
    assert not (s.storage_dir / "parts" / job_id).exists()
    manifest = fleetkit_manifest(s, job_id)
    assert [c["title"] for c in manifest["chapters"]] == [
        "Chapter One: The Harbour",
        "Chapter Two: The Letter",
        "Chapter Three: The Light",
    ]
    assert manifest["samples"] == expected


def test_sse_resume_with_last_event_id(fleet, client):
    job_id = submit(client, text=BOOK.split("# Chapter Three")[0], voice="mia")["id"]
    url = f"/v1/jobs/{job_id}/events"
    first_part = SSEStream()
    for _ in read_sse(client, url, stop_after=6, record=first_part):
        pass  # then the client goes away
    last_id = first_part.events[-1].id
    second_part = SSEStream()
    for _ in read_sse(client, url, last_event_id=last_id, record=second_part):
        pass
    assert second_part.events[-1].event == "done"
    replay = SSEStream()
    for _ in read_sse(client, url, record=replay):  # after the end: the whole history, then the stream closes
        pass
    resumed = first_part.events + second_part.events
    assert [e.id for e in resumed] == [e.id for e in replay.events]  # nothing lost, nothing repeated
    assert [(e.event, e.data) for e in resumed] == [(e.event, e.data) for e in replay.events]
    # resuming with the query parameter works the same; keep-alive pings are comments without an id
    tail = list(read_sse(client, f"{url}?after={resumed[-3].id}"))
    assert [e.id for e in tail] == [e.id for e in resumed[-2:]]
    assert any("ping" in c for c in first_part.comments + second_part.comments)


EIGHT_JOBS = [
    dict(text="# Alpha\n\nThe first job speaks. It has three sentences. This is the last.", voice="tara"),
    dict(text="# Beta\n\nA different text in another voice. Short again.", voice="leah"),
    dict(text="# Gamma\n\nSame words as another job. Same words as another job.", voice="jess", seed=7),
    dict(
        text="# Delta\n\nThe fourth one is longer than the others, with a comma, and a clause; it goes on. Done.",
        voice="leo",
    ),
    dict(text="Same words as another job. A fifth voice.", voice="dan"),
    dict(text="# Zeta\n\nSix.\n\n# Eta\n\nTwo chapters in one small job.", voice="mia"),
    dict(text="Seven sentences? No, two. The gulls said so.", voice="zac", seed=3),
    dict(text="The last job, in the eighth voice.", voice="zoe"),
]


def test_eight_concurrent_jobs_in_eight_voices_have_no_crosstalk(fleet, client):
    """I4/I5: eight jobs at once through one AR engine (one worker, continuous batching) and one
    decoder; each job's file is byte-identical to the same job run alone."""
    assert len({j["voice"] for j in EIGHT_JOBS}) == 8
    together = [submit(client, **j)["id"] for j in EIGHT_JOBS]
    for job_id in together:
        assert wait_done(client, job_id)["status"] == "done"
    concurrent_audio = [download(client, job_id)[0] for job_id in together]
    for spec, mixed in zip(EIGHT_JOBS, concurrent_audio, strict=True):
        alone_id = submit(client, **spec)["id"]
        assert wait_done(client, alone_id)["status"] == "done"
        alone, _ = download(client, alone_id)
        np.testing.assert_array_equal(mixed, alone)
    assert len({a.tobytes() for a in concurrent_audio}) == 8


def _queue_state(r: redis.Redis, names: Names) -> tuple:
    return (r.xlen(names.tasks("tiny")), r.zcard(names.jobs_index()))


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        ({"text": ""}, 422, "text is empty"),
        ({"text": "  \n\t "}, 422, "text is empty"),
        ({"text": "x" * 20_001}, 413, "at most 20,000"),
        ({"text": "Hi.", "model": "nope"}, 422, "unknown model 'nope'"),
        ({"text": "Hi.", "voice": "nobody"}, 422, "unknown voice 'nobody'"),
        ({"text": "Hi.", "format": "mp4"}, 422, "unsupported format 'mp4'"),
        ({"text": "Hi.", "sample_rate": 12345}, 422, "unsupported sample rate 12345"),
        ({"text": "Hi.", "rate": 200}, 422, "model 'tiny' has no rate or pitch settings"),
        ({"text": "```\nonly code\n```"}, 422, "nothing to narrate"),
        ({"words": "Hi."}, 422, "words: Extra inputs are not permitted"),
        ({"text": 5}, 422, "text"),
    ],
)
def test_bad_requests_are_refused_and_enqueue_nothing(fleet, client, raw_redis, body, status, message):
    names = Names(fleet.settings.key_prefix)
    before = _queue_state(raw_redis, names)
    response = client.post("/v1/jobs", json=body)
    assert response.status_code == status, response.text
    assert message in response.json()["detail"]
    assert _queue_state(raw_redis, names) == before


def test_malformed_json_and_unknown_jobs(fleet, client, raw_redis):
    names = Names(fleet.settings.key_prefix)
    before = _queue_state(raw_redis, names)
    response = client.post(
        "/v1/jobs", content=b'{"text": "unterminated', headers={"content-type": "application/json"}
    )
    assert response.status_code == 400 and "not valid JSON" in response.json()["detail"]
    assert _queue_state(raw_redis, names) == before
    for method, path in [("GET", ""), ("DELETE", ""), ("GET", "/events"), ("GET", "/audio")]:
        response = client.request(method, f"/v1/jobs/0123456789abcdef{path}")
        assert response.status_code == 404 and "no job" in response.json()["detail"]
    job_id = submit(client, text="One short line.")["id"]
    assert client.get(f"/v1/jobs/{job_id}/events", headers={"Last-Event-ID": "garbage"}).status_code == 400
    wait_done(client, job_id)


def test_cancel_drops_queued_segments_and_stops_work(fleet, client, raw_redis):
    names = Names(fleet.settings.key_prefix)
    long_text = "\n\n".join(
        f"Paragraph {i} begins here. It has a second sentence, which is longer than the first."
        for i in range(60)
    )
    job_id = submit(client, text=long_text)["id"]
    for event in read_sse(client, f"/v1/jobs/{job_id}/events"):
        if event.event == "segment":
            break
    response = client.delete(f"/v1/jobs/{job_id}")
    assert response.status_code == 202 and response.json()["status"] == "cancelled"
    assert client.delete(f"/v1/jobs/{job_id}").status_code == 404  # deleted: the job is unknown now
    assert client.get(f"/v1/jobs/{job_id}/audio").status_code == 404

    # queued segments are dropped without work, in-flight ones aborted: the task stream drains, no new
    # attempt starts (it would re-create the attempts hash), nothing more is assembled or stored
    deadline = time.monotonic() + 30
    while raw_redis.xlen(names.tasks("tiny")) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert raw_redis.xlen(names.tasks("tiny")) == 0
    time.sleep(2.5)
    assert raw_redis.keys(f"{names.job(job_id)}*") == []
    assert not list((fleet.settings.storage_dir / "parts" / job_id).glob("*"))  # its audio left storage


def test_health_models_and_openapi(client):
    assert client.get("/health").json() == {"status": "ok"}
    # the fleet's AR worker and decoder heartbeat: the two-stage model is ready once both have started
    # (run first, this test meets them still loading)
    wait_until(lambda: client.get("/v1/models").json()[0]["ready"], 60, "the workers' heartbeats")
    models = client.get("/v1/models").json()
    assert models[0]["name"] == "tiny" and "tara" in models[0]["voices"] and models[0]["default"]
    assert models[0]["kind"] == "two-stage" and models[0]["workers"] == {"ar": 1, "decoder": 1}
    assert models[0]["ready"]
    spec = client.get("/openapi.json").json()
    assert {"/v1/jobs", "/v1/jobs/{job_id}", "/v1/jobs/{job_id}/events", "/v1/jobs/{job_id}/audio"} <= set(
        spec["paths"]
    )
    assert client.get("/docs").status_code == 200
