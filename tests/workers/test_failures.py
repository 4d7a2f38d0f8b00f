"""Each way a stage gives up on a delivery ends its job, over a real Redis (the bugs of issue 14):
a decoder entry that always fails, an assembler entry whose storage always fails, a permanent
engine error (failed at once, not after the lease ran out max_deliveries times), a dead engine
(the worker stops, hands its tasks back and leaves readiness)."""

from __future__ import annotations

import asyncio
import json
import time

import numpy as np
import pytest

from fleet import readiness
from fleet.messages import AudioChunk, CodeChunk
from fleet.storage import LocalStorage
from jobs.model import JobStatus
from jobs.service import JobRequest, submit
from models.engines.base import EngineDeadError
from models.registry import get_model, load_codec
from workers.ar import ARWorker, SegmentSynthesizer
from workers.assembler import Assembler
from workers.decoder import DecoderWorker
from workers.errors import FatalError
from workers.runtime import WorkerContext


def fast(make_settings, key_prefix, **overrides):
    """Short leases and backoffs, so that a test sees every redelivery within seconds."""
    values = dict(reclaim_idle_ms=400, retry_backoff_ms=20, max_deliveries=3, block_ms=50)
    return make_settings(key_prefix, **{**values, **overrides})


async def until(condition, timeout=30.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not await condition():
        assert time.monotonic() < deadline, f"{what} not reached"
        await asyncio.sleep(0.05)


async def run_stage(stage, condition, timeout=30.0):
    running = asyncio.create_task(stage.run())
    try:
        await until(condition, timeout)
    finally:
        stage.ctx.stop.set()
        await asyncio.gather(running, return_exceptions=True)


async def dead_letters(ctx):
    return [json.loads(f[b"h"]) for _, f in await ctx.redis.xrange(ctx.names.dead_letters())]


def test_a_decoder_poison_entry_fails_its_job_and_spares_its_batch(make_settings, key_prefix):
    settings = fast(make_settings, key_prefix)

    async def main():
        ctx = WorkerContext.create(settings)
        job = await submit(ctx.store, settings, JobRequest(text="One here. Two there."))
        await ctx.store.start_segment(job.id, 0)
        good = np.zeros((4, 7), np.int32)
        poison = np.full((4, 7), 99_999, np.int32)  # no such code: the codec cannot decode it
        codes = ctx.names.codes("tiny")
        for segment, frames in ((0, good), (1, poison)):
            chunk = CodeChunk(job.id, segment, 1, 0, "tiny", 0, 0, True, frames)
            await ctx.redis.xadd(codes, chunk.encode())
        spec = get_model("tiny", settings)
        decoder = DecoderWorker(ctx, {"tiny": load_codec(spec, settings)})

        async def failed():
            return await ctx.store.status(job.id) == JobStatus.FAILED

        await run_stage(decoder, failed)
        audio = [AudioChunk.decode(f) for _, f in await ctx.redis.xrange(ctx.names.audio())]
        result = await ctx.store.get(job.id), await dead_letters(ctx), await ctx.redis.xlen(codes), audio
        await ctx.close()
        return result

    job, letters, codes_left, audio = asyncio.run(main())
    assert job.error.startswith("segment 1 failed while decoding: failed 3 times; last error: ")
    assert "index out of range" in job.error
    assert [(d["job_id"], d["deliveries"]) for d in letters] == [(job.id, 3)]
    assert codes_left == 0
    assert [a.segment for a in audio] == [0]  # decoded once (alone after the batch failed), never again


class LostGpu:
    """A codec whose GPU context is gone (an illegal access, or another MPS client's fault)."""

    def __init__(self, codec) -> None:
        self.sample_rate = codec.sample_rate

    def decode_windows(self, windows):
        import torch

        raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered")


def test_a_decoder_whose_gpu_context_is_lost_stops_and_hands_its_chunks_back(make_settings, key_prefix):
    """A CUDA error is fatal to the process, not to the entries: the decoder exits (the supervisor
    restarts it with a new context) and hands back what it holds, failing no job and dead-lettering
    nothing, where retrying in the broken context would have dead-lettered every chunk it read."""
    settings = fast(make_settings, key_prefix, reclaim_idle_ms=60_000, heartbeat_s=0.2)

    async def main():
        ctx = WorkerContext.create(settings)
        job = await submit(ctx.store, settings, JobRequest(text="One here. Two there."))
        await ctx.store.start_segment(job.id, 0)
        codes = ctx.names.codes("tiny")
        for segment in (0, 1):
            chunk = CodeChunk(job.id, segment, 1, 0, "tiny", 0, 0, True, np.zeros((4, 7), np.int32))
            await ctx.redis.xadd(codes, chunk.encode())
        decoder = DecoderWorker(ctx, {"tiny": LostGpu(load_codec(get_model("tiny", settings), settings))})
        with pytest.raises(FatalError, match="illegal memory access"):
            await asyncio.wait_for(decoder.run(), 30)
        pending = await ctx.redis.xpending_range(codes, "decoder", min="-", max="+", count=10)
        result = await ctx.store.get(job.id), pending, await dead_letters(ctx), await ctx.redis.xlen(codes)
        await ctx.close()
        return result

    job, pending, letters, codes_left = asyncio.run(main())
    assert job.status != JobStatus.FAILED and letters == []
    assert codes_left == 2 and len(pending) == 2  # both chunks still there, for the next decoder
    assert all(p["time_since_delivered"] > 60_000 for p in pending)  # handed back, not left to the lease


class FailingStorage(LocalStorage):
    """A storage whose writes always fail (a full disk, a bucket that refuses)."""

    def put_bytes(self, key: str, data: bytes) -> None:
        raise OSError(28, "No space left on device")


def test_an_assembler_poison_entry_fails_its_job(make_settings, key_prefix, tmp_path):
    settings = fast(make_settings, key_prefix)

    async def main():
        ctx = WorkerContext.create(settings)
        ctx.storage = FailingStorage(tmp_path / "storage")
        job = await submit(ctx.store, settings, JobRequest(text="Only one."))
        await ctx.store.start_segment(job.id, 0)
        loud = (np.arange(2000) % 200 * 100).astype("<i2").tobytes()
        await ctx.redis.xadd(ctx.names.audio(), AudioChunk(job.id, 0, 1, 0, True, 24000, loud).encode())
        assembler = Assembler(ctx, enqueue=lambda *_: None)

        async def failed():
            return await ctx.store.status(job.id) == JobStatus.FAILED

        await run_stage(assembler, failed)
        result = await ctx.store.get(job.id), await dead_letters(ctx), await ctx.redis.xlen(ctx.names.audio())
        leftovers = await ctx.redis.keys(f"{key_prefix}:job:{{{job.id}}}:deltas:*")
        await ctx.close()
        return (*result, leftovers)

    job, letters, audio_left, leftovers = asyncio.run(main())
    assert job.error == (
        "segment 0 failed while assembling: failed 3 times; last error: [Errno 28] No space left on device"
    )
    assert len(letters) == 1 and audio_left == 0 and leftovers == []  # its deltas went with the job's end


def synthesizer(settings, engine):
    spec = get_model("tiny", settings)
    return SegmentSynthesizer.for_model(spec, settings, engine)


def test_a_permanent_engine_error_fails_the_job_at_the_first_delivery(make_settings, key_prefix):
    from models.engines.reference import ReferenceEngine

    # the default lease (60 s) and delivery limit: a retry would take minutes
    settings = make_settings(key_prefix, reclaim_idle_ms=60_000, max_deliveries=5, max_model_len=200)
    spec = get_model("tiny", settings)
    poison = "Fine. Long" + " word" * 50 + " end. Fine again."  # segment 1's prompt exceeds 200 tokens

    async def main():
        ctx = WorkerContext.create(settings)
        job = await submit(ctx.store, settings, JobRequest(text=poison))
        engine = ReferenceEngine(spec.checkpoint(settings), max_num_seqs=4, max_model_len=200)
        worker = ARWorker(ctx, "tiny", synthesizer(settings, engine), 4)
        started = time.monotonic()

        async def failed():
            return await ctx.store.status(job.id) == JobStatus.FAILED

        await run_stage(worker, failed, timeout=20)
        took = time.monotonic() - started
        await engine.shutdown()
        result = await ctx.store.get(job.id), await dead_letters(ctx), took
        await ctx.close()
        return result

    job, letters, took = asyncio.run(main())
    assert job.error == (
        "segment 1 failed while narrating: the prompt of 271 tokens does not fit the engine (max_model_len 200)"
    )
    assert [d["deliveries"] for d in letters] == [1]
    assert took < 5


class DeadEngine:
    """An engine whose core has died: every request fails with the engine interface's dead-engine error."""

    max_num_seqs = 4

    async def generate(self, request_id, prompt, params):
        await asyncio.sleep(0.05)
        raise EngineDeadError("the engine core died")
        yield  # an async generator

    async def abort(self, request_id):
        pass


def test_a_dead_engine_stops_the_worker_hands_back_its_tasks_and_leaves_readiness(make_settings, key_prefix):
    settings = make_settings(key_prefix, reclaim_idle_ms=60_000, heartbeat_s=0.2)

    async def main():
        ctx = WorkerContext.create(settings)
        job = await submit(ctx.store, settings, JobRequest(text="One. Two. Three."))
        worker = ARWorker(ctx, "tiny", synthesizer(settings, DeadEngine()), 4)
        running = asyncio.create_task(worker.run())
        await until(lambda: _live(ctx), timeout=10, what="the worker's first heartbeat")
        with pytest.raises(FatalError, match="the engine core died"):
            await asyncio.wait_for(running, 10)
        live = await readiness.live_counts(ctx.redis, ctx.names, [("ar", "tiny")], settings.heartbeat_s)
        tasks = ctx.names.tasks("tiny")
        pending = await ctx.redis.xpending_range(tasks, "ar", min="-", max="+", count=10)
        result = await ctx.store.get(job.id), live, pending, await dead_letters(ctx)
        await ctx.close()
        return result

    job, live, pending, letters = asyncio.run(main())
    assert live[("ar", "tiny")] == 0  # gone from readiness at once, not after 3 missed heartbeats
    assert len(pending) == 3 and all(p["time_since_delivered"] > 60_000 for p in pending)  # handed back
    assert job.status != JobStatus.FAILED and letters == []  # the tasks are fine; another worker redoes them


async def _live(ctx) -> bool:
    counts = await readiness.live_counts(ctx.redis, ctx.names, [("ar", "tiny")], ctx.settings.heartbeat_s)
    return counts[("ar", "tiny")] > 0
