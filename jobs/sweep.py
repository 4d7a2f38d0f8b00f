"""The sweep: the periodic backstop that leaves no job stuck and nothing in Redis without an end.

Run by every assembler (workers/assembler.py) every ``sweep_interval_s``; the one that takes the
interval's lock (``SET NX PX``) sweeps, the others skip. Every step is idempotent, so two sweeps at
once (a lock that expired mid-sweep) do no harm.

0. Recovery: if a Redis server restarted or a replica took over since the last sweep, whatever
   writes that lost is queued again (jobs/recovery.py).
1. Finalizes: a job marked finalizing (``Names.finalizing``) for longer than one interval whose
   finalize RQ no longer knows (lost: the assembler's queueing never landed, Redis lost RQ's keys) is
   queued again; one RQ gave up on (its last retry failed, or its worker died on the last try)
   fails the job with RQ's reason, if RQ's failure callback did not already; a job finalizing for
   longer than every try could take (``finalize_deadline_s``, from its first mark) fails, lost or
   not. Jobs that are no longer finalizing leave the set.
2. Expired jobs (the retention): job ids in the indexes whose keys expired (``result_ttl_s`` after
   they ended): their files (the audio, its manifest, any parts) leave storage, then they leave the
   indexes (a storage error keeps a job listed for the next sweep); jobs
   that ended but still hold one of their tenant's job slots (a crash in between) release it.
3. Dead consumers: a consumer of a stage stream's group that holds no entry and has not read for
   ``consumer_forget_s`` (a worker that died or stopped: every process has a consumer name of its
   own) is deleted from its group. A live one reads every ``block_ms``; one with entries is kept,
   since deleting it would drop them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from redis.exceptions import ResponseError

from fleet.names import JobObjects
from fleet.settings import Settings
from fleet.storage import Storage
from jobs import recovery
from jobs.finalize import enqueue_finalize, finalize_problem
from jobs.model import JobStatus
from jobs.segcache import SegmentCache
from jobs.store import JobStore

log = logging.getLogger(__name__)


@dataclass
class SweepReport:
    requeued: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    expired: int = 0
    consumers_forgotten: int = 0
    segments_released: int = 0
    recovered: recovery.RecoveryReport | None = None


class Sweeper:
    def __init__(
        self, settings: Settings, store: JobStore, storage: Storage, rq_connection, name: str
    ) -> None:
        self.settings = settings
        self.store = store
        self.storage = storage
        self.rq = rq_connection  # RQ's (sync) client
        self.name = name

    def finalize_deadline_s(self) -> float:
        """The longest a finalize can legitimately take: every try at its timeout, the waits between
        them, and a sweep interval of slack."""
        s = self.settings
        tries = s.finalize_retries + 1
        waits = sum((s.finalize_retry_intervals * tries)[: s.finalize_retries])
        return tries * s.finalize_timeout_s + waits + 2 * s.sweep_interval_s

    async def run_once(self) -> SweepReport | None:
        """Sweep if this process holds this interval's lock (None: another one sweeps)."""
        names = self.store.names
        ttl_ms = max(int(self.settings.sweep_interval_s * 1000), 1)
        if not await self.store.redis.set(names.sweep_lock(), self.name, nx=True, px=ttl_ms):
            return None
        return await self.sweep()

    async def sweep(self) -> SweepReport:
        report = SweepReport()
        report.recovered = await recovery.run(self.store, self._queue_finalize)
        now = time.time()
        await self._finalizes(now, report)
        # files first, then the index entry: a storage error leaves the job listed for the next sweep
        # (forgotten first, its files would stay for good)
        cleared = []
        for tenant, job_id in await self.store.expired(now - self.settings.result_ttl_s):
            try:
                for prefix in JobObjects(tenant, job_id).prefixes:
                    await asyncio.to_thread(self.storage.delete_prefix, prefix)
            except Exception as exc:  # noqa: BLE001 - any storage error: try again next sweep
                log.warning("sweep: the files of expired job %s could not be deleted (%s); next sweep", job_id, exc)
                continue
            cleared.append((tenant, job_id))
        await self.store.forget(cleared)
        report.expired = len(cleared)
        await self.store.forget_ended_active()
        report.consumers_forgotten = await self._forget_dead_consumers()
        report.segments_released = await self._release_cached_segments()
        if report.requeued or report.failed or report.expired or report.consumers_forgotten:
            log.info(
                "sweep: %d finalize(s) queued again, %d job(s) failed, %d expired index entr(ies) and "
                "%d dead consumer(s) removed",
                len(report.requeued), len(report.failed), report.expired, report.consumers_forgotten,
            )  # fmt: skip
        return report

    async def _queue_finalize(self, job_id: str) -> None:
        await asyncio.to_thread(enqueue_finalize, self.settings, job_id, self.rq)

    async def _release_cached_segments(self) -> int:
        """Kept segments unused for the retention (jobs/segcache.py), every scope."""
        cache = SegmentCache(self.store.redis, self.store.names, self.settings)
        released = 0
        for scope in await cache.scopes():
            released += await cache.release_old(self.storage, scope, self.settings.segment_cache_retention_s)
        if released:
            log.info("sweep: %d kept segment(s) released (unused for %d s)", released, self.settings.segment_cache_retention_s)
        return released

    def stage_streams(self) -> list[str]:
        return self.store.names.stage_streams(self.settings.model_names, self.settings.task_shards)

    async def _forget_dead_consumers(self) -> int:
        redis = self.store.redis
        idle_ms = self.settings.consumer_forget_s * 1000
        forgotten = 0
        for stream in self.stage_streams():
            try:
                groups = await redis.xinfo_groups(stream)
            except ResponseError:  # no such stream (a model without one, or not used yet)
                continue
            for group in groups:
                name = group["name"]
                for consumer in await redis.xinfo_consumers(stream, name):
                    if consumer["pending"] == 0 and consumer["idle"] > idle_ms:
                        await redis.xgroup_delconsumer(stream, name, consumer["name"])
                        forgotten += 1
        return forgotten

    async def _finalizes(self, now: float, report: SweepReport) -> None:
        marked = await self.store.finalizing_since(now - self.settings.sweep_interval_s)
        if not marked:
            return
        statuses = await self.store.statuses({job_id for job_id, _ in marked})
        await self.store.unmark_finalizing(*(j for j, _ in marked if statuses[j] != JobStatus.FINALIZING))
        for job_id, since in marked:
            if statuses[job_id] != JobStatus.FINALIZING:
                continue
            problem = await asyncio.to_thread(finalize_problem, self.settings, job_id, self.rq)
            if now - since > self.finalize_deadline_s():
                reason = f"finalizing did not finish within {self.finalize_deadline_s():.0f} s"
            elif problem == "missing":
                log.warning("sweep: the finalize of job %s was lost; queueing it again", job_id)
                await asyncio.to_thread(enqueue_finalize, self.settings, job_id, self.rq)
                report.requeued.append(job_id)
                continue
            elif problem is not None:
                reason = f"finalizing failed: {problem}"
            else:
                continue
            if await self.store.fail(job_id, reason):
                report.failed.append(job_id)
            await self.store.unmark_finalizing(job_id)
