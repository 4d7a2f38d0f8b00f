"""The assembler's ordering and idempotence (fakeredis with Lua: the same scripts as production)."""

from __future__ import annotations

import asyncio
import json

import fakeredis
import numpy as np
import pytest

from fleet.messages import AudioChunk, SegmentTask
from fleet.names import Names
from fleet.settings import Settings
from fleet.storage import LocalStorage
from jobs.model import JobStatus
from jobs.service import JobRequest, tasks_for, validate
from jobs.store import JobStore
from workers.assembler import Assembler
from workers.runtime import WorkerContext

#: Test samples are scaled to an audible level: a segment below the model's silence limit (-50 dBFS)
#: would be retried as a near-silent runaway (models/runaway.py).
LOUD = 300


def pcm(values) -> bytes:
    return (np.asarray(values) * LOUD).astype("<i2").tobytes()


@pytest.fixture
def harness(tmp_path):
    return make_harness(tmp_path)


def make_harness(tmp_path):
    """An assembler on fakeredis and local storage; the finalize jobs it would queue are listed."""
    settings = Settings(redis_url="redis://unused", key_prefix="t", data_dir=tmp_path, block_ms=10)
    redis = fakeredis.FakeAsyncRedis()
    names = Names("t")
    store = JobStore(redis, names, events_maxlen=1000, result_ttl_s=60)
    ctx = WorkerContext(settings, redis, names, store, LocalStorage(tmp_path / "storage"), asyncio.Event())
    enqueued: list[str] = []
    assembler = Assembler(ctx, enqueue=lambda _settings, job_id: enqueued.append(job_id))
    return ctx, assembler, enqueued


async def new_job(ctx, text="One. Two."):
    job, plan = validate(JobRequest(text=text), ctx.settings)
    await ctx.store.create(job, plan, tasks_for(job, plan))
    assert await ctx.store.start_segment(job.id, 0) > 0  # the job is running
    return job


async def deliver(ctx, assembler, chunks):
    """Put the chunks on the audio stream and run the assembler's own loop steps until it is empty."""
    for chunk in chunks:
        await ctx.redis.xadd(ctx.names.audio(), chunk.encode())
    await assembler.transport.setup()
    for _ in range(100):
        if not await ctx.redis.xlen(ctx.names.audio()):
            return
        await assembler.step()
    raise AssertionError("the assembler left entries on its stream")


async def events(ctx, job_id):
    return [(e.type.value, e.data) for e in await ctx.store.read_events(job_id, "0-0", None, count=1000)]


def test_out_of_order_duplicate_and_superseded_chunks(harness):
    ctx, assembler, enqueued = harness

    async def main():
        job = await new_job(ctx)
        a1 = [
            AudioChunk(job.id, 0, 1, seq, seq == 3, 24000, pcm([seq * 10 + i for i in range(4)]))
            for seq in range(4)
        ]
        # attempt 1 of segment 0 arrives out of order and with a duplicate; attempt 2 (a retry) trails
        a2 = [AudioChunk(job.id, 0, 2, seq, seq == 1, 24000, pcm([99] * 4)) for seq in range(2)]
        await deliver(ctx, assembler, [a1[2], a1[0], a2[0], a1[3], a1[2], a1[1], a2[1]])
        s1 = AudioChunk(job.id, 1, 1, 0, True, 24000, pcm([7, 8]))
        await deliver(ctx, assembler, [s1, s1])
        return job

    job = asyncio.run(main())
    part = ctx.storage.get_bytes(job.objects.part(0, 1))
    assert part == pcm([seq * 10 + i for seq in range(4) for i in range(4)])
    done = asyncio.run(ctx.store.completed_segments(job.id))
    assert done == {0: (1, 16), 1: (1, 2)}  # attempt 1 won segment 0; each segment recorded once
    got = asyncio.run(ctx.store.get(job.id))
    assert got.segments_done == 2 and got.status == JobStatus.FINALIZING
    assert got.audio_seconds == pytest.approx(18 / 24000)
    kinds = [kind for kind, _ in asyncio.run(events(ctx, job.id))]
    assert kinds.count("segment") == 2 and kinds[-1] == "progress" and kinds[0] == "queued"
    assert enqueued and set(enqueued) == {job.id}
    # the losing attempt's deltas and every scratch key are gone from Redis
    leftover = asyncio.run(ctx.redis.keys(f"t:job:{{{job.id}}}:deltas:*"))
    assert leftover == []


def test_chunks_of_a_cancelled_job_are_dropped(harness):
    ctx, assembler, enqueued = harness

    async def main():
        job = await new_job(ctx, "Only one.")
        await ctx.store.cancel(job.id)
        await deliver(ctx, assembler, [AudioChunk(job.id, 0, 1, 0, True, 24000, pcm([1, 2, 3]))])
        return job

    job = asyncio.run(main())
    assert asyncio.run(ctx.store.completed_segments(job.id)) == {}
    assert not ctx.storage.exists(job.objects.part(0, 1)) and not enqueued
    assert asyncio.run(ctx.redis.xlen(ctx.names.audio())) == 0  # acked and deleted


