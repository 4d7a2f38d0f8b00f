"""The fleet's state as metrics, read from Redis at scrape time (jobs/metrics.py): jobs by state, job
endings, stage streams, admission queues, dead letters, live workers, the finalize queue. fakeredis
with the production scripts; the families are rendered and read back with prometheus-client's parser."""

from __future__ import annotations

import asyncio
import socket
import time
from dataclasses import replace

import fakeredis
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from fleet import readiness
from fleet.messages import AudioChunk
from fleet.names import Names
from fleet.settings import Settings
from jobs.metrics import Families, fleet_metrics
from jobs.service import JobRequest, enqueue, submit, validate
from jobs.store import JobStore


def settings(tmp_path, **overrides) -> Settings:
    values = dict(redis_url="redis://unused", key_prefix="t", data_dir=tmp_path, models="tiny,espeak")
    return Settings(**{**values, **overrides})


def scrape(store, s, rq=None) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value, as Prometheus would read the rendered text."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(Families(asyncio.run(fleet_metrics(store, s, rq or fakeredis.FakeRedis()))))
    text = generate_latest(registry).decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_jobs_by_state_endings_streams_queues_and_workers(tmp_path):
    s = settings(tmp_path)
    redis = fakeredis.FakeAsyncRedis()
    names = Names("t")
    store = JobStore(redis, names, events_maxlen=1000, result_ttl_s=60)

    async def setup():
        queued = await submit(store, s, JobRequest(text="One. Two. Three."))
        running = await submit(store, s, JobRequest(text="Four. Five."))
        await store.start_segment(running.id, 0)
        ended = await submit(store, s, JobRequest(text="Six."))
        await store.cancel(ended.id)
        failed, plan = validate(JobRequest(text="Seven.", model="espeak"), s)
        await enqueue(store, replace(failed, tenant="other"), plan)  # another tenant's
        await store.fail(failed.id, "broken")
        # a task admitted and delivered to an AR worker (pending), an audio chunk waiting
        await store.scheduler.admit("tiny", 1)
        tasks = names.tasks("tiny")
        await redis.xgroup_create(tasks, "ar", id="0", mkstream=True)
        await redis.xreadgroup("ar", "ar-1", {tasks: ">"}, count=1)
        await redis.xadd(names.audio(), AudioChunk(running.id, 0, 1, 0, False, 24000, b"\0\0").encode())
        await redis.xadd(names.dead_letters(), {"h": b"{}"})
        await readiness.beat(redis, names, "ar", ["tiny"], "ar-1", s.heartbeat_s)
        await readiness.beat(redis, names, "speech", ["espeak"], "speech-1", s.heartbeat_s)
        await readiness.beat(redis, names, "speech", ["espeak"], "speech-2", s.heartbeat_s)
        return queued, running

    queued, running = asyncio.run(setup())
    rq = fakeredis.FakeRedis()  # RQ's own Redis (on a cluster, another server than the fleet's)
    rq.rpush("rq:queue:t-finalize", "job-a", "job-b")
    m = scrape(store, s, rq)
    assert m[("narrate_redis_up", ())] == 1
    jobs = {state: m[("narrate_jobs", (("state", state),))] for state in ("queued", "running", "finalizing")}
    assert jobs == {"queued": 1, "running": 1, "finalizing": 0}
    ended = {st: m[("narrate_jobs_ended_total", (("state", st),))] for st in ("done", "failed", "cancelled")}
    assert ended == {"done": 0, "failed": 1, "cancelled": 1}
    # 3 + 2 tasks queued for tiny (interactive jobs), one admitted to the stream and delivered
    assert m[("narrate_stream_length", (("model", "tiny"), ("stream", "tasks")))] == 1
    assert m[("narrate_stream_pending", (("group", "ar"), ("model", "tiny"), ("stream", "tasks")))] == 1
    assert m[("narrate_tasks_queued", (("model", "tiny"), ("priority", "interactive")))] == 4
    assert m[("narrate_tasks_queued", (("model", "tiny"), ("priority", "batch")))] == 0
    assert m[("narrate_stream_length", (("model", ""), ("stream", "audio")))] == 1
    assert m[("narrate_stream_pending", (("group", "assembler"), ("model", ""), ("stream", "audio")))] == 0
    assert m[("narrate_stream_length", (("model", "tiny"), ("stream", "codes")))] == 0
    assert ("narrate_stream_length", (("model", "espeak"), ("stream", "codes"))) not in m  # single-stage
    assert m[("narrate_stream_length", (("model", ""), ("stream", "dead")))] == 1
    assert m[("narrate_workers_live", (("model", "tiny"), ("stage", "ar")))] == 1
    assert m[("narrate_workers_live", (("model", "tiny"), ("stage", "decoder")))] == 0
    assert m[("narrate_workers_live", (("model", "espeak"), ("stage", "speech")))] == 2
    assert m[("narrate_finalize_queue_length", ())] == 2

    # values move: the running job finalizes, then is done; the queued one is cancelled
    async def later():
        await redis.hset(names.job(running.id), "status", "finalizing")
        await store.cancel(queued.id)

    asyncio.run(later())
    m = scrape(store, s)
    assert m[("narrate_jobs", (("state", "finalizing"),))] == 1
    assert m[("narrate_jobs", (("state", "queued"),))] == 0
    assert m[("narrate_jobs_ended_total", (("state", "cancelled"),))] == 2
    asyncio.run(store.finish(running.id, "key", 1.0, "/url"))
    m = scrape(store, s)
    assert m[("narrate_jobs_ended_total", (("state", "done"),))] == 1
    assert sum(m[("narrate_jobs", (("state", st),))] for st in ("queued", "running", "finalizing")) == 0


