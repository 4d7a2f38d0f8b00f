"""Runaway segments in the AR stage: detection in the synthesizer (reference engine, real checkpoints
made to misbehave) and the worker's answer over a real Redis: retry with the next seed, superseding
what the runaway attempt already published; after the last retry, keep and flag. And invalid codes:
a permanent error that fails the job."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from fleet.messages import AudioChunk, CodeChunk, SegmentTask
from jobs.model import JobStatus
from jobs.service import JobRequest, submit
from models.engines.reference import ReferenceEngine
from models.registry import get_model
from models.runaway import NEVER_STOPS, REPEATS, RunawayError, retry_seed
from tests.broken_models import repeating_checkpoint
from workers.ar import ARWorker, SegmentSynthesizer
from workers.runtime import WorkerContext

TEXT = "The gulls argued over the nets."  # 31 characters: a budget of 53 Orpheus frames


@pytest.fixture(scope="module")
def repeating_dir(tiny_dir, tmp_path_factory):
    return repeating_checkpoint(tiny_dir, tmp_path_factory.mktemp("repeating"))


def synthesizer(settings, model="orpheus", engine=None):
    spec = get_model(model, settings)
    engine = engine or ReferenceEngine(spec.checkpoint(settings), max_num_seqs=4, max_model_len=1024)
    return SegmentSynthesizer.for_model(spec, settings, engine)


async def run_segment(synth, task):
    windows = []
    try:
        async for batch in synth.windows(task, f"{task.job_id}:{task.segment}:1"):
            windows += batch
        return windows, None
    except RunawayError as exc:
        return windows, exc
    finally:
        await synth.engine.shutdown()


def test_a_model_that_never_stops_is_a_runaway_once_its_budget_is_spent(make_settings, tiny_dir):
    # the tiny weights never emit the stop token; Orpheus' family requires one
    settings = make_settings("unused", models="tiny,orpheus", orpheus_dir=tiny_dir)
    task = SegmentTask("j", 0, TEXT, "orpheus", "tara", seed=5)
    windows, exc = asyncio.run(run_segment(synthesizer(settings), task))
    assert exc is not None and exc.kind == NEVER_STOPS and "no stop token after 53 frames" in exc.detail
    assert sum(w.new_frames for w in windows + exc.flush) == 53  # the whole budget, every frame once
    assert exc.flush[-1].final and not any(w.final for w in windows)  # nothing final went out


def test_reaching_the_budget_is_how_tiny_segments_end(make_settings):
    task = SegmentTask("j", 0, TEXT, "tiny", "tara", seed=5)
    windows, exc = asyncio.run(run_segment(synthesizer(make_settings("unused"), "tiny"), task))
    assert exc is None and windows[-1].final and sum(w.new_frames for w in windows) == 19


def test_a_model_that_loops_is_caught_two_seconds_in(make_settings, repeating_dir):
    settings = make_settings("unused", models="tiny,orpheus", orpheus_dir=repeating_dir)
    task = SegmentTask("j", 0, TEXT, "orpheus", "tara", seed=5)
    windows, exc = asyncio.run(run_segment(synthesizer(settings), task))
    assert exc is not None and exc.kind == REPEATS, exc
    assert "a cycle of 1 frame(s) repeated for 25 frames (2.1 s) from frame 0" in exc.detail
    frames = sum(w.new_frames for w in windows + exc.flush)
    assert frames == 25 < 53  # stopped at the detection, long before the budget


class Unconstrained:
    """The reference engine with the frame constraint taken off every request: nothing then keeps the
    LM's tokens to codes of the right position."""

    def __init__(self, engine: ReferenceEngine) -> None:
        self.engine = engine
        self.max_num_seqs = engine.max_num_seqs

    async def start(self) -> None: ...

    def generate(self, request_id, prompt, params):
        from dataclasses import replace

        return self.engine.generate(request_id, prompt, replace(params, constraint=None))

    async def abort(self, request_id) -> None:
        await self.engine.abort(request_id)

    async def shutdown(self) -> None:
        await self.engine.shutdown()


async def run_worker_until(settings, synth, model, condition, timeout=120):
    ctx = WorkerContext.create(settings)
    worker = ARWorker(ctx, model, synth, max_in_flight=4)
    running = asyncio.create_task(worker.run())
    try:
        deadline = time.monotonic() + timeout
        while not await condition(ctx):
            assert time.monotonic() < deadline, "condition not reached"
            assert not running.done(), running
            await asyncio.sleep(0.1)
    finally:
        ctx.stop.set()
        await running
        await synth.engine.shutdown()
    return ctx


