"""The stage base over the in-memory transport: one subclass is a worker kind, and every delivery
ends the way workers/errors.py decides: acked, retried after a backoff, dead-lettered with its job
failed, or the process stopped (fatal). The job store runs on fakeredis with the production scripts."""

from __future__ import annotations

import asyncio

import fakeredis
import pytest

from fleet import readiness
from fleet.messages import SegmentTask
from fleet.names import Names
from fleet.settings import Settings
from fleet.storage import LocalStorage
from jobs.model import JobStatus
from jobs.service import JobRequest, submit, tasks_for, validate
from jobs.store import JobStore
from workers.errors import FatalError
from workers.runtime import WorkerContext
from workers.stage import Stage, Work
from workers.transport import MemoryBroker

OUT = "t:out"


class Echo(Stage[SegmentTask]):
    """A whole worker kind: reads segment tasks, publishes each text, fails as told."""

    kind = "echo"
    group = "echo"
    message = SegmentTask
    activity = "echoing"
    batch_size = 4

    def __init__(self, ctx, transport, failures: dict[int, list[BaseException]] | None = None) -> None:
        super().__init__(ctx, [ctx.names.tasks("tiny")], transport=transport, live_models=["tiny"])
        self.failures = failures or {}
        self.seen: list[int] = []

    async def handle(self, work: Work[SegmentTask]) -> None:
        task = work.message
        self.seen.append(task.segment)
        if self.failures.get(task.segment):
            raise self.failures[task.segment].pop(0)
        await self.transport.publish(OUT, [{b"text": task.text.encode()}])


@pytest.fixture
def harness(tmp_path):
    settings = Settings(
        redis_url="redis://unused",
        key_prefix="t",
        data_dir=tmp_path,
        block_ms=10,
        max_deliveries=3,
        retry_backoff_ms=20,
        heartbeat_s=0.05,
    )
    redis = fakeredis.FakeAsyncRedis()
    names = Names("t")
    store = JobStore(redis, names, events_maxlen=1000, result_ttl_s=60)
    ctx = WorkerContext(settings, redis, names, store, LocalStorage(tmp_path / "s"), asyncio.Event())
    broker = MemoryBroker()
    return ctx, broker


async def new_job(ctx, broker, text="One. Two. Three."):
    """A job stored in Redis, its tasks on the in-memory task stream."""
    job, plan = validate(JobRequest(text=text), ctx.settings)
    await ctx.store.create(job, plan, [])
    for task in tasks_for(job, plan):
        broker.put(ctx.names.tasks("tiny"), task.encode())
    return job


async def run_until(stage, condition, timeout=10.0):
    running = asyncio.create_task(stage.run())
    try:
        deadline = asyncio.get_running_loop().time() + timeout
        while not condition():
            assert not running.done(), running.exception()
            assert asyncio.get_running_loop().time() < deadline, "condition not reached"
            await asyncio.sleep(0.01)
    finally:
        stage.ctx.stop.set()
        await asyncio.gather(running, return_exceptions=True)
    return running


def test_a_stage_is_one_subclass_and_acks_what_it_did(harness):
    ctx, broker = harness

    async def main():
        await new_job(ctx, broker)
        stage = Echo(ctx, broker.transport([ctx.names.tasks("tiny")]))
        await run_until(stage, lambda: broker.pending(ctx.names.tasks("tiny")) == 0)
        return stage

    stage = asyncio.run(main())
    assert sorted(stage.seen) == [0, 1, 2]
    assert sorted(f[b"text"] for f in broker.published[OUT]) == [b"One.", b"Three.", b"Two."]
    assert broker.dead == []


def test_a_retryable_error_is_retried_after_a_backoff(harness):
    ctx, broker = harness

    async def main():
        job = await new_job(ctx, broker)
        failures = {1: [OSError("storage hiccup"), OSError("again")]}
        stage = Echo(ctx, broker.transport([ctx.names.tasks("tiny")]), failures)
        await run_until(stage, lambda: broker.pending(ctx.names.tasks("tiny")) == 0)
        return stage, await ctx.store.get(job.id)

    stage, job = asyncio.run(main())
    assert stage.seen.count(1) == 3  # two failures, then success on the last delivery it gets
    assert broker.dead == [] and job.status == JobStatus.QUEUED


def test_a_retryable_error_at_the_delivery_limit_dead_letters_and_fails_the_job(harness):
    ctx, broker = harness

    async def main():
        job = await new_job(ctx, broker)
        failures = {1: [OSError("disk full")] * 5}
        stage = Echo(ctx, broker.transport([ctx.names.tasks("tiny")]), failures)
        await run_until(stage, lambda: broker.pending(ctx.names.tasks("tiny")) == 0)
        events = await ctx.store.read_events(job.id, "0-0", None)
        return stage, await ctx.store.get(job.id), events

    stage, job, events = asyncio.run(main())
    assert stage.seen.count(1) == 3  # max_deliveries
    assert job.status == JobStatus.FAILED
    assert job.error == "segment 1 failed while echoing: failed 3 times; last error: disk full"
    assert events[-1].type.value == "failed" and events[-1].data == {"error": job.error}
    (letter,) = broker.dead
    assert letter.job_id == job.id and letter.deliveries == 3 and "disk full" in letter.error


