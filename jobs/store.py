"""The job store: every read and write of a job's Redis keys goes through here."""

from __future__ import annotations

import json
import time
import zlib
from dataclasses import asdict, dataclass

import redis.asyncio as aioredis

from fleet.messages import AudioChunk, SegmentTask
from fleet.names import COUNTER_PARTS, Names
from fleet.redis import NotReplicatedError, is_cluster, write_durably
from jobs import scripts
from jobs.errors import NotDurable
from jobs.model import EventType, Job, JobStatus
from jobs.scheduler import Scheduler
from jobs.segmentation import Plan

#: About this many 'progress' events per job, whatever its length (every segment has a 'segment' event).
PROGRESS_EVENTS_PER_JOB = 100


@dataclass(frozen=True, slots=True)
class Event:
    id: str
    type: EventType
    data: dict


@dataclass(frozen=True, slots=True)
class SegmentResult:
    applied: bool  # this call completed the segment (False: an attempt did before, or the job ended)
    done: int  # when not applied: the winning attempt (-1: the job is over)
    total: int

    def keeps_part_of(self, attempt: int) -> bool:
        """Whether the stored part of ``attempt`` is the segment's audio (else it is garbage)."""
        return self.applied or self.done == attempt

    @property
    def job_complete(self) -> bool:
        return self.applied and self.done == self.total


