"""The finalizer when the job changes under it: a delete while it stitches leaves nothing behind; a
second run of a job already done keeps the file; a second copy of the last segment keeps the part;
an ended job's delta hashes expire with it (fakeredis with Lua: the production scripts)."""

from __future__ import annotations

import asyncio

import fakeredis
import numpy as np
import pytest

from fleet.messages import AudioChunk
from fleet.names import Names
from fleet.settings import Settings
from fleet.storage import LocalStorage
from jobs.finalize import Finalizer
from jobs.model import JobStatus
from jobs.service import JobRequest, tasks_for, validate
from jobs.store import JobStore


class RacedStore(JobStore):
    """A store where ``before_finish`` runs just before the finalizer's finish (another client's move)."""

    before_finish = None

    async def finish(self, job_id: str, *args) -> bool:
        await self.before_finish(job_id)
        return await super().finish(job_id, *args)


def finalizing_job(tmp_path):
    settings = Settings(redis_url="redis://unused", key_prefix="t", data_dir=tmp_path)
    store = RacedStore(fakeredis.FakeAsyncRedis(), Names("t"), events_maxlen=1000, result_ttl_s=60)
    storage = LocalStorage(tmp_path / "storage")
    job, plan = validate(JobRequest(text="One. Two."), settings)

    async def setup():
        await store.create(job, plan, tasks_for(job, plan))
        for segment in (0, 1):
            attempt = await store.start_segment(job.id, segment)
            pcm = np.full(480, segment + 1, "<i2").tobytes()
            assert (
                await store.add_delta(AudioChunk(job.id, segment, attempt, 0, True, 24000, pcm)) == "complete"
            )
            storage.put_bytes(job.objects.part(segment, attempt), pcm)
            await store.segment_done(job.id, segment, attempt, 480, 0.02)
        assert (await store.get(job.id)).status == JobStatus.FINALIZING

    asyncio.run(setup())
    return settings, store, storage, job


def test_a_job_deleted_while_it_is_stitched_leaves_no_file_and_no_key(tmp_path):
    settings, store, storage, job = finalizing_job(tmp_path)

    async def delete(job_id):  # what DELETE does: cancel, then purge the keys
        await store.cancel(job_id)
        await store.purge(job)

    store.before_finish = delete
    assert asyncio.run(Finalizer(settings, store, storage).run(job.id)) == "skipped"
    assert asyncio.run(store.redis.keys(f"*{job.id}*")) == []  # finish did not re-create the job hash
    assert not storage.exists(job.objects.audio("wav")) and not storage.exists(job.objects.manifest)


def test_a_second_finalize_of_a_done_job_keeps_its_file(tmp_path):
    settings, store, storage, job = finalizing_job(tmp_path)

    async def first_run_finishes(job_id):
        store.before_finish = _noop
        assert await store.finish(job_id, job.objects.audio("wav"), 1.0, "/x")

    store.before_finish = first_run_finishes
    assert asyncio.run(Finalizer(settings, store, storage).run(job.id)) == "skipped"
    got = asyncio.run(store.get(job.id))
    assert got.status == JobStatus.DONE and got.audio_key == job.objects.audio("wav")
    assert storage.exists(job.objects.audio("wav")) and storage.exists(job.objects.manifest)


async def _noop(_job_id):
    return None


def test_forgetting_a_finalize_that_ends_meanwhile_is_not_an_error(redis_url, key_prefix, monkeypatch):
    """A finalize that succeeds between RQ's fetch and its delete discards its own record (CI,
    2026-12-04: the speech API's job deletion failed with InvalidJobOperation and left the job)."""
    import redis
    from rq import Queue
    from rq.job import Job as RQJob

    from jobs.finalize import finalize_rq_id, forget_finalize

    settings = Settings(redis_url=redis_url, key_prefix=key_prefix)
    connection = redis.Redis.from_url(redis_url)
    rq_id = finalize_rq_id(settings, "job1")
    Queue(f"{key_prefix}-q", connection=connection).enqueue_call("builtins.len", args=([],), job_id=rq_id)
    fetch = RQJob.fetch

    def fetch_then_finish(job_id, connection):
        job = fetch(job_id, connection=connection)
        connection.delete(job.key)  # the worker: "result discarded immediately"
        return job

    monkeypatch.setattr(RQJob, "fetch", staticmethod(fetch_then_finish))
    forget_finalize(settings, "job1", connection)
    assert not RQJob.exists(rq_id, connection=connection)
    connection.close()


def test_a_second_copy_of_the_last_segment_keeps_the_part_it_shares_with_the_winner(tmp_path):
    """Two assemblers held the same final chunk of the last segment: the first recorded it (the job
    is finalizing), then the second's SEGMENT_DONE. It must hear that its attempt won, or it deletes
    the part the finalize reads (the book then fails on every try)."""
    settings, store, storage, job = finalizing_job(tmp_path)

    async def again():
        attempt = int(await store.redis.hget(store.names.attempts(job.id), 1))
        same = await store.segment_done(job.id, 1, attempt, 480, 0.02)
        other = await store.segment_done(job.id, 1, attempt + 1, 480, 0.02)
        return attempt, same, other

    async def nobody(job_id):  # no other client moves the job
        pass

    store.before_finish = nobody
    attempt, same, other = asyncio.run(again())
    assert not same.applied and same.keeps_part_of(attempt)
    assert not other.keeps_part_of(attempt + 1)  # a losing attempt's part is still garbage
    assert asyncio.run(Finalizer(settings, store, storage).run(job.id)) == "done"


def test_an_ended_jobs_delta_hashes_expire_with_it_though_its_ender_dies_before_clearing_them(tmp_path):
    """END_JOB expires the delta hashes the scratch set lists: clear_scratch, the call after it, may
    never come (its process killed), and a second END_JOB does nothing for an ended job."""
    settings = Settings(redis_url="redis://unused", key_prefix="t", data_dir=tmp_path)
    store = JobStore(fakeredis.FakeAsyncRedis(), Names("t"), events_maxlen=1000, result_ttl_s=60)
    job, plan = validate(JobRequest(text="One. Two."), settings)

    async def main():
        await store.create(job, plan, tasks_for(job, plan))
        attempt = await store.start_segment(job.id, 0)
        chunk = AudioChunk(job.id, 0, attempt, 0, False, 24000, np.full(480, 7, "<i2").tobytes())
        assert await store.add_delta(chunk) == "partial"

        async def killed(job_id):
            raise RuntimeError("killed before clear_scratch")

        store.clear_scratch = killed
        with pytest.raises(RuntimeError, match="killed before clear_scratch"):
            await store.cancel(job.id)
        return await store.redis.ttl(store.names.deltas(job.id, 0, attempt))

    assert 0 < asyncio.run(main()) <= 60
