"""The compute of both stages, apart from Redis Streams: AR worker (reference engine, tiny model) and
decoder (SNAC) chained over the in-memory transport, each running its real stage loop. Every segment
comes out once, as delta audio in order, equal to generating and decoding it whole (I1)."""

from __future__ import annotations

import asyncio

import fakeredis
import numpy as np
import pytest

from fleet.messages import AudioChunk, CodeChunk
from fleet.names import Names
from fleet.settings import Settings
from fleet.storage import LocalStorage
from jobs.service import JobRequest, tasks_for, validate
from jobs.store import JobStore
from models.engines.reference import ReferenceEngine
from models.registry import get_model, load_codec
from testing.fleetkit import offline_segment_audio
from workers.ar import ARWorker, SegmentSynthesizer
from workers.decoder import DecoderWorker
from workers.runtime import WorkerContext
from workers.transport import MemoryBroker

TEXT = (
    "# A test\n\nThe gulls argued over the nets. Hale counted crates. It was warm. The harbour master walked "
    "the long stone quay at dawn, counting the boats that had come in overnight and the ones that had not."
)


@pytest.mark.parametrize("uniform", [False, True])
def test_ar_and_decoder_over_memory_streams_give_the_offline_audio(data_dir, tiny_dir, uniform):
    settings = Settings(
        redis_url="redis://unused", key_prefix="t", data_dir=data_dir, block_ms=10, uniform_windows=uniform
    )
    redis = fakeredis.FakeAsyncRedis()
    names = Names("t")
    store = JobStore(redis, names, events_maxlen=1000, result_ttl_s=60)
    broker = MemoryBroker()
    spec = get_model("tiny", settings)

    def context() -> WorkerContext:  # one per stage: each stops on its own
        return WorkerContext(settings, redis, names, store, LocalStorage(data_dir / "s"), asyncio.Event())

    async def main():
        job, plan = validate(JobRequest(text=TEXT, voice="leo"), settings)
        await store.create(job, plan, [])
        for task in tasks_for(job, plan):
            broker.put(names.tasks("tiny"), task.encode())
        engine = ReferenceEngine(spec.checkpoint(settings), max_num_seqs=4)
        synth = SegmentSynthesizer.for_model(spec, settings, engine)
        ar_ctx, dec_ctx = context(), context()
        ar = ARWorker(ar_ctx, "tiny", synth, 4, transport=broker.transport([names.tasks("tiny")]))
        dec = DecoderWorker(
            dec_ctx, {"tiny": load_codec(spec, settings)}, transport=broker.transport([names.codes("tiny")])
        )
        stages = [asyncio.create_task(ar.run()), asyncio.create_task(dec.run())]
        finals = lambda: sum(AudioChunk.decode(f).final for f in broker.published.get(names.audio(), []))  # noqa: E731
        deadline = asyncio.get_running_loop().time() + 120
        while finals() < len(plan.segments) or broker.pending(names.codes("tiny")):
            assert asyncio.get_running_loop().time() < deadline and not any(s.done() for s in stages)
            await asyncio.sleep(0.02)
        ar_ctx.stop.set()
        dec_ctx.stop.set()
        await asyncio.gather(*stages)
        await engine.shutdown()
        return plan

    plan = asyncio.run(main())
    assert broker.pending(names.tasks("tiny")) == 0 and broker.dead == []
    chunks = [CodeChunk.decode(f) for f in broker.published[names.codes("tiny")]]
    audio = [AudioChunk.decode(f) for f in broker.published[names.audio()]]
    reference = offline_segment_audio(settings, [s.spoken_text for s in plan.segments], "leo")
    for segment, ref in zip(plan.segments, reference, strict=True):
        mine = sorted((a for a in audio if a.segment == segment.index), key=lambda a: a.seq)
        assert [a.seq for a in mine] == list(range(len(mine))) and mine[-1].final  # each delta once, in order
        assert len({a.attempt for a in mine}) == 1
        frames = sum(c.new_frames for c in chunks if c.segment == segment.index)
        pcm = np.frombuffer(b"".join(a.pcm for a in mine), "<i2")
        assert pcm.size == frames * 2048 == ref.size > 0
        assert np.max(np.abs(pcm.astype(np.int32) - ref)) <= 2, f"segment {segment.index} differs"
        lengths = [c.frames.shape[0] for c in chunks if c.segment == segment.index]
        if uniform and segment.index > 0:  # the ramp (segment 0) keeps its growing windows
            assert set(lengths) == {4 + 25 + 3} if frames >= 32 else lengths == [frames]
    long = [c.frames.shape[0] for c in chunks if c.segment == len(plan.segments) - 1]
    assert len(long) >= 3  # the last sentence: a first, steady and final window
    assert len(set(long)) == 1 if uniform else len(set(long)) > 1