class JobStore:
    def __init__(
        self, redis: aioredis.Redis, names: Names, *, events_maxlen: int, result_ttl_s: int, shards: int = 1,
        scheduling: str = "fair", durable_replicas: int = 0, durable_timeout_ms: int = 1000,
        longest_first_window: int = 0,
    ) -> None:  # fmt: skip
        self.redis = redis
        self.names = names
        self.events_maxlen = events_maxlen
        self.result_ttl_s = result_ttl_s
        #: Replicas that must hold a job's keys before ``create`` returns (0: not waited for).
        self.durable_replicas = durable_replicas
        self.durable_timeout_ms = durable_timeout_ms
        #: The admission queues of every job's tasks (jobs/scheduler.py).
        self.scheduler = Scheduler(redis, names, shards, fifo=scheduling == "fifo")
        #: The order a job's tasks are queued in (``service.queue_order``).
        self.longest_first_window = longest_first_window
        self._start_segment = redis.register_script(scripts.START_SEGMENT)
        self._add_delta = redis.register_script(scripts.ADD_DELTA)
        self._segment_done = redis.register_script(scripts.SEGMENT_DONE)
        self._end_job = redis.register_script(scripts.END_JOB)
        self._abandon = redis.register_script(scripts.ABANDON_ATTEMPT)
        self._flag = redis.register_script(scripts.FLAG_SEGMENT)
        self._reserve_slot = redis.register_script(scripts.RESERVE_JOB_SLOT)

    @classmethod
    def for_settings(cls, redis: aioredis.Redis, settings) -> JobStore:
        return cls(
            redis,
            Names(settings.key_prefix),
            events_maxlen=settings.events_maxlen,
            result_ttl_s=settings.result_ttl_s,
            shards=settings.task_shards,
            scheduling=settings.scheduling,
            durable_replicas=settings.durable_replicas,
            durable_timeout_ms=settings.durable_timeout_ms,
            longest_first_window=settings.longest_first_window,
        )

    # --- creation and reads -------------------------------------------------------------------------

    async def reserve_job_slot(self, tenant: str, job_id: str, limit: int) -> bool:
        """One of the tenant's ``limit`` concurrent job slots for the job (False: all taken)."""
        return bool(await self._reserve_slot([self.names.tenant_active(tenant)], [job_id, limit]))

    async def release_job_slot(self, tenant: str, *job_ids: str) -> None:
        if job_ids:
            await self.redis.srem(self.names.tenant_active(tenant), *job_ids)

    async def create(
        self, job: Job, plan: Plan | str, tasks: list[SegmentTask] | list[bytes], weight: int = 1
    ) -> None:
        """Store the job (one MULTI/EXEC; with ``durable_replicas``, waited for until that many
        replicas hold it), then queue its segments for admission (one script, in the shard's slot).
        If either fails, the job is deleted again: a 202 is answered only after both. The queue needs
        no wait: what a failover loses of it is queued again (jobs/recovery.py), the plan is not.
        ``plan`` and ``tasks`` may come encoded (its JSON, their headers: ``service.encode``), as the
        API does in a thread: a whole book's take long enough to stall the event loop."""
        try:
            await self._create(job, plan)
            if tasks:  # none: every segment is already rendered (jobs/segcache.py)
                await self.scheduler.enqueue(job.model, job.shard, job.id, job.tenant, job.priority, weight, tasks)
        except NotReplicatedError as exc:
            await self.purge(job)
            raise NotDurable(
                f"the job could not be stored safely ({exc}: is a Redis replica down?); nothing was "
                "kept, try again"
            ) from exc
        except BaseException:
            await self.purge(job)
            raise

    async def _create(self, job: Job, plan: Plan | str) -> None:
        n = self.names
        cluster = is_cluster(self.redis)
        if cluster:
            # a MULTI stays in one slot: the indexes (other slots) first, then the job's keys at
            # once; an index entry without its job is what an expired job leaves, and is handled so
            index = self.redis.pipeline(transaction=False)
            self._index(index, job)
            await index.execute()

        async def write(client) -> None:
            pipe = client.pipeline(transaction=True)
            if not cluster:
                self._index(pipe, job)
            pipe.hset(n.job(job.id), mapping=job.to_hash())
            pipe.set(n.plan(job.id), plan if isinstance(plan, str) else plan.to_json())
            self._event(
                pipe,
                job.id,
                EventType.QUEUED,
                {"segments": job.segments_total, "chapters": job.chapters, "reused": job.segments_reused},
            )
            await pipe.execute()

        if self.durable_replicas:
            await write_durably(self.redis, n.job(job.id), write, self.durable_replicas, self.durable_timeout_ms)
        else:
            await write(self.redis)

    def _index(self, pipe, job: Job) -> None:
        n = self.names
        pipe.zadd(n.jobs_index(), {job.id: job.created_at})
        pipe.zadd(n.tenant_jobs(job.tenant), {job.id: job.created_at})
        pipe.sadd(n.tenant_active(job.tenant), job.id)
        pipe.sadd(n.tenants(), job.tenant)

    async def get(self, job_id: str) -> Job | None:
        raw = await self.redis.hgetall(self.names.job(job_id))
        return Job.from_hash(raw) if raw else None

    async def get_many(self, job_ids: list[str]) -> list[Job | None]:
        pipe = self.redis.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.hgetall(self.names.job(job_id))
        return [Job.from_hash(raw) if raw else None for raw in await pipe.execute()]

    async def page(self, index: str, after: tuple[str, float] | None, count: int) -> list[tuple[str, float]]:
        """Up to ``count`` (job id, creation time) of an index, newest first, after ``after`` (the
        last of the previous page): stable while new jobs arrive."""
        top = "+inf" if after is None else repr(after[1])
        out: list[tuple[str, float]] = []
        offset = 0
        while len(out) < count:
            batch = await self.redis.zrevrangebyscore(
                index, top, "-inf", start=offset, num=count + 1, withscores=True
            )
            if not batch:
                break
            offset += len(batch)
            for member, score in batch:
                job_id = member.decode()
                # members of one score come in descending order: skip those up to the cursor
                if after is not None and score == after[1] and job_id >= after[0]:
                    continue
                out.append((job_id, score))
                if len(out) == count:
                    break
        return out

    async def status(self, job_id: str) -> JobStatus | None:
        raw = await self.redis.hget(self.names.job(job_id), "status")
        return JobStatus(raw.decode()) if raw else None

    async def statuses(self, job_ids: set[str]) -> dict[str, JobStatus | None]:
        ids = sorted(job_ids)
        pipe = self.redis.pipeline(transaction=False)
        for job_id in ids:
            pipe.hget(self.names.job(job_id), "status")
        raw = await pipe.execute()
        return {job_id: (JobStatus(r.decode()) if r else None) for job_id, r in zip(ids, raw, strict=True)}

    async def plan(self, job_id: str) -> Plan:
        raw = await self.redis.get(self.names.plan(job_id))
        if raw is None:
            raise KeyError(f"job {job_id} has no plan")
        return Plan.from_json(raw)

    async def completed_segments(self, job_id: str) -> dict[int, tuple[int, int]]:
        """segment -> (winning attempt, samples)."""
        raw = await self.redis.hgetall(self.names.done_segments(job_id))
        out = {}
        for seg, value in raw.items():
            attempt, samples = value.decode().split(":")
            out[int(seg)] = (int(attempt), int(samples))
        return out

    # --- events -------------------------------------------------------------------------------------

    def _event(self, pipe, job_id: str, kind: EventType, data: dict) -> None:
        pipe.xadd(
            self.names.events(job_id),
            {"type": kind.value, "data": json.dumps(data)},
            maxlen=self.events_maxlen,
            approximate=True,
        )

    async def last_event_id(self, job_id: str) -> str | None:
        """The id of the job's newest event (None: it has none)."""
        newest = await self.redis.xrevrange(self.names.events(job_id), count=1)
        return newest[0][0].decode() if newest else None

    async def read_events(
        self, job_id: str, after: str, block_ms: int | None, count: int = 200
    ) -> list[Event]:
        reply = await self.redis.xread({self.names.events(job_id): after}, count=count, block=block_ms)
        events = []
        for _stream, entries in reply or []:
            for entry_id, fields in entries:
                events.append(
                    Event(entry_id.decode(), EventType(fields[b"type"].decode()), json.loads(fields[b"data"]))
                )
        return events

    # --- the AR stage -------------------------------------------------------------------------------

    async def start_segment(self, job_id: str, segment: int) -> int:
        """A new, unique attempt number for the segment (marking the job running), or 0 if the job
        is gone or has ended (the segment must not be worked on). One round trip."""
        n = self.names
        now = time.time()
        keys = [n.job(job_id), n.attempts(job_id), n.events(job_id)]
        _status, attempt = await self._start_segment(
            keys, [segment, now, self.events_maxlen, json.dumps({"at": now})]
        )
        return int(attempt)

    async def skip_attempts(self, job_id: str, segments: list[int], gap: int) -> None:
        """Move the segments' attempt counters ``gap`` ahead: after Redis lost writes, the numbers of
        attempts it forgot must not be handed out again while their chunks may still be in flight
        (jobs/recovery.py)."""
        pipe = self.redis.pipeline(transaction=False)
        for segment in segments:
            pipe.hincrby(self.names.attempts(job_id), segment, gap)
        await pipe.execute()

    # --- runaways (AR worker and assembler) ---------------------------------------------------------

    async def retry_runaway(self, task: SegmentTask, attempt: int, kind: str, detail: str) -> bool:
        """Give up ``attempt`` of a runaway segment and queue its next try (``task.retry + 1``, a new
        seed). The abandoned attempt's audio is deleted, and any still in flight is dropped on arrival.
        Returns False (and queues nothing) if the job has ended or the attempt was already given up."""
        n = self.names
        data = {"index": task.segment, "retry": task.retry, "kind": kind, "detail": detail}
        keys = [
            n.job(task.job_id),
            n.abandoned(task.job_id),
            n.deltas(task.job_id, task.segment, attempt),
            n.scratch_keys(task.job_id),
            n.events(task.job_id),
        ]
        if not await self._abandon(keys, [task.segment, attempt, self.events_maxlen, json.dumps(data)]):
            return False
        retry = SegmentTask(**{**asdict(task), "retry": task.retry + 1})
        job = await self.get(task.job_id)
        if job is None or job.status.terminal:
            return False
        await self.scheduler.enqueue(job.model, job.shard, job.id, job.tenant, job.priority, 1, [retry], front=True)
        return True

    async def flag_segment(self, job_id: str, segment: int, kind: str, detail: str, retries: int) -> bool:
        """Record that ``segment`` is kept although its last try ran away (once per segment): the
        manifest lists it, the job counts it, and a 'warning' event tells the client."""
        n = self.names
        flag = {"kind": kind, "detail": detail, "retries": retries}
        event = {"index": segment, **flag}
        keys = [n.job(job_id), n.flags(job_id), n.events(job_id)]
        return bool(
            await self._flag(keys, [segment, json.dumps(flag), self.events_maxlen, json.dumps(event)])
        )

    async def flags(self, job_id: str) -> dict[int, dict]:
        """segment -> the runaway it was kept with (kind, detail, retries)."""
        raw = await self.redis.hgetall(self.names.flags(job_id))
        return {int(k): json.loads(v) for k, v in raw.items()}

    # --- the assembler ------------------------------------------------------------------------------

    async def add_delta(self, chunk: AudioChunk) -> str:
        n = self.names
        keys = [
            n.job(chunk.job_id),
            n.done_segments(chunk.job_id),
            n.deltas(chunk.job_id, chunk.segment, chunk.attempt),
            n.scratch_keys(chunk.job_id),
            n.abandoned(chunk.job_id),
        ]
        args = [chunk.segment, chunk.seq, int(chunk.final), chunk.pcm, chunk.attempt]
        result = await self._add_delta(keys, args)
        return result.decode()

    async def deltas(self, job_id: str, segment: int, attempt: int) -> list[bytes] | None:
        """The delta PCM pieces of one attempt, in chunk order; None when they are no longer all
        there: another handler of the same chunk (a redelivery, e.g. after a failover rolled back a
        read) completed or gave up the attempt between ADD_DELTA's 'complete' and this read."""
        raw = await self.redis.hgetall(self.names.deltas(job_id, segment, attempt))
        pieces = sorted((int(k), v) for k, v in raw.items() if k != b"n")
        if b"n" not in raw or len(pieces) != int(raw[b"n"]):
            return None
        return [v for _, v in pieces]

    async def segment_done(
        self, job_id: str, segment: int, attempt: int, samples: int, seconds: float
    ) -> SegmentResult:
        """Record a segment's audio as persisted (once); emits 'segment' and throttled 'progress' events."""
        n = self.names
        keys = [
            n.job(job_id),
            n.done_segments(job_id),
            n.events(job_id),
            n.deltas(job_id, segment, attempt),
            n.scratch_keys(job_id),
        ]
        args = [
            segment,
            attempt,
            samples,
            repr(seconds),
            time.time(),
            self.events_maxlen,
            PROGRESS_EVENTS_PER_JOB,
        ]
        applied, done, total = await self._segment_done(keys, args)
        return SegmentResult(bool(applied), int(done), int(total))

    # --- endings ------------------------------------------------------------------------------------

    async def _end(
        self,
        job_id: str,
        status: JobStatus,
        event: EventType,
        data: dict,
        error: str = "",
        require: str = "",
        fields: dict[str, str] | None = None,
    ) -> bool:
        n = self.names
        keys = [n.job(job_id), n.events(job_id), *n.job_keys(job_id)[1:]]
        args = [
            status.value,
            event.value,
            json.dumps(data),
            time.time(),
            error,
            self.events_maxlen,
            self.result_ttl_s,
            require,
            *(x for pair in (fields or {}).items() for x in pair),
        ]
        owner = [v.decode() for v in await self._end_job(keys, args)]
        if owner:
            tenant, model, priority, shard = owner
            # once per job, by whoever ended it: narrate_jobs_ended_total (jobs/metrics.py)
            part = zlib.crc32(job_id.encode()) % COUNTER_PARTS  # any id, not only hex ones
            await self.redis.hincrby(n.counters(part), f"jobs_ended:{status.value}", 1)
            await self.clear_scratch(job_id)
            await self.release_job_slot(tenant, job_id)
            if model:
                await self.scheduler.drop(model, int(shard), job_id, tenant, priority)
        return bool(owner)

    async def fail(self, job_id: str, reason: str) -> bool:
        return await self._end(job_id, JobStatus.FAILED, EventType.FAILED, {"error": reason}, error=reason)

    async def cancel(self, job_id: str) -> bool:
        return await self._end(job_id, JobStatus.CANCELLED, EventType.CANCELLED, {})

    async def finish(self, job_id: str, audio_key: str, duration_s: float, audio_url: str) -> bool:
        """finalizing -> done, with the file's key set in the same step (a client that sees 'done'
        finds it; a job cancelled or deleted meanwhile is left alone, never re-created)."""
        data = {"audio_url": audio_url, "duration_s": duration_s}
        fields = {"audio_key": audio_key, "duration_s": repr(duration_s)}
        return await self._end(
            job_id, JobStatus.DONE, EventType.DONE, data, require=JobStatus.FINALIZING.value, fields=fields
        )

    async def purge(self, job: Job) -> None:
        """Delete every key of an ended job (its delta hashes too) and its index entries. Only for a
        job that has ended: every writer checks the status first, so nothing re-creates these keys."""
        n = self.names
        await self.scheduler.drop(job.model, job.shard, job.id, job.tenant, job.priority)
        await self.clear_scratch(job.id)
        await self.redis.delete(*n.job_keys(job.id))
        pipe = self.redis.pipeline(transaction=False)
        pipe.zrem(n.jobs_index(), job.id)
        pipe.zrem(n.tenant_jobs(job.tenant), job.id)
        pipe.srem(n.tenant_active(job.tenant), job.id)
        pipe.zrem(n.finalizing(), job.id)
        await pipe.execute()

    # --- the sweep's indexes (jobs/sweep.py) --------------------------------------------------------

    async def mark_finalizing(self, job_id: str) -> None:
        """Note that the job's finalize was (about to be) queued; the first mark's time is kept."""
        await self.redis.zadd(self.names.finalizing(), {job_id: time.time()}, nx=True)

    async def unmark_finalizing(self, *job_ids: str) -> None:
        if job_ids:
            await self.redis.zrem(self.names.finalizing(), *job_ids)

    async def finalizing_since(self, before: float, count: int = 1000) -> list[tuple[str, float]]:
        """(job id, marked at) of jobs marked finalizing before ``before``, oldest first."""
        raw = await self.redis.zrangebyscore(
            self.names.finalizing(), "-inf", before, start=0, num=count, withscores=True
        )
        return [(job_id.decode(), at) for job_id, at in raw]

    async def expired(self, created_before: float, count: int = 1000) -> list[tuple[str, str]]:
        """(tenant, job id) of the jobs in the indexes created before ``created_before`` whose keys
        expired (their result TTL ran out). Younger jobs cannot have expired yet."""
        n = self.names
        gone: list[tuple[str, str]] = []
        for tenant in await self.tenant_names():
            index = n.tenant_jobs(tenant)
            ids = [
                i.decode()
                for i in await self.redis.zrangebyscore(index, "-inf", created_before, start=0, num=count)
            ]
            if not ids:
                continue
            pipe = self.redis.pipeline(transaction=False)
            for job_id in ids:
                pipe.exists(n.job(job_id))
            gone += [(tenant, job_id) for job_id, exists in zip(ids, await pipe.execute(), strict=True) if not exists]
        return gone

    async def forget(self, jobs: list[tuple[str, str]]) -> None:
        """Remove expired jobs, (tenant, job id), from the indexes (once their files are gone)."""
        n = self.names
        pipe = self.redis.pipeline(transaction=False)
        for tenant, job_id in jobs:
            pipe.zrem(n.tenant_jobs(tenant), job_id)
            pipe.zrem(n.jobs_index(), job_id)
            pipe.srem(n.tenant_active(tenant), job_id)
        await pipe.execute()

    async def tenant_names(self) -> list[str]:
        """Every tenant that has had a job."""
        return sorted(m.decode() for m in await self.redis.smembers(self.names.tenants()))

    async def forget_ended_active(self) -> int:
        """Drop jobs that ended (or vanished) from their tenant's active set (a crash between a job's
        end and its slot's release leaves one there); how many."""
        dropped = 0
        for tenant in await self.tenant_names():
            ids = {m.decode() for m in await self.redis.smembers(self.names.tenant_active(tenant))}
            if not ids:
                continue
            statuses = await self.statuses(ids)
            ended = [j for j, status in statuses.items() if status is None or status.terminal]
            await self.release_job_slot(tenant, *ended)
            dropped += len(ended)
        return dropped

    async def clear_scratch(self, job_id: str) -> None:
        scratch = self.names.scratch_keys(job_id)
        keys = await self.redis.smembers(scratch)
        if keys:
            await self.redis.delete(*keys)
        await self.redis.delete(scratch)
