"""The fleet's state in Redis as Prometheus metrics, read at scrape time (the API's /metrics).

What lives in Redis is the same whichever process reads it, so it is read when Prometheus asks rather
than counted by some process: jobs by state, stage streams (entries and pending deliveries), the
admission queues, dead letters, live workers, the finalize queue (on RQ's Redis). ``read_fleet`` takes
it in three pipelined round trips (a few commands per model and shard, one per tenant, and one per
job not yet ended: the tenants' concurrent-job limits bound those; RQ's queue beside the first);
``fleet_metrics`` turns it into metric families, with ``narrate_redis_up``. The counters each worker process keeps are served by that
process (workers/metrics.py). Every metric is described in docs/metrics.md.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from redis import Redis as SyncRedis

from fleet.names import AR_GROUP, ASSEMBLER_GROUP, COUNTER_PARTS, DECODER_GROUP, SPEECH_GROUP, Names
from fleet.readiness import MISSED_BEATS
from fleet.settings import Settings
from jobs.model import JobStatus
from jobs.scheduler import CLASSES
from jobs.store import JobStore
from models.registry import MODELS

#: The states a job holds until it ends (gauges), and those it ends in (counters).
ACTIVE_STATES = tuple(s.value for s in JobStatus if not s.terminal)
ENDED_STATES = tuple(s.value for s in JobStatus if s.terminal)
#: RQ's list of a queue's waiting jobs is ``rq:queue:<name>`` (``rq.Queue.redis_queue_namespace_prefix``).
RQ_QUEUE_PREFIX = "rq:queue:"


@dataclass(frozen=True)
class StreamStat:
    stream: str  # tasks, codes, audio
    model: str  # "" for the audio stream (every model's)
    group: str
    length: int  # entries: waiting and pending (an entry is deleted when acked)
    pending: int  # delivered to a consumer, not acked yet


@dataclass
class FleetSnapshot:
    jobs: dict[str, int] = field(default_factory=dict)  # active state -> jobs
    jobs_ended: dict[str, int] = field(default_factory=dict)  # terminal state -> jobs ended so
    streams: list[StreamStat] = field(default_factory=list)
    queued: dict[tuple[str, str], int] = field(default_factory=dict)  # (model, priority) -> tasks
    dead_letters: int = 0
    workers: dict[tuple[str, str], int] = field(default_factory=dict)  # (stage, model) -> live
    finalize_queue: int = 0


def _stage_streams(names: Names, settings: Settings) -> list[tuple[str, str, str, str]]:
    """(stream kind, model, key, group) of every stage stream the fleet's models use."""
    out = []
    for model in settings.model_names:
        spec = MODELS.get(model)
        if spec is None:
            continue
        group = SPEECH_GROUP if spec.single_stage else AR_GROUP
        for shard in range(settings.task_shards):
            out.append(("tasks", model, names.tasks(model, shard), group))
            if not spec.single_stage:
                out.append(("codes", model, names.codes(model, shard), DECODER_GROUP))
    for shard in range(settings.task_shards):
        out.append(("audio", "", names.audio(shard), ASSEMBLER_GROUP))
    return out


async def read_fleet(store: JobStore, settings: Settings, rq: SyncRedis) -> FleetSnapshot:
    """The fleet's state now, from Redis (three pipelined round trips), and the finalize queue's length
    from RQ's Redis (``rq``: on a cluster another server than the fleet's, fleet/redis.py)."""
    redis, names = store.redis, store.names
    streams = _stage_streams(names, settings)
    models = [m for m in settings.model_names if m in MODELS]
    live = [(kind, m) for m in models for kind in MODELS[m].worker_kinds]
    queues = [
        (m, klass, f"{names.queues(m, shard)}:queued:{klass}")
        for m in models
        for shard in range(settings.task_shards)
        for klass in CLASSES
    ]
    since = time.time() - MISSED_BEATS * settings.heartbeat_s

    # 1) everything whose keys are known up front
    pipe = redis.pipeline(transaction=False)
    pipe.smembers(names.tenants())
    for part in range(COUNTER_PARTS):
        pipe.hgetall(names.counters(part))
    pipe.xlen(names.dead_letters())
    for _kind, _model, key, _group in streams:
        pipe.xlen(key)
        pipe.xinfo_groups(key)
    for kind, model in live:
        pipe.zcount(names.live_workers(kind, model), since, "+inf")
    for *_, key in queues:
        pipe.get(key)
    replies, finalize_queue = await asyncio.gather(
        pipe.execute(raise_on_error=False), _queue_length(rq, settings.finalize_queue)
    )
    replies = iter(replies)
    tenants = sorted(t.decode() for t in _ok(next(replies), set()))
    counters: dict[str, int] = {}
    for _ in range(COUNTER_PARTS):  # summed over the parts
        for k, v in _ok(next(replies), {}).items():
            counters[k.decode()] = counters.get(k.decode(), 0) + int(v)
    snap = FleetSnapshot(dead_letters=int(_ok(next(replies), 0)), finalize_queue=finalize_queue)
    snap.jobs_ended = {state: counters.get(f"jobs_ended:{state}", 0) for state in ENDED_STATES}
    lengths: dict[tuple[str, str, str], list[int]] = {}
    for kind, model, _key, group in streams:
        length, groups = int(_ok(next(replies), 0)), _ok(next(replies), [])
        pending = sum(int(g["pending"]) for g in groups if g["name"].decode() == group)
        acc = lengths.setdefault((kind, model, group), [0, 0])  # summed over shards
        acc[0] += length
        acc[1] += pending
    snap.streams = [StreamStat(k, m, g, n, p) for (k, m, g), (n, p) in lengths.items()]
    snap.workers = {(kind, model): int(_ok(next(replies), 0)) for kind, model in live}
    for model, klass, _key in queues:
        snap.queued[(model, klass)] = snap.queued.get((model, klass), 0) + int(_ok(next(replies), None) or 0)

    # 2) the jobs not yet ended: every tenant's active set, 3) their states
    pipe = redis.pipeline(transaction=False)
    for tenant in tenants:
        pipe.smembers(names.tenant_active(tenant))
    active: set[str] = set()
    for members in await pipe.execute(raise_on_error=False):
        active.update(m.decode() for m in _ok(members, set()))
    snap.jobs = dict.fromkeys(ACTIVE_STATES, 0)
    for status in (await store.statuses(active)).values():
        if status is not None and not status.terminal:  # an ended one not yet released: not active
            snap.jobs[status.value] += 1
    return snap


