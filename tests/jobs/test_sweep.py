"""The sweep (jobs/sweep.py) on fakeredis, with RQ's real code on the same fake server: lost
finalizes are queued again, ones RQ gave up on and ones past every deadline fail their job, jobs no
longer finalizing leave the set, expired jobs leave the index, and one sweeper runs per interval."""

from __future__ import annotations

import asyncio
import time

import fakeredis
import pytest
from rq.job import Job as RQJob

from fleet.names import Names
from fleet.settings import Settings
from fleet.storage import LocalStorage, StorageError
from jobs.finalize import enqueue_finalize, finalize_rq_id
from jobs.model import JobStatus
from jobs.service import JobRequest, submit
from jobs.store import JobStore
from jobs.sweep import Sweeper


@pytest.fixture
def sweep(tmp_path):
    settings = Settings(redis_url="redis://unused", key_prefix="t", data_dir=tmp_path, sweep_interval_s=10)
    server = fakeredis.FakeServer()
    aio, rq = fakeredis.FakeAsyncRedis(server=server), fakeredis.FakeRedis(server=server)
    store = JobStore(aio, Names("t"), events_maxlen=1000, result_ttl_s=settings.result_ttl_s)
    return settings, store, LocalStorage(tmp_path / "storage"), rq


async def finalizing_job(store, settings, marked_ago: float) -> str:
    job = await submit(store, settings, JobRequest(text="One."))
    await store.redis.hset(store.names.job(job.id), "status", "finalizing")
    await store.redis.zadd(store.names.finalizing(), {job.id: time.time() - marked_ago})
    return job.id


def test_a_lost_finalize_is_queued_again(sweep):
    settings, store, storage, rq = sweep

    async def main():
        lost = await finalizing_job(store, settings, marked_ago=60)
        recent = await finalizing_job(store, settings, marked_ago=1)  # within the interval: not yet
        report = await Sweeper(settings, store, storage, rq, "me").sweep()
        return lost, recent, report

    lost, recent, report = asyncio.run(main())
    assert report.requeued == [lost] and report.failed == []
    assert RQJob.exists(finalize_rq_id(settings, lost), connection=rq)
    assert not RQJob.exists(finalize_rq_id(settings, recent), connection=rq)


def test_a_finalize_rq_gave_up_on_fails_its_job(sweep):
    settings, store, storage, rq = sweep

    async def main():
        job_id = await finalizing_job(store, settings, marked_ago=60)
        enqueue_finalize(settings, job_id, rq)
        rq_job = RQJob.fetch(finalize_rq_id(settings, job_id), connection=rq)
        from rq.job import JobStatus as RQStatus

        rq_job.set_status(RQStatus.FAILED)
        report = await Sweeper(settings, store, storage, rq, "me").sweep()
        return job_id, report, await store.get(job_id), await store.redis.zcard(store.names.finalizing())

    job_id, report, job, marked = asyncio.run(main())
    assert report.failed == [job_id] and job.status == JobStatus.FAILED
    assert job.error.startswith("finalizing failed: ") and marked == 0


def test_a_finalize_past_every_deadline_fails_its_job_and_ended_jobs_leave_the_set(sweep):
    settings, store, storage, rq = sweep

    async def main():
        sweeper = Sweeper(settings, store, storage, rq, "me")
        stuck = await finalizing_job(store, settings, marked_ago=sweeper.finalize_deadline_s() + 1)
        enqueue_finalize(settings, stuck, rq)  # queued (or running) all along
        ended = await finalizing_job(store, settings, marked_ago=60)
        await store.redis.hset(store.names.job(ended), "status", "done")
        report = await sweeper.sweep()
        return stuck, report, await store.get(stuck), await store.redis.zcard(store.names.finalizing())

    stuck, report, job, marked = asyncio.run(main())
    assert report.failed == [stuck] and "did not finish within" in job.error and marked == 0