def test_unreadable_chunk_is_dead_lettered_and_fails_its_job(harness):
    ctx, assembler, _ = harness

    async def main():
        job = await new_job(ctx, "Only one.")
        fields = AudioChunk(job.id, 0, 1, 0, True, 24000, pcm([1])).encode()
        fields[b"p"] = b"\x00"  # half a sample
        await ctx.redis.xadd(ctx.names.audio(), fields)
        await deliver(ctx, assembler, [])
        return job

    job = asyncio.run(main())
    got = asyncio.run(ctx.store.get(job.id))
    assert got.status == JobStatus.FAILED and "could not be read" in got.error
    letters = asyncio.run(ctx.redis.xrange(ctx.names.dead_letters()))
    assert len(letters) == 1 and json.loads(letters[0][1][b"h"])["job_id"] == job.id


def test_when_two_attempts_complete_together_only_the_winner_keeps_a_part(harness):
    ctx, assembler, _ = harness

    async def main():
        job = await new_job(ctx, "One. Two.")
        retry = AudioChunk(job.id, 0, 2, 0, True, 24000, pcm([5, 6]))
        assert await ctx.store.add_delta(retry) == "complete"  # a retry finishes too...
        await deliver(
            ctx, assembler, [AudioChunk(job.id, 0, 1, 0, True, 24000, pcm([5, 6]))]
        )  # ...but attempt 1 wins
        await assembler.complete_segment(retry)  # the retry's assembler gets there second
        return job

    job = asyncio.run(main())
    assert ctx.storage.get_bytes(job.objects.part(0, 1)) == pcm([5, 6])
    assert not ctx.storage.exists(job.objects.part(0, 2))  # no orphan part in storage
    assert asyncio.run(ctx.store.completed_segments(job.id)) == {0: (1, 2)}


def test_a_chunk_handled_twice_at_once_is_not_taken_for_silence(harness):
    """After a failover that rolls back a read, two assemblers can hold the same final chunk: both
    hear 'complete', one stores the segment and its audio pieces go. The other then finds none:
    that is someone else's finished work, not a silent segment to retry with a new seed (CI,
    2026-12-04: such a retry's other audio won after a later failover lost the first record)."""
    ctx, assembler, _ = harness

    async def main():
        job = await new_job(ctx, "One. Two.")
        chunk = AudioChunk(job.id, 0, 1, 0, True, 24000, pcm([5, 6]))
        assert await ctx.store.add_delta(chunk) == "complete"  # the second handler's view...
        assert await ctx.store.add_delta(chunk) == "complete"  # ...and the first's
        await assembler.complete_segment(chunk)  # the first stores it
        await assembler.complete_segment(chunk)  # the second comes after
        queued = await ctx.store.scheduler.queued_tasks("tiny", job.shard, job.id)
        return job, queued, await events(ctx, job.id)

    job, queued, evs = asyncio.run(main())
    assert asyncio.run(ctx.store.completed_segments(job.id)) == {0: (1, 2)}
    assert ctx.storage.get_bytes(job.objects.part(0, 1)) == pcm([5, 6])
    assert [t for t in queued if t.segment == 0] == []  # no retry queued
    assert not [k for k, _ in evs if k in ("runaway", "warning")]


def test_a_near_silent_segment_is_retried_with_the_next_seed_then_kept_flagged(harness):
    ctx, assembler, _ = harness  # runaway_retries = 2 (the default)

    async def main():
        job = await new_job(ctx, "Quiet here. Loud there.")
        hush = np.full(4000, 3, dtype="<i2").tobytes()  # -80 dBFS: near-silence
        # try 0 (attempt 1) is silent: not recorded, its next try is queued with retry 1
        await deliver(ctx, assembler, [AudioChunk(job.id, 0, 1, 0, True, 24000, hush, retry=0)])
        admitted = [SegmentTask.decode(f) for _, f in await ctx.redis.xrange(ctx.names.tasks("tiny"))]
        queued = admitted + await ctx.store.scheduler.queued_tasks("tiny", job.shard, job.id)
        after_first = await ctx.store.completed_segments(job.id)
        # a late copy of attempt 1's audio is dropped; the last try (retry 2) is silent again: kept, flagged
        late = await ctx.store.add_delta(AudioChunk(job.id, 0, 1, 0, True, 24000, hush, retry=0))
        await deliver(ctx, assembler, [AudioChunk(job.id, 0, 3, 0, True, 24000, hush, retry=2)])
        return job, queued, after_first, late, await events(ctx, job.id)

    job, queued, after_first, late, evs = asyncio.run(main())
    retries = [t for t in queued if t.segment == 0 and t.retry == 1]
    (first,) = [t for t in queued if t.segment == 0 and t.retry == 0]
    assert len(retries) == 1 and retries[0].text == "Quiet here." and retries[0].seed == first.seed
    # admitted at job creation: segment 0; queued: the retry first, before the rest of the job
    assert queued[0] == first and queued[1] == retries[0]
    assert after_first == {} and late == "stale"
    assert not ctx.storage.exists(job.objects.part(0, 1))
    assert asyncio.run(ctx.store.completed_segments(job.id)) == {0: (3, 4000)}  # the last try, kept
    runaway = [d for k, d in evs if k == "runaway"]
    warning = [d for k, d in evs if k == "warning"]
    assert [(d["index"], d["retry"], d["kind"]) for d in runaway] == [(0, 0, "silence")]
    assert [(d["index"], d["retries"], d["kind"]) for d in warning] == [(0, 2, "silence")]
    assert "-80.8 dBFS over 4000 samples" in warning[0]["detail"]
    assert asyncio.run(ctx.store.get(job.id)).segments_flagged == 1
    assert asyncio.run(ctx.store.flags(job.id))[0]["kind"] == "silence"
