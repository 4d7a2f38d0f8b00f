"""Stage streams in several shards (``task_shards``) on a real Redis: a job's code chunks and audio go to
its shard; decoders and assemblers read every shard; back-pressure sums the shards of a stage."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import redis.asyncio as aioredis

from fleet.messages import AudioChunk, CodeChunk
from fleet.names import Names
from fleet.settings import Settings
from fleet.storage import LocalStorage
from jobs.model import Job
from jobs.scheduler import shard_of
from jobs.segmentation import Plan
from jobs.service import JobRequest, submit, tasks_for, validate
from jobs.store import JobStore
from models.streaming import Window
from workers.ar import ARWorker
from workers.assembler import Assembler
from workers.decoder import DecoderWorker
from workers.runtime import WorkerContext
from workers.speech import SpeechWorker

SHARDS = 3
LOUD = 300  # above the near-silence limit (models/runaway.py)


@pytest.fixture
def settings(redis_url, key_prefix, tmp_path):
    """``make(**overrides)``: settings of the test's prefix, with ``SHARDS`` shards."""

    def make(**overrides) -> Settings:
        values = dict(
            redis_url=redis_url, key_prefix=key_prefix, data_dir=tmp_path, block_ms=50, task_shards=SHARDS,
            models="tiny,espeak", decode_linger_ms=0,
        )  # fmt: skip
        return Settings(**{**values, **overrides})

    return make


def run(settings: Settings, scenario):
    """``scenario(ctx)`` with a worker context of its own event loop."""

    async def main():
        redis = aioredis.from_url(settings.redis_url)
        store = JobStore.for_settings(redis, settings)
        storage = LocalStorage(settings.data_dir / "s")
        ctx = WorkerContext(settings, redis, Names(settings.key_prefix), store, storage, asyncio.Event())
        try:
            return await scenario(ctx)
        finally:
            await ctx.close()

    return asyncio.run(main())


def one_job_per_shard(settings: Settings, text: str = "Only one.") -> list[tuple[Job, Plan]]:
    """A job (and its plan) in each shard, in shard order (ids are random: validate until each has one)."""
    found: dict[int, tuple[Job, object]] = {}
    while len(found) < settings.task_shards:
        job, plan = validate(JobRequest(text=text), settings)
        found.setdefault(shard_of(job.id, settings.task_shards), (job, plan))
    return [found[s] for s in range(settings.task_shards)]


async def entries(ctx: WorkerContext, stream: str, message):
    return [message.decode(fields) for _, fields in await ctx.redis.xrange(stream)]


async def steps_until_empty(ctx: WorkerContext, stage, streams: list[str]) -> None:
    for _ in range(100):
        if not sum([await ctx.redis.xlen(s) for s in streams]):
            return
        await stage.step()
    raise AssertionError(f"{stage.kind} left entries on its streams")


class OneWindow:
    """Stands in for the engine: one final window of 3 frames per segment."""

    async def windows(self, task, request_id):
        yield [Window(0, np.zeros((3, 7), np.int32), 0, 0, True)]


def test_ar_workers_publish_each_jobs_codes_to_its_shard(settings):
    async def main(ctx):
        jobs = []
        for job, plan in one_job_per_shard(ctx.settings):  # queued for admission
            await ctx.store.create(job, plan, tasks_for(job, plan))
            jobs.append(job)
        worker = ARWorker(ctx, "tiny", OneWindow(), max_in_flight=4)
        running = asyncio.create_task(worker.run())
        codes = [ctx.names.codes("tiny", s) for s in range(SHARDS)]
        for _ in range(200):
            if sum([await ctx.redis.xlen(s) for s in codes]) == SHARDS:
                break
            await asyncio.sleep(0.02)
        ctx.stop.set()
        await running
        return jobs, [[c.job_id for c in await entries(ctx, s, CodeChunk)] for s in codes]

    jobs, per_shard = run(settings(), main)
    assert per_shard == [[job.id] for job in jobs]


class QuietSpeaker:
    """Stands in for eSpeak NG: one final piece of audio per segment."""

    class engine:
        sample_rate = 22_050

    async def pieces(self, task):
        yield np.full(4, LOUD, np.int16), True


