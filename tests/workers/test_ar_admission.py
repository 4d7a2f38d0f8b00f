"""How an AR worker fills freed engine slots, over a real Redis: one at a time by default; with
``ar_admit_batch`` in groups once enough slots are free, or when ``ar_admit_wait_ms`` has passed."""

from __future__ import annotations

import asyncio
import time

from jobs.service import JobRequest, submit
from workers.ar import ARWorker
from workers.runtime import WorkerContext

TEXT = " ".join(f"Sentence number {i} ends here." for i in range(12))  # 12 segments


class HeldSynthesizer:
    """Stands in for the engine: a segment runs until the test lets it finish."""

    def __init__(self) -> None:
        self.started: list[int] = []
        self.release: dict[int, asyncio.Event] = {}

    async def windows(self, task, request_id):
        self.started.append(task.segment)
        event = self.release.setdefault(task.segment, asyncio.Event())
        await event.wait()
        return
        yield  # an async generator that yields no windows

    def finish(self, count: int) -> None:
        running = [s for s in self.started if not self.release[s].is_set()]
        for segment in running[:count]:
            self.release[segment].set()


async def until(condition, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


def run(settings, scenario, text: str = TEXT, interactive_slots: int = 0) -> None:
    """An AR worker of 6 slots (and ``interactive_slots``) on a submitted job; once 6 segments run,
    ``scenario(synth, ctx)``."""

    async def main() -> None:
        ctx = WorkerContext.create(settings)
        await submit(ctx.store, settings, JobRequest(text=text, priority="batch"))
        synth = HeldSynthesizer()
        worker = ARWorker(ctx, "tiny", synth, max_in_flight=6, interactive_slots=interactive_slots)
        running = asyncio.create_task(worker.run())
        try:
            await until(lambda: len(synth.started) == 6)
            await scenario(synth, ctx)
            assert not running.done(), running
        finally:
            ctx.stop.set()
            for event in synth.release.values():
                event.set()
            await running
            await ctx.close()

    asyncio.run(main())


def test_by_default_each_freed_slot_is_filled_at_once(make_settings, key_prefix):
    async def scenario(synth, ctx):
        synth.finish(1)
        await until(lambda: len(synth.started) == 7, timeout=5)

    run(make_settings(key_prefix), scenario)


def test_with_an_admission_batch_new_segments_start_in_groups(make_settings, key_prefix):
    async def scenario(synth, ctx):
        synth.finish(3)  # 3 free slots: fewer than the batch of 4
        await asyncio.sleep(1.0)
        assert len(synth.started) == 6, "a segment started before 4 slots were free"
        synth.finish(1)  # 4 free: all four start together
        await until(lambda: len(synth.started) == 10, timeout=5)

    run(make_settings(key_prefix, ar_admit_batch=4, ar_admit_wait_ms=60_000), scenario)


def test_free_slots_are_taken_anyway_once_the_admission_wait_is_over(make_settings, key_prefix):
    async def scenario(synth, ctx):
        freed = time.monotonic()
        synth.finish(1)
        await until(lambda: len(synth.started) == 7, timeout=10)
        assert time.monotonic() - freed >= 0.4  # it waited (ar_admit_wait_ms) for more slots first

    run(make_settings(key_prefix, ar_admit_batch=4, ar_admit_wait_ms=500), scenario)


def test_an_interactive_job_takes_a_reserved_slot_on_an_engine_full_of_a_book(make_settings, key_prefix):
    """6 batch slots held by the book (and 1 freed, waiting for its admission group) + 2 reserved:
    a short job's 2 segments start at once; the book gets none of the reserved slots."""
    settings = make_settings(key_prefix, ar_admit_batch=4, ar_admit_wait_ms=60_000)
    book = " ".join(f"Sentence number {i} ends here." for i in range(40))

    async def scenario(synth, ctx):
        synth.finish(1)  # one batch slot free: it waits for its group of 4
        await asyncio.sleep(0.5)
        assert len(synth.started) == 6, "the book took a reserved slot"
        short = await submit(ctx.store, settings, JobRequest(text="One line. And another."))
        assert short.priority == "interactive"
        t0 = time.monotonic()
        await until(lambda: len(synth.started) == 8, timeout=5)
        assert time.monotonic() - t0 < 1.0
        assert sorted(synth.started[6:]) == [0, 1]  # the short job's two segments
        await asyncio.sleep(0.5)
        assert len(synth.started) == 8  # and nothing more: the reserved slots are full

    run(settings, scenario, text=book, interactive_slots=2)
