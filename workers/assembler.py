"""The assembler: delta PCM in, whole segments in storage, progress out, finalize queued.

Deltas of one attempt at a segment may arrive in any order and from any decoder; they are kept in a
Redis hash by chunk number (so any assembler can finish any segment, and a redelivered delta
overwrites itself). When all chunks of an attempt are in, the segment's audio is written to storage
and recorded once (the first attempt to complete wins; its deltas leave Redis). The last segment
queues the RQ finalize job. Assemblers also run the sweep (jobs/sweep.py), one of them per interval.

It is also the first stage that holds a segment's audio in one piece, so it judges near-silence (a
runaway, models/runaway.py): a whole segment below the model's ``silence_dbfs`` is retried with the
next seed, or, after ``runaway_retries`` retries, kept and flagged.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable

from fleet.messages import AudioChunk
from fleet.names import ASSEMBLER_GROUP
from fleet.redis import rq_client
from fleet.settings import Settings
from jobs.finalize import enqueue_finalize
from jobs.model import Job
from jobs.service import segment_task
from jobs.sweep import Sweeper
from models.registry import MODELS
from models.runaway import SILENCE, level_dbfs
from workers import metrics
from workers.runtime import WorkerContext, every
from workers.stage import Stage, Work
from workers.transport import Transport

log = logging.getLogger(__name__)

#: Jobs whose first audio this assembler has timed (a redelivered first chunk is not timed again).
FIRST_AUDIO_REMEMBERED = 4096


class Assembler(Stage[AudioChunk]):
    kind = "assembler"
    group = ASSEMBLER_GROUP
    message = AudioChunk
    activity = "assembling"
    drop_ended_first = False  # ADD_DELTA drops an ended job's chunks
    batch_size = 64

    def __init__(
        self,
        ctx: WorkerContext,
        enqueue: Callable[[Settings, str], None] = enqueue_finalize,
        transport: Transport | None = None,
    ) -> None:
        super().__init__(ctx, [ctx.names.audio(shard) for shard in ctx.shards], transport=transport)
        self.enqueue = enqueue  # queues the finalize job (RQ); idempotent
        self.sweeper: Sweeper | None = None  # made on the first sweep (it needs RQ's connection)
        self._first_audio_seen: OrderedDict[str, None] = OrderedDict()

    def chores(self):
        s = self.ctx.settings
        return [*super().chores(), every(s.sweep_interval_s, self.ctx.stop, self._sweep, "sweep")]

    async def _sweep(self) -> None:
        if self.sweeper is None:
            rq = rq_client(self.ctx.settings)
            self.sweeper = Sweeper(
                self.ctx.settings, self.ctx.store, self.ctx.storage, rq, self.transport.name
            )
        await self.sweeper.run_once()

    async def wind_down(self) -> None:
        await super().wind_down()
        if self.sweeper is not None:
            self.sweeper.rq.close()

    async def handle(self, work: Work[AudioChunk]) -> None:
        # idempotent: a batch interrupted by an outage is redone
        chunk = work.message
        state = await self.ctx.store.add_delta(chunk)
        if chunk.segment == 0 and chunk.seq == 0 and state in ("partial", "complete"):
            await self._first_audio(chunk.job_id)
        if state == "complete":
            await self.complete_segment(chunk)
        elif state == "finalizing":  # a redelivery after the last segment: make sure finalize is queued
            await self._finalize(chunk.job_id)

    async def _first_audio(self, job_id: str) -> None:
        """The job's first audio is stored (a listener can play it from now on): time it from the job's
        creation, once per job (one read of the job hash, once per job)."""
        seen = self._first_audio_seen
        if job_id in seen:
            return
        seen[job_id] = None
        if len(seen) > FIRST_AUDIO_REMEMBERED:
            seen.popitem(last=False)
        job = await self.ctx.store.get(job_id)
        if job is not None and job.created_at > 0:
            metrics.FIRST_AUDIO.labels(job.model).observe(max(time.time() - job.created_at, 0.0))

    async def _finalize(self, job_id: str) -> None:
        await self.ctx.store.mark_finalizing(job_id)  # first: the sweep finds a finalize that got lost
        await asyncio.to_thread(self.enqueue, self.ctx.settings, job_id)

    async def complete_segment(self, chunk: AudioChunk) -> None:
        store = self.ctx.store
        job = await store.get(chunk.job_id)
        if job is None:
            return  # deleted meanwhile: nothing to store it for
        pieces = await store.deltas(chunk.job_id, chunk.segment, chunk.attempt)
        if pieces is None:
            return  # a concurrent handler of this chunk completed (or gave up) the attempt: not silence
        pcm = b"".join(pieces)
        if await self._silent_runaway_retried(job, chunk, pcm):
            return
        key = job.objects.part(chunk.segment, chunk.attempt)
        await asyncio.to_thread(self.ctx.storage.put_bytes, key, pcm)
        samples = len(pcm) // 2
        result = await store.segment_done(
            chunk.job_id, chunk.segment, chunk.attempt, samples, samples / chunk.sample_rate
        )
        if result.applied:
            metrics.SEGMENTS.labels(job.model).inc()
            metrics.AUDIO_SECONDS.labels(job.model).inc(samples / chunk.sample_rate)
        if not result.keeps_part_of(chunk.attempt):  # another attempt won, or the job is over
            await asyncio.to_thread(self.ctx.storage.delete_prefix, key)
        if result.job_complete:
            log.info("job %s: all %d segments assembled", chunk.job_id, result.total)
            await self._finalize(chunk.job_id)

    async def _silent_runaway_retried(self, job: Job, chunk: AudioChunk, pcm: bytes) -> bool:
        """Near-silence check of a whole segment: retry it (True), or flag it on its last try."""
        spec = MODELS.get(job.model)
        if spec is None or spec.single_stage:
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
            metrics.RUNAWAYS.labels(self.kind, SILENCE, "retry").inc()
            return True
        await self.ctx.store.flag_segment(job.id, chunk.segment, SILENCE, detail, chunk.retry)
        metrics.RUNAWAYS.labels(self.kind, SILENCE, "flag").inc()
        return False


async def run_assembler(ctx: WorkerContext) -> None:
    await Assembler(ctx).run()
