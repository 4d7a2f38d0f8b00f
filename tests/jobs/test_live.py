"""The live reader (jobs/live.py) against the assembler's own keys (fakeredis with the production Lua):
deltas in order as they arrive, a retried attempt continued from the sample the listener is at, the
assembled part after it, the pauses between segments, and an ended job ending the stream; a finished
file read from a point, in every format."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from fleet.messages import AudioChunk
from fleet.storage import LocalStorage
from jobs.audio import Pauses, stitch
from jobs.live import LiveAudio, LiveEnded, decode_file
from jobs.segmentation import Pause, plan_text
from tests.workers.test_assembler import LOUD, deliver, make_harness, new_job, pcm

RATE = 24_000


@pytest.fixture
def harness(tmp_path):
    return make_harness(tmp_path)


async def latest_attempt(ctx, job_id: str, segment: int) -> int:
    return int(await ctx.redis.hget(ctx.names.attempts(job_id), segment))


async def until(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        await asyncio.sleep(0.005)


def reader(ctx, job, plan) -> LiveAudio:
    return LiveAudio(ctx.store, ctx.storage, job, plan, Pauses.of(ctx.settings), RATE, poll_s=0.005)


def test_deltas_in_order_a_retry_continued_then_the_next_segment(harness):
    ctx, assembler, _ = harness
    heard: list[np.ndarray] = []

    async def main():
        job = await new_job(ctx)  # two segments; the first attempt of segment 0 started
        one = await latest_attempt(ctx, job.id, 0)
        plan = await ctx.store.plan(job.id)
        live = reader(ctx, job, plan)

        async def listen():
            async for piece in live.pcm():
                heard.append(piece)

        task = asyncio.create_task(listen())
        first = [AudioChunk(job.id, 0, one, seq, False, RATE, pcm([seq + 1] * 4)) for seq in range(3)]
        # chunk 1 arrives before chunk 0: nothing is heard until 0 is there, then both in order
        await deliver(ctx, assembler, [first[1]])
        await asyncio.sleep(0.05)
        assert not heard
        await deliver(ctx, assembler, [first[0]])
        await until(lambda: sum(p.size for p in heard) == 8)
        # the worker dies; attempt 2 renders the segment again (other audio): the listener goes on
        # from its 9th sample, never hearing a sample twice
        two = await ctx.store.start_segment(job.id, 0)
        assert two > one
        second = [AudioChunk(job.id, 0, two, seq, seq == 2, RATE, pcm([10 + seq] * 4)) for seq in range(3)]
        await deliver(ctx, assembler, second)
        await until(lambda: sum(p.size for p in heard) >= 12)
        other = await ctx.store.start_segment(job.id, 1)
        await deliver(ctx, assembler, [AudioChunk(job.id, 1, other, 0, True, RATE, pcm([7] * 5))])
        await asyncio.wait_for(task, 5)
        return plan

    plan = asyncio.run(main())
    out = np.concatenate(heard)
    pause = Pauses.of(ctx.settings).samples(Pause(plan.segments[0].pause_after), RATE)
    expected = np.concatenate(
        [
            np.repeat([1, 2], 4) * LOUD,  # attempt 1's first two chunks
            np.repeat([12], 4) * LOUD,  # attempt 2 from its 9th sample
            np.zeros(pause),
            np.repeat([7], 5) * LOUD,
            np.zeros(Pauses.of(ctx.settings).samples(Pause(plan.segments[1].pause_after), RATE)),
        ]
    ).astype(np.int16)
    np.testing.assert_array_equal(out, expected)


def test_a_cancelled_job_ends_the_stream(harness):
    ctx, assembler, _ = harness

    async def main():
        job = await new_job(ctx, "Only one sentence here.")
        live = reader(ctx, job, await ctx.store.plan(job.id))
        got = []

        async def listen():
            async for piece in live.pcm():
                got.append(piece)

        task = asyncio.create_task(listen())
        attempt = await latest_attempt(ctx, job.id, 0)
        await deliver(ctx, assembler, [AudioChunk(job.id, 0, attempt, 0, False, RATE, pcm([3] * 6))])
        await until(lambda: got)
        await ctx.store.cancel(job.id)
        with pytest.raises(LiveEnded, match="cancelled"):
            await asyncio.wait_for(task, 5)
        return got

    assert sum(p.size for p in asyncio.run(main())) == 6


def test_a_chapter_out_of_range_is_refused(harness):
    ctx, _, _ = harness

    async def main():
        job = await new_job(ctx, "# One\n\nA.\n\n# Two\n\nB.")
        live = reader(ctx, job, await ctx.store.plan(job.id))
        assert live.first_segment(2) == 2  # its heading: "One", "A.", "Two"
        with pytest.raises(Exception, match="chapter 3 is out of range"):
            live.first_segment(3)

    asyncio.run(main())


@pytest.mark.parametrize("fmt", ["mp3", "opus", "m4a", "flac"])
def test_a_finished_file_is_read_from_a_segments_start(tmp_path, fmt):
    plan = plan_text("One. Two. Three.")
    noise = {s.index: (3000 * np.random.default_rng(s.index).standard_normal(RATE)).astype("<i2") for s in plan.segments}
    manifest = stitch(
        plan, lambda i: noise[i].tobytes(), tmp_path / f"b.{fmt}", fmt=fmt, model_rate=RATE, out_rate=RATE,
        pauses=Pauses(300, 700, 1500), samples={i: RATE for i in noise},
    )  # fmt: skip
    heard = np.concatenate(list(decode_file(LocalStorage(tmp_path), f"b.{fmt}", manifest.segments[1]["start_s"], RATE)))
    found = int(np.argmax(np.correlate(heard[:4000].astype(float), noise[1][:2000].astype(float), "valid")))
    assert found <= 16  # Opus's 16 (its resampling); an MP3 read its encoder's delay first (1,105)
