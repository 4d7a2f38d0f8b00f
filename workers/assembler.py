"""The assembler: delta PCM in, whole segments in storage, progress out, finalize queued.

Deltas of one attempt at a segment may arrive in any order and from any decoder; they are kept in a
Redis hash by chunk number (so any assembler can finish any segment, and a redelivered delta
overwrites itself). When all chunks of an attempt are in, the segment's audio is written to storage
and recorded once (the first attempt to complete wins; its deltas leave Redis). The last segment
queues the RQ finalize job.

It is also the first stage that holds a segment's audio in one piece, so it judges near-silence (a
runaway, models/runaway.py): a whole segment below the model's ``silence_dbfs`` is retried with the
next seed, or, after ``runaway_retries`` retries, kept and flagged.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from fleet.messages import AudioChunk, MessageError
from fleet.names import ASSEMBLER_GROUP, part_object
from fleet.redis import TRANSIENT_ERRORS
from fleet.settings import Settings
from jobs.finalize import enqueue_finalize
from jobs.service import segment_task
from models.registry import MODELS
from models.runaway import SILENCE, level_dbfs
from workers.consumer import Delivery
from workers.runtime import WorkerContext, resilient_loop

log = logging.getLogger(__name__)


class Assembler:
    def __init__(
        self, ctx: WorkerContext, enqueue: Callable[[Settings, str], None] = enqueue_finalize
    ) -> None:
        self.ctx = ctx
        self.enqueue = enqueue  # queues the finalize job (RQ); idempotent
        self.consumer = ctx.consumer([ctx.names.audio()], ASSEMBLER_GROUP, "assembler")

    async def run(self) -> None:
        lease = asyncio.create_task(self.consumer.lease_loop(self.ctx.stop))
        try:
            await resilient_loop(self._step, self.ctx, self.consumer, "assembler")
        finally:
            lease.cancel()
            await asyncio.gather(lease, return_exceptions=True)

    async def _step(self) -> None:
        for delivery in await self.consumer.next_batch(64, self.ctx.settings.block_ms):
            await self.handle(delivery)  # idempotent: a batch interrupted by an outage is redone
        self.consumer.batch_done()

    async def handle(self, delivery: Delivery) -> None:
        try:
            chunk = AudioChunk.decode(delivery.fields)
        except MessageError as exc:
            job_id = await self.consumer.dead_letter(delivery, f"unreadable audio chunk: {exc}")
            if job_id:
                await self.ctx.store.fail(job_id, f"an audio chunk could not be read: {exc}")
            return
        try:
            state = await self.ctx.store.add_delta(chunk)
            if state == "complete":
                await self.complete_segment(chunk)
            elif state == "finalizing":  # a redelivery after the last segment: make sure finalize is queued
                await asyncio.to_thread(self.enqueue, self.ctx.settings, chunk.job_id)
        except TRANSIENT_ERRORS:
            raise  # Redis is away: the worker loop waits and redoes this batch
        except Exception:  # noqa: BLE001 - leave it pending: redelivered, then dead-lettered
            log.exception("assembling %s segment %d failed", chunk.job_id, chunk.segment)
            self.consumer.release(delivery)
            return
        await self.consumer.ack(delivery)

    async def complete_segment(self, chunk: AudioChunk) -> None:
        store = self.ctx.store
        pcm = b"".join(await store.deltas(chunk.job_id, chunk.segment, chunk.attempt))
        if await self._silent_runaway_retried(chunk, pcm):
            return
        key = part_object(chunk.job_id, chunk.segment, chunk.attempt)
        await asyncio.to_thread(self.ctx.storage.put_bytes, key, pcm)
        samples = len(pcm) // 2
        result = await store.segment_done(
            chunk.job_id, chunk.segment, chunk.attempt, samples, samples / chunk.sample_rate
        )
        if not result.keeps_part_of(chunk.attempt):  # another attempt won, or the job is over
            await asyncio.to_thread(self.ctx.storage.delete_prefix, key)
        if result.job_complete:
            log.info("job %s: all %d segments assembled", chunk.job_id, result.total)
            await asyncio.to_thread(self.enqueue, self.ctx.settings, chunk.job_id)

    async def _silent_runaway_retried(self, chunk: AudioChunk, pcm: bytes) -> bool:
        """Near-silence check of a whole segment: retry it (True), or flag it on its last try."""
        job = await self.ctx.store.get(chunk.job_id)
        spec = MODELS.get(job.model) if job is not None else None
        if spec is None:
            return False  # the job is gone: segment_done drops it
        if spec.single_stage:
            return False  # no sampling, no seed: a retry would say the same (eSpeak NG)
        level = level_dbfs(pcm)
        threshold = spec.family.runaway.silence_dbfs
        if level >= threshold:
            return False
        detail = (
            f"the segment's level is {level:.1f} dBFS over {len(pcm) // 2} samples (limit {threshold} dBFS)"
        )
        if chunk.retry < self.ctx.settings.runaway_retries:
            log.warning("job %s segment %d is near-silent (%s); retrying", job.id, chunk.segment, detail)
            plan = await self.ctx.store.plan(job.id)
            task = segment_task(job, plan.segments[chunk.segment], retry=chunk.retry)
            await self.ctx.store.retry_runaway(task, chunk.attempt, SILENCE, detail)
            return True
        await self.ctx.store.flag_segment(job.id, chunk.segment, SILENCE, detail, chunk.retry)
        return False


async def run_assembler(ctx: WorkerContext) -> None:
    await Assembler(ctx).run()
