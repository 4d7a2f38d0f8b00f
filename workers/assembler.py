"""The assembler: delta PCM in, whole segments in storage, progress out, finalize queued.

Deltas of one attempt at a segment may arrive in any order and from any decoder; they are kept in a
Redis hash by chunk number (so any assembler can finish any segment, and a redelivered delta
overwrites itself). When all chunks of an attempt are in, the segment's audio is written to storage
and recorded once (the first attempt to complete wins; its deltas leave Redis). The last segment
queues the RQ finalize job.
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


async def run_assembler(ctx: WorkerContext) -> None:
    await Assembler(ctx).run()
