"""Recovery after Redis lost acknowledged writes: a replica promoted in a failover, a server restarted.

Redis replication is asynchronous (so is an AOF's fsync): a primary acknowledges a write before its
replica has it, and a failover that promotes the replica loses what had not reached it. What the
fleet keeps and what it redoes:

- **kept**: a job's creation. Its plan cannot be derived from anything else, and its client was told
  202, so with ``durable_replicas`` the creation waits (WAIT) until that many replicas hold it
  (jobs/store.py); if none does in time, the creation is refused and nothing is kept.
- **redone**: everything else is derived from the plan by work that is already idempotent: a lost
  task, code chunk, audio chunk, delta or segment record only means a segment is rendered again, and
  a lost status change that a finalize is due again. Nothing is waited for on that path.

How a loss is noticed: every server holding the fleet's keys has a run id (a restart or a promotion
gives a new one). The sweep (jobs/sweep.py, one process per interval) compares them with those it
saw last (``Names.server_runs``); a run id it has not seen means writes may be gone, and ``recover``
goes over every job that has not ended:

- finalizing: its finalize is queued again (a no-op while one is queued or running);
- queued or running: every segment that is neither recorded done nor waiting in the job's admission
  queue is queued again (at the queue's front) with its own seed, so its audio is the same. Segments
  still in flight are rendered twice; the first attempt to complete wins, as after a worker's death.
  Attempt numbers already outlive lost writes (they come from the server's clock: jobs/scripts.py
  START_SEGMENT); the counters also move ``ATTEMPT_GAP`` ahead, a second's margin for a promoted
  replica whose host's clock is behind the dead primary's. Reused segments (the segment cache) are
  recorded done again instead. (Where the job's keys and its shard's queue and streams share the
  server that lost writes, the lost pops and acks put that work back on their own, and nothing may
  be missing here.)

The new run ids are stored only after every job was gone over, so a recovery cut short (the cluster
still failing over) runs again at the next sweep. Its cost: the segments in flight at the failover
are rendered once more (at most the engines' slots), and one pass over the jobs not yet ended.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from redis.exceptions import ResponseError

from fleet.redis import server_runs
from jobs.model import JobStatus
from jobs.service import record_reused, segment_task
from jobs.store import JobStore

log = logging.getLogger(__name__)

#: How far a recovered segment's attempt counter moves ahead (attempt numbers are milliseconds: a
#: second's margin for clock skew between the dead primary's host and its replica's).
ATTEMPT_GAP = 1000

#: Job ids read from the index at a time.
PAGE = 500

_warned = False  # said once per process: a server without INFO


@dataclass
class RecoveryReport:
    jobs: int = 0
    segments_requeued: int = 0
    finalizes_requeued: int = 0
    reused_recorded: int = 0
    requeued_jobs: list[str] = field(default_factory=list)


async def lost_writes_possible(store: JobStore) -> set[str] | None:
    """The servers' run ids if one is new since the last look (writes may be lost), else None. The
    first look ever only records them. A server that refuses INFO (some hosted ones) is not watched."""
    try:
        runs = await server_runs(store.redis)
    except ResponseError as exc:
        global _warned
        if not _warned:
            log.warning("Redis refuses INFO (%s): lost writes after a failover or restart go unnoticed", exc)
            _warned = True
        return None
    raw = await store.redis.get(store.names.server_runs())
    if raw is None:
        await remember_runs(store, runs)
        return None
    return runs if runs - set(json.loads(raw)) else None


async def remember_runs(store: JobStore, runs: set[str]) -> None:
    await store.redis.set(store.names.server_runs(), json.dumps(sorted(runs)))


async def recover(store: JobStore, finalize: Callable[[str], Awaitable[None]]) -> RecoveryReport:
    """Queue again what lost writes may have taken from every job not yet ended (see the module).
    ``finalize(job_id)`` queues a job's finalize (once: a no-op while one is queued or running)."""
    report = RecoveryReport()
    after = None
    while True:
        # by a cursor of (job, creation time), not an offset: a job deleted meanwhile would shift
        # the next page past one it never went over (left running for good)
        page = await store.page(store.names.jobs_index(), after, PAGE)
        if not page:
            return report
        after = page[-1]
        for job in await store.get_many([job_id for job_id, _ in page]):
            if job is None or job.status.terminal:
                continue
            report.jobs += 1
            if job.status == JobStatus.FINALIZING:
                await store.mark_finalizing(job.id)
                await finalize(job.id)
                report.finalizes_requeued += 1
                continue
            await _requeue_missing(store, job, report, finalize)


async def _requeue_missing(store: JobStore, job, report: RecoveryReport, finalize) -> None:
    plan = await store.plan(job.id)
    done = await store.completed_segments(job.id)
    waiting = {t.segment for t in await store.scheduler.queued_tasks(job.model, job.shard, job.id)}
    missing = [s for s in plan.segments if s.index not in done and s.index not in waiting]
    if not missing:
        return
    reused = {s.index for s in missing if s.index in plan.reused}
    if reused:
        await record_reused(store, job, plan, finalize, only=reused)
        report.reused_recorded += len(reused)
    render = [s for s in missing if s.index not in plan.reused]
    if not render:
        return
    await store.skip_attempts(job.id, [s.index for s in render], ATTEMPT_GAP)
    tasks = [segment_task(job, s) for s in render]
    await store.scheduler.enqueue(job.model, job.shard, job.id, job.tenant, job.priority, 1, tasks, front=True)
    report.segments_requeued += len(tasks)
    report.requeued_jobs.append(job.id)
    log.warning("recovery: job %s: %d segment(s) queued again after Redis lost writes", job.id, len(tasks))


async def run(store: JobStore, finalize: Callable[[str], Awaitable[None]]) -> RecoveryReport | None:
    """Recover if a server is new since the last look (None: nothing to do)."""
    runs = await lost_writes_possible(store)
    if runs is None:
        return None
    log.warning("Redis: a server restarted or a replica took over; recovering what may have been lost")
    report = await recover(store, finalize)
    await remember_runs(store, runs)
    log.warning(
        "recovery: %d job(s) gone over, %d segment(s) and %d finalize(s) queued again, %d reused segment(s) recorded",
        report.jobs, report.segments_requeued, report.finalizes_requeued, report.reused_recorded,
    )  # fmt: skip
    return report