def test_invalid_codes_fail_the_job_with_a_reason(make_settings, key_prefix, tiny_dir):
    settings = make_settings(key_prefix)
    spec = get_model("tiny", settings)
    synth = synthesizer(
        settings, "tiny", Unconstrained(ReferenceEngine(spec.checkpoint(settings), max_num_seqs=4))
    )

    async def main():
        ctx = WorkerContext.create(settings)
        job = await submit(ctx.store, settings, JobRequest(text="Only one sentence here."))
        await ctx.close()

        async def failed(c):
            return (await c.store.status(job.id)) == JobStatus.FAILED

        ctx = await run_worker_until(settings, synth, "tiny", failed)
        ctx = WorkerContext.create(settings)
        try:
            got = await ctx.store.get(job.id)
            letters = await ctx.redis.xrange(ctx.names.dead_letters())
            tasks = await ctx.redis.xlen(ctx.names.tasks("tiny"))
            return got, letters, tasks
        finally:
            await ctx.close()

    got, letters, tasks = asyncio.run(main())
    assert got.status == JobStatus.FAILED
    assert got.error.startswith(
        "segment 0 failed while narrating: the model produced an invalid code: token "
    )
    assert "is not a code for that position" in got.error
    assert len(letters) == 1 and tasks == 0  # dead-lettered, never retried


def test_runaway_is_retried_with_the_next_seed_then_kept_flagged(make_settings, key_prefix, repeating_dir):
    settings = make_settings(key_prefix, models="tiny,orpheus", orpheus_dir=repeating_dir, runaway_retries=1)

    async def main():
        ctx = WorkerContext.create(settings)
        job = await submit(ctx.store, settings, JobRequest(text=TEXT, model="orpheus"))
        await ctx.close()

        async def flagged(c):
            return (await c.store.get(job.id)).segments_flagged == 1

        ctx = await run_worker_until(settings, synthesizer(settings), "orpheus", flagged)
        ctx = WorkerContext.create(settings)
        try:
            chunks = [CodeChunk.decode(f) for _, f in await ctx.redis.xrange(ctx.names.codes("orpheus"))]
            events = await ctx.store.read_events(job.id, "0-0", None)
            runaway = min(c.attempt for c in chunks)
            late = AudioChunk(job.id, 0, runaway, 1, True, 24000, bytes(4000))  # the runaway's audio, late
            state = await ctx.store.add_delta(late)
            latest = await ctx.redis.hget(ctx.names.attempts(job.id), "0")
            return job, chunks, events, state, int(latest), await ctx.store.flags(job.id)
        finally:
            await ctx.close()

    job, chunks, events, state, latest, flags = asyncio.run(main())
    tries = sorted({c.attempt for c in chunks})
    assert len(tries) == 2 and tries[-1] == latest  # the first try, then one retry
    first = [c for c in chunks if c.attempt == tries[0]]
    second = [c for c in chunks if c.attempt == tries[1]]
    # the first try had published a window before its loop was caught, but no final one
    assert first and not any(c.final for c in first) and all(c.retry == 0 for c in first)
    assert second[-1].final and all(c.retry == 1 for c in second)
    assert sum(c.new_frames for c in second) == 25  # kept up to the detection, not padded or cut
    kinds = [(e.type.value, e.data) for e in events]
    runaway = [d for k, d in kinds if k == "runaway"]
    warning = [d for k, d in kinds if k == "warning"]
    assert (
        runaway == [{"index": 0, "retry": 0, "kind": REPEATS, "detail": runaway[0]["detail"]}]
        and "cycle of 1 frame" in runaway[0]["detail"]
    )
    assert warning == [{"index": 0, "kind": REPEATS, "detail": warning[0]["detail"], "retries": 1}]
    assert flags == {0: {"kind": REPEATS, "detail": warning[0]["detail"], "retries": 1}}
    assert state == "stale"  # audio of the abandoned attempt is dropped on arrival
    assert retry_seed(job.seed, 1) != job.seed
    assert json.dumps(flags)  # plain JSON for the manifest


def test_only_a_jobs_first_segment_starts_with_the_small_chunk_ramp(make_settings, tiny_dir):
    """Segment 0 is what a listener waits for: 1 frame, then 2, 4, 8, 16, 25. Later segments run
    alongside it and start at the full chunk (fewer windows to decode)."""
    settings = make_settings("unused", models="tiny,orpheus", orpheus_dir=tiny_dir)
    sizes = {}
    for segment in (0, 1):
        task = SegmentTask("j", segment, TEXT, "orpheus", "tara", seed=5)
        windows, exc = asyncio.run(run_segment(synthesizer(settings), task))
        sizes[segment] = [w.new_frames for w in windows + exc.flush]  # the tiny model never stops: 53 frames
    assert sizes[0] == [1, 2, 4, 8, 16, 22]
    assert sizes[1] == [25, 25, 3]
