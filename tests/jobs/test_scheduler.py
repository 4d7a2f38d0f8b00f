"""The admission policy (jobs/scheduler.py) on fakeredis with the production scripts: tenants in the
ratio of their weights, jobs of one tenant round robin, interactive before batch, book order within a
job, a retry first, a new tenant at the current virtual time, O(1) drops, and the stream filled only
up to what engines asked for."""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter

import fakeredis

from fleet.messages import SegmentTask
from fleet.names import Names
from jobs.scheduler import BATCH, INTERACTIVE, Scheduler

MODEL, GROUP = "tiny", "ar"


def tasks(job: str, n: int, start: int = 0) -> list[SegmentTask]:
    return [SegmentTask(job, i, f"Sentence {i}.", MODEL, "tara", seed=i) for i in range(start, start + n)]


def harness():
    redis = fakeredis.FakeAsyncRedis()
    return redis, Scheduler(redis, Names("t"))


async def take(redis, scheduler: Scheduler, n: int) -> list[tuple[str, int]]:
    """Admit ``n`` tasks and consume them (read + ack) as engines would; (job, segment) in order."""
    stream = scheduler.names.tasks(MODEL)
    with contextlib.suppress(Exception):  # the group exists already
        await redis.xgroup_create(stream, GROUP, id="0", mkstream=True)
    await scheduler.admit(MODEL, n)
    reply = await redis.xreadgroup(GROUP, "c", {stream: ">"}, count=n)
    out = []
    for _, entries in reply or []:
        for entry_id, fields in entries:
            task = SegmentTask.decode(fields)
            out.append((task.job_id, task.segment))
            await redis.xack(stream, GROUP, entry_id)
            await redis.xdel(stream, entry_id)
    return out


def test_tenants_are_served_in_the_ratio_of_their_weights_and_jobs_round_robin():
    async def main():
        redis, s = harness()
        await s.enqueue(MODEL, 0, "a1", "alice", BATCH, 3, tasks("a1", 300))
        await s.enqueue(MODEL, 0, "a2", "alice", BATCH, 3, tasks("a2", 300))
        await s.enqueue(MODEL, 0, "b1", "bob", BATCH, 1, tasks("b1", 300))
        taken = []
        for _ in range(40):
            taken += await take(redis, s, 4)
        return taken

    taken = asyncio.run(main())
    by_job = Counter(job for job, _ in taken)
    assert by_job["a1"] + by_job["a2"] == 3 * by_job["b1"]  # weight 3 against 1, exactly
    assert abs(by_job["a1"] - by_job["a2"]) <= 2  # alice's two jobs take turns (a2 joined one behind)
    for job in ("a1", "a2", "b1"):
        segments = [seg for j, seg in taken if j == job]
        assert segments == list(range(len(segments)))  # each job in book order


def test_an_interactive_job_goes_before_every_batch_task_and_a_retry_before_its_job():
    async def main():
        redis, s = harness()
        await s.enqueue(MODEL, 0, "book", "alice", BATCH, 1, tasks("book", 100))
        first = await take(redis, s, 3)
        await s.enqueue(MODEL, 0, "short", "bob", INTERACTIVE, 1, tasks("short", 2))
        await s.enqueue(MODEL, 0, "book", "alice", BATCH, 1, [tasks("book", 1, start=1)[0]], front=True)
        return first, await take(redis, s, 4)

    first, then = asyncio.run(main())
    assert first == [("book", 0), ("book", 1), ("book", 2)]
    assert then == [("short", 0), ("short", 1), ("book", 1), ("book", 3)]  # the retry of 1, then on


def test_a_tenant_back_from_idle_starts_at_the_current_virtual_time():
    async def main():
        redis, s = harness()
        await s.enqueue(MODEL, 0, "a", "alice", BATCH, 1, tasks("a", 200))
        await take(redis, s, 100)  # alice alone: her pass runs to 100
        await s.enqueue(MODEL, 0, "b", "bob", BATCH, 1, tasks("b", 200))
        return await take(redis, s, 20)

    taken = asyncio.run(main())
    counts = Counter(job for job, _ in taken)
    assert counts == {"a": 10, "b": 10}  # bob does not get 100 turns for having been away


def test_only_what_engines_asked_for_enters_the_stream_and_one_wakes_an_idle_worker():
    async def main():
        redis, s = harness()
        await redis.xgroup_create(s.names.tasks(MODEL), GROUP, id="0", mkstream=True)
        await s.enqueue(MODEL, 0, "a", "alice", BATCH, 1, tasks("a", 50))
        moved = [await s.admit(MODEL, 8) for _ in range(3)]  # nobody read in between
        return moved, await redis.xlen(s.names.tasks(MODEL)), await s.queued(MODEL)

    moved, in_stream, queued = asyncio.run(main())
    assert moved == [7, 0, 0] and in_stream == 8 and queued == 42  # 1 admitted at once on enqueue


def test_dropping_a_job_removes_its_queue_at_once_and_place_estimates_the_wait():
    async def main():
        redis, s = harness()
        await redis.xgroup_create(s.names.tasks(MODEL), GROUP, id="0", mkstream=True)
        await s.enqueue(MODEL, 0, "big", "alice", BATCH, 1, tasks("big", 50_000))
        await s.enqueue(MODEL, 0, "small", "bob", BATCH, 1, tasks("small", 3))
        await s.enqueue(MODEL, 0, "chat", "carol", INTERACTIVE, 1, tasks("chat", 2))
        place_small = await s.place(MODEL, 0, "small", "bob", BATCH)
        dropped = await s.drop(MODEL, 0, "big", "alice", BATCH)
        left = await s.queued(MODEL)
        keys = sorted(k.decode() for k in await redis.keys("*big*"))
        return place_small, dropped, left, keys, await take(redis, s, 10)

    place_small, dropped, left, keys, taken = asyncio.run(main())
    # its 3 segments; ahead: the big job's first (admitted when it was queued) and the 2 interactive ones
    assert place_small == (3, 3)
    assert dropped == 49_999 and left == 5 and keys == []  # its first was admitted on enqueue
    # what was admitted before the drop is in the stream (workers drop it unworked: its job ended)
    assert [job for job, _ in taken] == ["big", "chat", "chat", "small", "small", "small"]


def test_fifo_baseline_puts_every_task_in_the_stream_in_arrival_order():
    async def main():
        redis = fakeredis.FakeAsyncRedis()
        s = Scheduler(redis, Names("t"), fifo=True)
        await s.enqueue(MODEL, 0, "book", "alice", BATCH, 1, tasks("book", 30))
        await s.enqueue(MODEL, 0, "short", "bob", INTERACTIVE, 1, tasks("short", 2))
        assert await s.admit(MODEL, 4) == 0  # nothing queued: nothing to admit
        assert await s.queued(MODEL) == 0
        return await take(redis, s, 100)

    taken = asyncio.run(main())
    assert taken == [("book", i) for i in range(30)] + [("short", 0), ("short", 1)]  # behind the book