def test_speech_workers_publish_each_jobs_audio_to_its_shard(settings):
    async def main(ctx):
        jobs = []
        while len({shard_of(j.id, SHARDS) for j in jobs}) < SHARDS:  # submitted: queued for admission
            jobs.append(await submit(ctx.store, ctx.settings, JobRequest(text="Only one.", model="espeak")))
        worker = SpeechWorker(ctx, {"espeak": QuietSpeaker()})
        running = asyncio.create_task(worker.run())
        audio = [ctx.names.audio(s) for s in range(SHARDS)]
        for _ in range(200):
            if sum([await ctx.redis.xlen(s) for s in audio]) == len(jobs):
                break
            await asyncio.sleep(0.02)
        ctx.stop.set()
        await running
        return jobs, [sorted(a.job_id for a in await entries(ctx, s, AudioChunk)) for s in audio]

    jobs, per_shard = run(settings(), main)
    assert per_shard == [sorted(j.id for j in jobs if shard_of(j.id, SHARDS) == s) for s in range(SHARDS)]


class RecordingCodec:
    sample_rate = 24_000

    def decode_windows(self, windows):
        return [np.full((f.shape[0] - left - right) * 8, 0.01, np.float32) for f, left, right in windows]


def test_a_decoder_reads_every_shard_and_publishes_to_the_jobs_shard(settings):
    async def main(ctx):
        jobs = []
        for job, plan in one_job_per_shard(ctx.settings, "One. Two. Three."):
            await ctx.store.create(job, plan, tasks_for(job, plan))
            jobs.append(job)
        worker = DecoderWorker(ctx, {"tiny": RecordingCodec()})
        await worker.transport.setup()
        codes = [ctx.names.codes("tiny", s) for s in range(SHARDS)]
        for shard, job in enumerate(jobs):
            for segment in range(3):
                chunk = CodeChunk(job.id, segment, 1, 0, "tiny", 0, 0, True, np.zeros((2, 7), np.int32))
                await ctx.redis.xadd(codes[shard], chunk.encode())
        await steps_until_empty(ctx, worker, codes)
        return jobs, [await entries(ctx, ctx.names.audio(s), AudioChunk) for s in range(SHARDS)]

    jobs, audio = run(settings(), main)
    for job, chunks in zip(jobs, audio, strict=True):
        assert sorted((a.job_id, a.segment) for a in chunks) == [(job.id, s) for s in range(3)]


def test_an_assembler_reads_every_shard(settings):
    enqueued: list[str] = []

    async def main(ctx):
        jobs = []
        for job, plan in one_job_per_shard(ctx.settings):
            await ctx.store.create(job, plan, tasks_for(job, plan))
            assert await ctx.store.start_segment(job.id, 0) > 0
            jobs.append(job)
        assembler = Assembler(ctx, enqueue=lambda _settings, job_id: enqueued.append(job_id))
        await assembler.transport.setup()
        audio = [ctx.names.audio(s) for s in range(SHARDS)]
        for shard, job in enumerate(jobs):
            pcm = np.full(4, LOUD, "<i2").tobytes()
            await ctx.redis.xadd(audio[shard], AudioChunk(job.id, 0, 1, 0, True, 16_000, pcm).encode())
        await steps_until_empty(ctx, assembler, audio)
        return jobs, [await ctx.store.completed_segments(job.id) for job in jobs]

    jobs, completed = run(settings(), main)
    assert completed == [{0: (1, 4)}] * SHARDS
    assert sorted(enqueued) == sorted(job.id for job in jobs)  # each job finalized


def test_back_pressure_counts_every_shard_of_a_stage(settings):
    """``max_stream_backlog`` bounds what waits for a stage in all its shards together: 3 + 2 entries
    hold an AR worker back at 4, though no shard holds more than 4."""

    async def main(ctx):
        ar = ARWorker(ctx, "tiny", OneWindow(), max_in_flight=1)
        speech = SpeechWorker(ctx, {"espeak": QuietSpeaker()})
        held = []
        for stream, count in ((ctx.names.codes("tiny", 0), 2), (ctx.names.codes("tiny", 2), 2)):
            for _ in range(count):
                await ctx.redis.xadd(stream, {b"x": b"1"})
        held.append((await ar.backlogged(), await speech.backlogged()))  # 4 codes: not over
        await ctx.redis.xadd(ctx.names.codes("tiny", 1), {b"x": b"1"})
        held.append((await ar.backlogged(), await speech.backlogged()))  # 5 codes: decoders behind
        await ctx.redis.delete(*(ctx.names.codes("tiny", s) for s in range(SHARDS)))
        for stream, count in ((ctx.names.audio(0), 3), (ctx.names.audio(1), 2)):
            for _ in range(count):
                await ctx.redis.xadd(stream, {b"x": b"1"})
        held.append((await ar.backlogged(), await speech.backlogged()))  # 5 audio: assemblers behind
        return held

    assert run(settings(max_stream_backlog=4), main) == [(False, False), (True, False), (True, True)]
