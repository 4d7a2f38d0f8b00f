"""The decoder worker's batching on a real Redis: it waits briefly to fill a batch, except for a
job's first segment (what a listener waits for), which it decodes at once."""

from __future__ import annotations

import asyncio
import os
import sys

import numpy as np
import pytest
import redis.asyncio as aioredis

from fleet.messages import AudioChunk, CodeChunk
from fleet.names import Names
from fleet.settings import Settings
from fleet.storage import LocalStorage
from jobs.service import JobRequest, tasks_for, validate
from jobs.store import JobStore
from workers.decoder import DecoderWorker
from workers.runtime import WorkerContext


class RecordingCodec:
    """Stands in for SNAC: records which windows were decoded together."""

    sample_rate = 24_000

    def __init__(self) -> None:
        self.calls: list[list[int]] = []

    def decode_windows(self, windows):
        self.calls.append([int(frames.shape[0]) for frames, _, _ in windows])
        return [
            np.zeros((frames.shape[0] - left - right) * 2048, np.float32) for frames, left, right in windows
        ]


@pytest.fixture
def decoder(redis_url, key_prefix, tmp_path):
    async def make(linger_ms: int):
        settings = Settings(
            redis_url=redis_url,
            key_prefix=key_prefix,
            data_dir=tmp_path,
            block_ms=50,
            decode_linger_ms=linger_ms,
        )
        redis = aioredis.from_url(redis_url)
        names = Names(key_prefix)
        store = JobStore(redis, names, events_maxlen=1000, result_ttl_s=60)
        ctx = WorkerContext(settings, redis, names, store, LocalStorage(tmp_path / "s"), asyncio.Event())
        job, plan = validate(JobRequest(text="One. Two. Three. Four."), settings)
        await store.create(job, plan, tasks_for(job, plan))
        codec = RecordingCodec()
        worker = DecoderWorker(ctx, {job.model: codec})
        await worker.transport.setup()
        return ctx, worker, codec, job

    return make


def chunk(job, segment: int, frames: int) -> dict:
    return CodeChunk(
        job.id, segment, 1, 0, job.model, left=0, right=0, final=True, frames=np.zeros((frames, 7), np.int32)
    ).encode()


async def audio_entries(ctx) -> list[AudioChunk]:
    return [AudioChunk.decode(fields) for _, fields in await ctx.redis.xrange(ctx.names.audio())]


def test_a_short_batch_waits_once_for_more_chunks(decoder):
    async def main():
        ctx, worker, codec, job = await decoder(linger_ms=600)
        codes = ctx.names.codes(job.model)
        for segment in (1, 2):
            await ctx.redis.xadd(codes, chunk(job, segment, 32))
        step = asyncio.create_task(worker.step())
        await asyncio.sleep(0.2)
        await ctx.redis.xadd(codes, chunk(job, 3, 32))  # arrives while the decoder lingers
        await step
        assert codec.calls == [[32, 32, 32]]
        assert sorted(a.segment for a in await audio_entries(ctx)) == [1, 2, 3]
        await ctx.redis.aclose()

    asyncio.run(main())


def test_a_first_segment_is_decoded_at_once(decoder):
    async def main():
        ctx, worker, codec, job = await decoder(linger_ms=5_000)
        codes = ctx.names.codes(job.model)
        await ctx.redis.xadd(codes, chunk(job, 0, 6))
        await ctx.redis.xadd(codes, chunk(job, 2, 32))
        await asyncio.wait_for(worker.step(), 2.0)  # far less than the linger
        assert codec.calls == [[6], [32]]  # without waiting; the job's first window decoded alone, first
        assert [a.segment for a in await audio_entries(ctx)] == [0, 2]  # and published first
        await ctx.redis.aclose()

    asyncio.run(main())


def test_a_first_segment_arriving_during_the_linger_ends_it(decoder):
    async def main():
        ctx, worker, codec, job = await decoder(linger_ms=5_000)
        codes = ctx.names.codes(job.model)
        await ctx.redis.xadd(codes, chunk(job, 2, 32))
        step = asyncio.create_task(worker.step())
        await asyncio.sleep(0.2)  # the decoder lingers for more chunks
        assert not step.done()
        await ctx.redis.xadd(codes, chunk(job, 0, 6))  # a listener waits for this one
        await asyncio.wait_for(step, 1.0)  # far less than the linger
        assert codec.calls == [[6], [32]]
        assert [a.segment for a in await audio_entries(ctx)] == [0, 2]
        await ctx.redis.aclose()

    asyncio.run(main())


def test_the_stats_line_tells_a_gpu_workers_peak_memory_and_nothing_on_the_cpu(monkeypatch):
    """What a decoder takes of its GPU beside the AR engines (the figure the per-GPU memory check
    lacks): the allocator's peak, read from its counters; on the CPU (CUDA never initialised) nothing."""
    import types

    import torch

    from workers.runtime import gpu_memory_peak

    assert not torch.cuda.is_initialized() and gpu_memory_peak() == ""
    cuda = types.SimpleNamespace(
        is_initialized=lambda: True,
        max_memory_reserved=lambda: 1536 * 2**20,
        max_memory_allocated=lambda: 600 * 2**20,
    )
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
    assert gpu_memory_peak() == ", GPU memory 1536 MiB at most (600 MiB in tensors)"


def test_a_decoders_gpu_memory_limit_sets_the_allocators_share_and_reclaim_threshold(monkeypatch):
    """decoder_gpu_memory_gb: the allocator's share of the card and its reclaim threshold, set before
    the first allocation; nothing on the CPU or without a limit. (The CUDA calls are stand-ins here:
    no GPU on this machine; bench/decoder_speed.py --memory --memory-limit-gb measures it on one.)"""
    import types

    from workers.runtime import limit_gpu_memory

    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    assert limit_gpu_memory(None, "cuda") is None and limit_gpu_memory(8, "cpu") is None
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:512"  # untouched
    calls = []
    cuda = types.SimpleNamespace(
        get_device_properties=lambda index: types.SimpleNamespace(total_memory=80 * 2**30),
        set_per_process_memory_fraction=lambda fraction, index: calls.append((fraction, index)),
    )
    import torch

    monkeypatch.setattr(torch, "cuda", cuda)
    said = limit_gpu_memory(8, "cuda:1")
    assert calls == [(0.1, 1)]
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:512,garbage_collection_threshold:0.8"
    assert said == "8 GiB of 80 (0.100), max_split_size_mb:512,garbage_collection_threshold:0.8"
    limit_gpu_memory(200, "cuda")  # more than the card: the whole card, the threshold not repeated
    assert calls[-1] == (1.0, 0)
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"].count("garbage_collection_threshold") == 1
