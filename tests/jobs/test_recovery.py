"""Recovery after lost writes (jobs/recovery.py) on the machine's real Redis: what a failover took from
a job is queued again, with the same seeds, and nothing else is; attempt numbers move ahead; a
finalizing job's finalize is queued again; nothing happens while the servers' run ids are known; an
attempt number is not handed out again after a counter was rolled back."""

from __future__ import annotations

import asyncio
import itertools
import json

import redis.asyncio as aioredis

from fleet.names import Names
from fleet.settings import Settings
from jobs import recovery
from jobs.model import JobStatus
from jobs.service import JobRequest, segment_task, submit
from jobs.store import JobStore

TEXT = " ".join(f"Sentence number {i} is here." for i in range(8))


async def _setup(redis_url: str, prefix: str):
    redis = aioredis.Redis.from_url(redis_url)
    settings = Settings(redis_url=redis_url, key_prefix=prefix, model="tiny")
    store = JobStore(redis, Names(prefix), events_maxlen=1000, result_ttl_s=3600)
    return redis, settings, store


def test_lost_segments_are_queued_again_and_nothing_else(redis_url, key_prefix):
    async def main():
        redis, settings, store = await _setup(redis_url, key_prefix)
        n = store.names
        try:
            job = await submit(store, settings, JobRequest(text=TEXT, model="tiny"))
            plan = await store.plan(job.id)
            assert len(plan.segments) == 8
            # segments 0-4 leave the admission queue (submission admitted 0; 1-4 as if admitted too)
            queue = f"{n.queues(job.model, job.shard)}:job:{job.id}"
            await redis.lpop(queue, 4)
            started = {}
            for segment in (0, 1, 2):
                started[segment] = await store.start_segment(job.id, segment)
                await store.segment_done(job.id, segment, started[segment], 100, 0.01)
            # the failover lost: segment 1's record and segment 3's task (4 is still in flight)
            await redis.hdel(n.done_segments(job.id), 1)
            await redis.set(n.server_runs(), json.dumps(["a-run-id-the-failover-replaced"]))

            finalized: list[str] = []

            async def finalize(job_id):
                finalized.append(job_id)

            report = await recovery.run(store, finalize)
            queued = await store.scheduler.queued_tasks(job.model, job.shard, job.id)
            attempts = {int(k): int(v) for k, v in (await redis.hgetall(n.attempts(job.id))).items()}
            again = await recovery.run(store, finalize)  # the new run ids are remembered now
            return plan, job, report, queued, attempts, again, finalized, started
        finally:
            await redis.aclose()

    plan, job, report, queued, attempts, again, finalized, started = asyncio.run(main())
    assert report is not None and report.jobs == 1 and report.segments_requeued == 3
    assert report.requeued_jobs == [job.id] and finalized == []
    # 1 (record lost), 3 (task lost), 4 (in flight: done twice, the first wins) at the front, then 5-7
    assert [t.segment for t in queued] == [1, 3, 4, 5, 6, 7]
    assert queued[0] == segment_task(job, plan.segments[1])  # same text and seed: same audio
    assert attempts[1] == started[1] + recovery.ATTEMPT_GAP and attempts[3] == recovery.ATTEMPT_GAP
    assert attempts[0] == started[0] and 5 not in attempts  # done, and still queued: untouched
    assert again is None


def test_a_finalizing_job_gets_its_finalize_again_and_the_first_look_only_records(redis_url, key_prefix):
    async def main():
        redis, settings, store = await _setup(redis_url, key_prefix)
        try:
            finalized: list[str] = []

            async def finalize(job_id):
                finalized.append(job_id)

            first = await recovery.run(store, finalize)  # nothing recorded before: just look
            job = await submit(store, settings, JobRequest(text="One. Two.", model="tiny"))
            ended = await submit(store, settings, JobRequest(text="Three.", model="tiny"))
            await redis.hset(store.names.job(job.id), "status", JobStatus.FINALIZING.value)
            await store.cancel(ended.id)
            unchanged = await recovery.run(store, finalize)
            await redis.set(store.names.server_runs(), json.dumps(["gone"]))
            report = await recovery.run(store, finalize)
            marked = await redis.zscore(store.names.finalizing(), job.id)
            return first, unchanged, report, finalized, job, marked
        finally:
            await redis.aclose()

    first, unchanged, report, finalized, job, marked = asyncio.run(main())
    assert first is None and unchanged is None
    assert report.jobs == 1 and report.finalizes_requeued == 1 and report.segments_requeued == 0
    assert finalized == [job.id] and marked is not None