async def _queue_length(rq: SyncRedis, queue: str) -> int:
    """Jobs waiting in an RQ queue (RQ's client is synchronous: in a thread); 0 where RQ's Redis
    cannot be read, as for a failed command of the fleet's pipeline."""
    try:
        return int(await asyncio.to_thread(rq.llen, RQ_QUEUE_PREFIX + queue))
    except Exception:  # noqa: BLE001 - the fleet's state is still worth reporting
        return 0


def _ok(reply, default):
    """A pipelined reply, or ``default`` where the command failed (XINFO GROUPS of a stream not made yet)."""
    return default if isinstance(reply, Exception) or reply is None else reply


def fleet_families(snap: FleetSnapshot) -> list[Metric]:
    jobs = GaugeMetricFamily("narrate_jobs", "Jobs not yet ended, by state.", labels=["state"])
    for state, n in snap.jobs.items():
        jobs.add_metric([state], n)
    ended = CounterMetricFamily(
        "narrate_jobs_ended", "Jobs that ended, by the state they ended in (fleet-wide, kept in Redis).",
        labels=["state"],
    )  # fmt: skip
    for state, n in snap.jobs_ended.items():
        ended.add_metric([state], n)
    length = GaugeMetricFamily(
        "narrate_stream_length",
        "Entries in a stage stream (tasks, codes, audio), summed over shards: work admitted and not yet "
        "done (an entry is deleted when acked), waiting or pending; and in the dead-letter stream (dead: "
        "kept for operators, capped at 100,000).",
        labels=["stream", "model"],
    )
    pending = GaugeMetricFamily(
        "narrate_stream_pending",
        "Entries of a stage stream delivered to a consumer of its group and not acked yet.",
        labels=["stream", "model", "group"],
    )
    for s in snap.streams:
        length.add_metric([s.stream, s.model], s.length)
        pending.add_metric([s.stream, s.model, s.group], s.pending)
    length.add_metric(["dead", ""], snap.dead_letters)
    queued = GaugeMetricFamily(
        "narrate_tasks_queued",
        "Segment tasks waiting in the admission queues (not yet in a task stream), by model and class.",
        labels=["model", "priority"],
    )
    for (model, klass), n in snap.queued.items():
        queued.add_metric([model, klass], n)
    workers = GaugeMetricFamily(
        "narrate_workers_live",
        "Workers heard from within 3 heartbeats (readiness), by stage and model.",
        labels=["stage", "model"],
    )
    for (kind, model), n in snap.workers.items():
        workers.add_metric([kind, model], n)
    finalize = GaugeMetricFamily(
        "narrate_finalize_queue_length", "Finalize jobs waiting in RQ's queue.", value=snap.finalize_queue
    )
    return [jobs, ended, length, pending, queued, workers, finalize]


async def fleet_metrics(
    store: JobStore, settings: Settings, rq: SyncRedis, timeout_s: float = 5.0
) -> list[Metric]:
    """The fleet's families now, with ``narrate_redis_up`` (0, and nothing else read, if Redis does not
    answer within ``timeout_s``: a scrape reports Redis away rather than failing)."""
    started = time.perf_counter()
    try:
        snap: FleetSnapshot | None = await asyncio.wait_for(read_fleet(store, settings, rq), timeout_s)
    except Exception:  # noqa: BLE001 - whatever went wrong, the scrape says Redis could not be read
        snap = None
    up = GaugeMetricFamily(
        "narrate_redis_up", "Whether the fleet's state could be read from Redis for this scrape.",
        value=int(snap is not None),
    )  # fmt: skip
    took = GaugeMetricFamily(
        "narrate_fleet_read_seconds", "Time taken to read the fleet's state from Redis for this scrape.",
        value=time.perf_counter() - started,
    )  # fmt: skip
    return [up, took, *(fleet_families(snap) if snap is not None else [])]


class Families(Collector):
    """Metric families read beforehand, for a registry that renders them (one per scrape)."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)