def test_expired_jobs_leave_the_indexes_and_storage(sweep):
    settings, store, storage, rq = sweep

    async def main():
        old = await submit(store, settings, JobRequest(text="Old."))
        kept = await submit(store, settings, JobRequest(text="Kept."))
        n = store.names
        long_ago = time.time() - settings.result_ttl_s - 10
        for index in (n.jobs_index(), n.tenant_jobs("default")):
            await store.redis.zadd(index, {old.id: long_ago, kept.id: long_ago})
        await store.redis.delete(*n.job_keys(old.id))  # its keys expired
        objects = [
            old.objects.audio("wav"),
            old.objects.manifest,
            old.objects.part(0, 1),
            kept.objects.audio("wav"),
        ]
        for key in objects:
            storage.put_bytes(key, b"x")
        report = await Sweeper(settings, store, storage, rq, "me").sweep()
        indexes = [await store.redis.zrange(i, 0, -1) for i in (n.jobs_index(), n.tenant_jobs("default"))]
        active = await store.redis.smembers(n.tenant_active("default"))
        return old.id, kept.id, report, indexes, active, objects

    old, kept, report, indexes, active, objects = asyncio.run(main())
    assert report.expired == 1 and indexes == [[kept.encode()], [kept.encode()]]
    assert active == {kept.encode()}  # the expired job's slot went with it
    assert [storage.exists(k) for k in objects] == [
        False,
        False,
        False,
        True,
    ]  # retention = the keys' lifetime


def test_an_expired_job_whose_files_could_not_be_deleted_stays_listed_for_the_next_sweep(sweep):
    settings, store, storage, rq = sweep

    class Flaky(LocalStorage):
        failures = 1

        def delete_prefix(self, prefix):
            if self.failures:
                self.failures -= 1
                raise StorageError("503 SlowDown")
            return super().delete_prefix(prefix)

    flaky = Flaky(storage.root)

    async def main():
        old = await submit(store, settings, JobRequest(text="Old."))
        n = store.names
        for index in (n.jobs_index(), n.tenant_jobs("default")):
            await store.redis.zadd(index, {old.id: time.time() - settings.result_ttl_s - 10})
        await store.redis.delete(*n.job_keys(old.id))  # its keys expired
        flaky.put_bytes(old.objects.audio("wav"), b"x")
        first = await Sweeper(settings, store, flaky, rq, "me").sweep()
        listed = await store.redis.zrange(n.jobs_index(), 0, -1)
        second = await Sweeper(settings, store, flaky, rq, "me").sweep()
        return old, first, listed, second, await store.redis.zrange(n.jobs_index(), 0, -1)

    old, first, listed, second, after = asyncio.run(main())
    assert (first.expired, listed) == (0, [old.id.encode()])  # forgotten first, its files stayed for good
    assert (second.expired, after, flaky.exists(old.objects.audio("wav"))) == (1, [], False)


def test_one_sweeper_per_interval(sweep):
    settings, store, storage, rq = sweep

    async def main():
        first = await Sweeper(settings, store, storage, rq, "a").run_once()
        second = await Sweeper(settings, store, storage, rq, "b").run_once()
        return first, second

    first, second = asyncio.run(main())
    assert first is not None and second is None


def test_dead_consumers_leave_their_groups_but_never_with_entries(redis_url, key_prefix, tmp_path):
    """On a real Redis (consumer idle times): a consumer that holds nothing and has not read for
    ``consumer_forget_s`` goes; one that still holds an entry stays (deleting it would drop it). On
    the last shard's audio stream: the sweep goes over every shard."""
    import redis.asyncio as aioredis

    settings = Settings(
        redis_url=redis_url, key_prefix=key_prefix, data_dir=tmp_path, consumer_forget_s=0.2, task_shards=2
    )
    storage = LocalStorage(tmp_path / "storage")

    async def main():
        client = aioredis.from_url(redis_url)
        store = JobStore.for_settings(client, settings)
        stream = store.names.audio(1)
        await client.xgroup_create(stream, "assembler", id="0", mkstream=True)
        for x in (b"1", b"2", b"3"):
            await client.xadd(stream, {b"x": x})
        await client.xreadgroup("assembler", "holder", {stream: ">"}, count=1)  # holds the entry
        for name in (b"dead", b"live"):
            if name == b"live":
                await asyncio.sleep(0.4)  # "dead" has done nothing since
            ((_, [(entry_id, _)]),) = await client.xreadgroup("assembler", name, {stream: ">"}, count=1)
            await client.xack(stream, "assembler", entry_id)
        report = await Sweeper(settings, store, storage, None, "me").sweep()
        left = sorted(c["name"] for c in await client.xinfo_consumers(stream, "assembler"))
        await client.aclose()
        return report, left

    report, left = asyncio.run(main())
    assert report.consumers_forgotten == 1 and left == [b"holder", b"live"]