def test_an_attempt_number_is_never_handed_out_again_after_lost_writes(redis_url, key_prefix):
    """A failover or an AOF restart rolls the segment's counter back (here: to before the second
    attempt, then to before any); the attempts started after it still get numbers no attempt had."""

    async def main():
        redis, settings, store = await _setup(redis_url, key_prefix)
        key = store.names.attempts
        try:
            job = await submit(store, settings, JobRequest(text="One. Two.", model="tiny"))
            given = [await store.start_segment(job.id, 0), await store.start_segment(job.id, 0)]
            await asyncio.sleep(0.005)  # a loss of writes takes longer than a millisecond
            await redis.hset(key(job.id), 0, given[0])  # the second start was lost
            given.append(await store.start_segment(job.id, 0))
            await asyncio.sleep(0.005)
            await redis.hdel(key(job.id), 0)  # every start was lost
            given.append(await store.start_segment(job.id, 0))
            return given, await store.start_segment(job.id, 1)
        finally:
            await redis.aclose()

    given, other = asyncio.run(main())
    assert given[0] > 0 and all(a < b for a, b in itertools.pairwise(given)), given  # unique, increasing
    assert other > 0


def test_a_creation_no_replica_holds_is_refused_and_nothing_is_kept(redis_url, key_prefix):
    """The machine's Redis has no replica: with ``durable_replicas`` 1 every creation is refused
    (after ``durable_timeout_ms``), and nothing of the job stays; with 0 it is accepted."""
    from jobs.errors import NotDurable

    async def main():
        redis, settings, _ = await _setup(redis_url, key_prefix)
        durable = JobStore(
            redis, Names(key_prefix), events_maxlen=1000, result_ttl_s=3600, durable_replicas=1, durable_timeout_ms=50
        )
        try:
            try:
                await submit(durable, settings, JobRequest(text="One. Two.", model="tiny"), concurrent_jobs=5)
            except NotDurable as exc:
                refused = str(exc)
            keys = [k async for k in redis.scan_iter(match=f"{key_prefix}:*")]
            plain = JobStore(redis, Names(key_prefix), events_maxlen=1000, result_ttl_s=3600)
            kept = await submit(plain, settings, JobRequest(text="One. Two.", model="tiny"))
            return refused, keys, await plain.get(kept.id)
        finally:
            await redis.aclose()

    refused, keys, kept = asyncio.run(main())
    assert "could not be stored safely" in refused and "0 of 1 replica(s)" in refused
    # nothing of the job, its queue or its tenant's slot (RESERVE_JOB_SLOT's set is empty again)
    assert [k for k in keys if b":job:" in k or b":q:" in k or b":active" in k] == [], keys
    assert kept is not None


def test_a_job_deleted_while_recovery_pages_makes_it_skip_none(redis_url, key_prefix, monkeypatch, tmp_path):
    """Recovery paged {p}:jobs by offset: a job deleted during a page shifted the next page past one
    it never went over, which then stayed running for good. It pages by a cursor now."""
    from fleet.storage import LocalStorage
    from jobs.service import delete

    monkeypatch.setattr(recovery, "PAGE", 2)

    async def main():
        redis, settings, store = await _setup(redis_url, key_prefix)
        try:
            jobs = [await submit(store, settings, JobRequest(text="Just one sentence.", model="tiny")) for _ in range(4)]
            target = jobs[2]  # the first of the second page, oldest first
            for job in jobs:
                if job is not target:
                    await redis.hset(store.names.job(job.id), "status", "done")
            await store.start_segment(target.id, 0)  # started, then a failover lost its task
            await store.scheduler.drop(target.model, target.shard, target.id, target.tenant, target.priority)
            get_many, pages = store.get_many, []

            async def deleting_on_the_first_page(ids):
                pages.append(ids)
                if len(pages) == 1:  # meanwhile a client deletes its oldest job
                    await delete(store, LocalStorage(tmp_path), settings, jobs[0], rq_connection=None)
                return await get_many(ids)

            store.get_many = deleting_on_the_first_page

            async def finalize(job_id):
                pass

            report = await recovery.recover(store, finalize)
            queued = await store.scheduler.queued_tasks(target.model, target.shard, target.id)
            return report, [t.segment for t in queued], target.id
        finally:
            await redis.aclose()

    report, queued, target = asyncio.run(main())
    assert report.requeued_jobs == [target] and queued == [0]