def test_a_permanent_error_dead_letters_at_once(harness):
    ctx, broker = harness
    from models.engines.base import EngineRequestError

    async def main():
        job = await new_job(ctx, broker)
        failures = {0: [EngineRequestError("the prompt of 900 tokens does not fit the engine")]}
        stage = Echo(ctx, broker.transport([ctx.names.tasks("tiny")]), failures)
        await run_until(stage, lambda: broker.pending(ctx.names.tasks("tiny")) == 0)
        return stage, await ctx.store.get(job.id)

    stage, job = asyncio.run(main())
    assert stage.seen.count(0) == 1
    assert job.error == "segment 0 failed while echoing: the prompt of 900 tokens does not fit the engine"
    assert len(broker.dead) == 1


def test_a_fatal_error_hands_everything_back_leaves_readiness_and_stops(harness):
    ctx, broker = harness
    from models.engines.base import EngineDeadError

    async def main():
        job = await new_job(ctx, broker)
        stage = Echo(ctx, broker.transport([ctx.names.tasks("tiny")]), {1: [EngineDeadError("core died")]})
        running = asyncio.create_task(stage.run())
        live = []
        while not running.done():
            live.append(await readiness.live_counts(ctx.redis, ctx.names, [("echo", "tiny")], 0.05))
            await asyncio.sleep(0.01)
        with pytest.raises(FatalError, match="core died"):
            await running
        after = await readiness.live_counts(ctx.redis, ctx.names, [("echo", "tiny")], 0.05)
        return stage, await ctx.store.get(job.id), live, after

    stage, job, live, after = asyncio.run(main())
    assert (
        broker.pending(ctx.names.tasks("tiny")) == 2
    )  # the fatal one and the one after it: handed back, not dead-lettered
    assert all(not e.held for e in broker.entries[ctx.names.tasks("tiny")])
    assert broker.dead == [] and job.status == JobStatus.QUEUED  # nothing is the job's fault
    assert stage.seen == [0, 1] and after[("echo", "tiny")] == 0


def test_unreadable_and_too_often_delivered_entries_fail_their_jobs(harness):
    ctx, broker = harness

    async def main():
        broken = await new_job(ctx, broker, "Broken.")
        died_on = await new_job(ctx, broker, "Killer.")
        stream = ctx.names.tasks("tiny")
        entries = broker.entries[stream]
        entries[0].fields = {**entries[0].fields, b"v": b"99"}  # another schema version
        entries[1].deliveries = 3  # delivered max_deliveries times already: its worker died each time
        stage = Echo(ctx, broker.transport([stream]))
        await run_until(stage, lambda: broker.pending(ctx.names.tasks("tiny")) == 0)
        return stage, await ctx.store.get(broken.id), await ctx.store.get(died_on.id)

    stage, broken, died_on = asyncio.run(main())
    assert stage.seen == []
    assert broken.status == JobStatus.FAILED and "its message could not be read" in broken.error
    assert died_on.status == JobStatus.FAILED
    assert died_on.error == (
        "segment 0 failed while echoing: delivered 4 times without finishing (a worker died on it each time)"
    )
    assert len(broker.dead) == 2


def test_entries_of_ended_jobs_are_dropped_unworked(harness):
    ctx, broker = harness

    async def main():
        job = await new_job(ctx, broker)
        await ctx.store.cancel(job.id)
        stage = Echo(ctx, broker.transport([ctx.names.tasks("tiny")]))
        await run_until(stage, lambda: broker.pending(ctx.names.tasks("tiny")) == 0)
        return stage

    assert asyncio.run(main()).seen == []


def test_submit_then_a_real_stage_over_memory_streams(harness):
    """The job service queues on Redis, the scheduler admits; the same task entries, moved to memory,
    drive a stage."""
    ctx, broker = harness

    async def main():
        job = await submit(ctx.store, ctx.settings, JobRequest(text="Alpha. Beta."))
        await ctx.store.scheduler.admit("tiny", 10)  # queued -> the stage stream
        assert await ctx.redis.xlen(ctx.names.tasks("tiny")) == 2
        for _, fields in await ctx.redis.xrange(ctx.names.tasks("tiny")):
            broker.put(ctx.names.tasks("tiny"), fields)
        stage = Echo(ctx, broker.transport([ctx.names.tasks("tiny")]))
        await run_until(stage, lambda: broker.pending(ctx.names.tasks("tiny")) == 0)
        return job

    asyncio.run(main())
    assert [f[b"text"] for f in broker.published[OUT]] == [b"Alpha.", b"Beta."]