def test_shards_are_summed_and_a_dead_worker_is_not_live(tmp_path):
    s = settings(tmp_path, task_shards=2, models="tiny")
    redis = fakeredis.FakeAsyncRedis()
    names = Names("t")
    store = JobStore(redis, names, events_maxlen=1000, result_ttl_s=60, shards=2)

    async def setup():
        for shard in (0, 1):
            await redis.xadd(names.tasks("tiny", shard), {"h": b"{}"})
            for _ in range(shard + 1):  # 1 + 2 code chunks and audio chunks
                await redis.xadd(names.codes("tiny", shard), {"h": b"{}"})
                await redis.xadd(names.audio(shard), {"h": b"{}"})
        stale = time.time() - 10 * s.heartbeat_s  # heard from long ago: killed
        await redis.zadd(names.live_workers("ar", "tiny"), {"ar-dead": stale})

    asyncio.run(setup())
    m = scrape(store, s)
    assert m[("narrate_stream_length", (("model", "tiny"), ("stream", "tasks")))] == 2
    assert m[("narrate_stream_length", (("model", "tiny"), ("stream", "codes")))] == 3
    assert m[("narrate_stream_length", (("model", ""), ("stream", "audio")))] == 3
    assert m[("narrate_workers_live", (("model", "tiny"), ("stage", "ar")))] == 0


def test_redis_away_or_silent_is_reported_not_raised(tmp_path):
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff

    s = settings(tmp_path)
    silent = socket.create_server(("127.0.0.1", 0))  # takes connections, never answers
    try:
        for port, timeout_s in ((1, 5.0), (silent.getsockname()[1], 0.3)):  # nothing listens on port 1
            redis = aioredis.Redis(host="127.0.0.1", port=port, retry=Retry(NoBackoff(), 0))
            store = JobStore(redis, Names("t"), events_maxlen=1000, result_ttl_s=60)
            started = time.monotonic()
            families = asyncio.run(fleet_metrics(store, s, fakeredis.FakeRedis(), timeout_s=timeout_s))
            assert time.monotonic() - started < 3
            assert [(f.name, f.samples[0].value) for f in families][:1] == [("narrate_redis_up", 0)]
            assert [f.name for f in families] == ["narrate_redis_up", "narrate_fleet_read_seconds"]
    finally:
        silent.close()
