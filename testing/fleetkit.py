"""Helpers for tests that run the real fleet: processes, HTTP, SSE, an offline reference, and the fault
injection drivers (SIGKILL chaos, Redis restarts, paused decoders, memory sampling) that the tests in
tests/integration and bench/chaos.py share."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import random
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
import redis
import soundfile as sf

from fleet.names import AR_GROUP, ASSEMBLER_GROUP, DECODER_GROUP, JobObjects, Names
from fleet.settings import Settings
from fleet.storage import storage_from_settings
from narrate.embedded import EmbeddedValkey
from narrate.supervisor import Supervisor, child_env, fleet_children, free_port

# A Markdown book: 3 chapters, 51 segments (3 headings, 48 sentences), abbreviations, quotes, ellipses.
BOOK = """# Chapter One: The Harbour

The harbour woke before the town did. Gulls argued over the nets while Mr. Hale counted crates. \
He had counted them for thirty years, e.g. every morning at 5 a.m. sharp. "Forty-two," he said. \
Nobody answered him... The fog did not care.

A boat came in late. Its hull was painted a tired blue. The skipper, Dr. Moreau, waved once. \
She had been away for 3.5 weeks. Her crew looked thin!

Why had she come back? Hale wondered. He put down his pencil. The gulls went quiet. \
Somewhere a bell rang twice.

# Chapter Two: The Letter

The letter arrived on Tuesday. It was sealed with green wax. Inside were two lines of ink. \
"Come to the lighthouse," it said. "Bring the key." Hale did not own a key.

He searched the shed anyway. Behind the paint tins he found a tin box. In the box lay a brass key. \
It was warm, as if someone had just held it. He shivered.

The walk took an hour. The path was steep; the wind was cold. Rain came and went. \
At the top, the door stood open.

# Chapter Three: The Light

Inside, the stairs wound upward. He climbed slowly, counting steps as he counted crates. \
At step ninety he stopped. Someone was singing above him.

It was Dr. Moreau. She stood by the great lens. "You found it," she said. He held out the key. \
She smiled and turned it in the lamp. Light poured across the water.

Far below, the town began to wake. The gulls fell silent. Hale sat down on the top step. \
For once, he did not count anything. The light turned. It kept turning all night. \
By morning, the fog had gone.
"""

#: Text whose segment 1 can never be generated with ``max_model_len=200`` (its prompt is longer).
POISON = "Fine. Long" + " word" * 50 + " end. Fine again."


@dataclass
class RunningFleet:
    settings: Settings
    base_url: str
    supervisor: Supervisor
    log_dir: Path

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, timeout=kw.pop("timeout", 30), **kw)

    def logs(self, tail: int | None = 4000) -> str:
        """Every child's log: its last ``tail`` characters (failure messages), or all of it (None:
        for checks that look for a line, which a busy log's tail may no longer hold)."""
        return "\n".join(
            f"== {p.name}\n{p.read_text(errors='replace')[-tail if tail else 0:]}"
            for p in sorted(self.log_dir.glob("*.log"))
        )

    def stop(self) -> None:
        self.supervisor.stop()


def espeak_settings(redis_url: str, prefix: str, data_dir: Path, **overrides) -> Settings:
    """Settings of an eSpeak NG fleet with keys required (the shared-service tests and benches)."""
    base = dict(models="espeak", default_model="espeak", auth="required")
    return Settings(redis_url=redis_url, key_prefix=prefix, data_dir=data_dir, **{**base, **overrides})


def make_keys(redis_url: str, prefix: str, tenants: dict[str, dict]) -> dict[str, str]:
    """An API key per entry: name -> its key. Each entry's ``tenant`` (default: the name) and
    ``admin`` go to the key, the rest are the tenant's limits (``TenantStore.set_limits``)."""
    import redis.asyncio as aioredis

    from jobs.tenants import TenantStore

    async def make() -> dict[str, str]:
        client = aioredis.from_url(redis_url)
        store = TenantStore(client, Names(prefix))
        made = {}
        try:
            for name, spec in tenants.items():
                spec = dict(spec)
                tenant, admin = spec.pop("tenant", name), spec.pop("admin", False)
                made[name] = await store.create_key(tenant, admin=admin)
                if spec:
                    await store.set_limits(tenant, **spec)
        finally:
            await client.aclose()
        return made

    return asyncio.run(make())


def start_fleet(
    settings: Settings,
    log_dir: Path,
    *,
    ar_workers=1,
    decoders=1,
    assemblers=1,
    finalizers=1,
    speech_workers=1,
    max_backoff_s: float = 30.0,
) -> RunningFleet:
    """A whole fleet with its API (``start_host`` with ``api=True``); fleets under test and benches
    render every job: a repeated text would otherwise be answered from the first job's segments
    (jobs/segcache.py), so the segment cache is off unless the settings name it."""
    return start_host(
        settings,
        log_dir,
        ar_workers=ar_workers,
        decoders=decoders,
        assemblers=assemblers,
        finalizers=finalizers,
        speech_workers=speech_workers,
        max_backoff_s=max_backoff_s,
    )


@dataclass
class SSE:
    id: str | None
    event: str
    data: str


@dataclass
class SSEStream:
    events: list[SSE] = field(default_factory=list)
    comments: list[str] = field(default_factory=list)


def read_sse(
    client: httpx.Client,
    url: str,
    *,
    last_event_id: str | None = None,
    stop_after: int | None = None,
    timeout: float = 300,
    record: SSEStream | None = None,
) -> Iterator[SSE]:
    """Yield the events of an SSE response (a minimal parser of the text/event-stream format)."""
    headers = {"Accept": "text/event-stream"}
    if last_event_id:
        headers["Last-Event-ID"] = last_event_id
    record = record if record is not None else SSEStream()
    seen = 0
    with client.stream("GET", url, headers=headers, timeout=timeout) as response:
        response.raise_for_status()
        assert response.headers["content-type"].startswith("text/event-stream")
        fields: dict[str, str] = {}
        for line in response.iter_lines():
            if line == "":
                if "data" in fields or "event" in fields:
                    event = SSE(fields.get("id"), fields.get("event", "message"), fields.get("data", ""))
                    record.events.append(event)
                    yield event
                    seen += 1
                    if stop_after is not None and seen >= stop_after:
                        return
                fields = {}
            elif line.startswith(":"):
                record.comments.append(line)
                assert not fields, "a comment inside an event"
            else:
                name, _, value = line.partition(":")
                value = value[1:] if value.startswith(" ") else value
                fields[name] = fields[name] + "\n" + value if name == "data" and name in fields else value


def submit(client: httpx.Client, **body) -> dict:
    response = client.post("/v1/jobs", json=body)
    assert response.status_code == 202, response.text
    return response.json()


def wait_done(client: httpx.Client, job_id: str, timeout: float = 300) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = client.get(f"/v1/jobs/{job_id}").json()
        if job["status"] in ("done", "failed", "cancelled"):
            return job
        time.sleep(0.3)
    raise TimeoutError(f"job {job_id} did not finish")


def download(client: httpx.Client, job_id: str) -> tuple[np.ndarray, int]:
    response = client.get(f"/v1/jobs/{job_id}/audio", follow_redirects=True)
    assert response.status_code == 200, response.text
    audio, rate = sf.read(io.BytesIO(response.content), dtype="int16")
    return audio, rate


def offline_segment_audio(
    settings: Settings, texts: list[str], voice: str, job_seed: int = 0, model: str = "tiny", retry: int = 0
) -> list[np.ndarray]:
    """Each segment's audio computed here, without the fleet: whole-segment generation and one decode
    (of the segment's ``retry``-th runaway retry, whose seed derives from the segment's)."""
    from jobs.service import segment_seed
    from models.engines.reference import ReferenceEngine
    from models.registry import get_model, load_codec
    from models.snac_codec import to_pcm16
    from workers.ar import SegmentSynthesizer

    spec = get_model(model, settings)
    engine = ReferenceEngine(spec.checkpoint(settings), max_num_seqs=32)
    synth = SegmentSynthesizer.for_model(spec, settings, engine)
    codec = load_codec(spec, settings)
    layout = spec.family.layout

    async def tokens(i: int, text: str) -> list[int]:
        from fleet.messages import SegmentTask

        task = SegmentTask("offline", i, text, model, voice, segment_seed(job_seed, voice, text), retry=retry)
        prompt = spec.family.build_prompt(synth.tokenizer, text, voice)
        out: list[int] = []
        async for delta in engine.generate(f"offline-{i}", prompt, synth.sampling_params(task)):
            out += delta.token_ids
        return out

    async def all_tokens():
        try:
            return await asyncio.gather(*(tokens(i, t) for i, t in enumerate(texts)))
        finally:
            await engine.shutdown()

    result = []
    for toks in asyncio.run(all_tokens()):
        toks = [t for t in toks if t not in layout.stop_token_ids]
        frames = layout.tokens_to_frames(toks[: len(toks) - len(toks) % layout.codes_per_frame])
        audio = codec.decode_frames(frames[None])[0] if len(frames) else np.zeros(0, np.float32)
        result.append(np.frombuffer(to_pcm16(audio), "<i2"))
    return result


# --- fault injection ---------------------------------------------------------------------------------


def chaos_settings(redis_url: str, data_dir: Path, prefix: str = "chaos") -> Settings:
    """Short leases (a killed worker's entries are taken over after 3 s) and finalize timeout (an RQ
    job whose worker was killed is retried after 20 s).

    No poison limit to speak of: a storm kills each AR worker about every 20 s, while on a slow
    machine a segment among 16 in flight needs longer than that, so one segment can be on the victim
    five times in a row (CI, 2026-12-03: "delivered 6 times without finishing"). The limit is the
    poison tests' subject (test_chaos.test_a_poison_segment_..., tests/workers/test_stage.py); here
    a segment that never finishes still fails the run, by its timeout."""
    return Settings(
        redis_url=redis_url,
        key_prefix=prefix,
        data_dir=data_dir,
        block_ms=200,
        max_num_seqs=16,
        reclaim_idle_ms=3000,
        finalize_timeout_s=20,
        max_deliveries=1000,
    )


def memory_settings(redis_url: str, data_dir: Path, segments: int, prefix: str = "memory") -> Settings:
    """A small code-chunk backlog (100 entries) so that back-pressure engages early in the job."""
    return Settings(
        redis_url=redis_url,
        key_prefix=prefix,
        data_dir=data_dir,
        block_ms=200,
        max_num_seqs=32,
        max_stream_backlog=100,
        reclaim_idle_ms=30_000,
        max_text_chars=20 * segments + 1000,
    )


class PrivateValkey:
    """The fleet's embedded Valkey (append-only) on a fixed port, for tests that restart Redis or
    measure its memory: nothing else uses it."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir, self.port = Path(data_dir), free_port()
        self.server = EmbeddedValkey(self.data_dir, port=self.port)
        self.url = self.server.url  # the same across restarts: same port, same password file
        self.restarts = 0

    def start(self) -> PrivateValkey:
        self.server.start()
        return self

    def stop(self) -> None:
        self.server.stop()  # SIGTERM: Valkey flushes its append-only file and exits

    def restart(self, outage_s: float) -> None:
        """Stop, stay away ``outage_s`` seconds, start again on the same port and data."""
        self.stop()
        time.sleep(outage_s)
        self.server = EmbeddedValkey(self.data_dir, port=self.port)
        self.server.start()
        self.restarts += 1

    def used_memory(self) -> int:
        with contextlib.closing(redis.Redis.from_url(self.url)) as r:
            return int(r.info("memory")["used_memory"])


class MemorySampler:
    """Samples Redis ``used_memory`` every ``interval`` seconds in a thread; keeps the peak."""

    def __init__(self, url: str, interval: float = 0.05) -> None:
        self.url, self.interval = url, interval
        self.peak = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        r = redis.Redis.from_url(self.url, socket_timeout=2)
        while not self._stop.wait(self.interval):
            with contextlib.suppress(redis.RedisError):  # Redis may be restarting
                self.peak = max(self.peak, int(r.info("memory")["used_memory"]))
                self.samples += 1
        r.close()

    def __enter__(self) -> MemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)


#: The worker kinds a chaos run kills, by child-name prefix.
KINDS = ("ar", "decoder", "assembler", "finalizer")


class Chaos:
    """Kills a random worker (SIGKILL) every ``interval`` seconds, visiting every kind in turn."""

    def __init__(self, supervisor: Supervisor, interval: float, rng: random.Random) -> None:
        self.supervisor, self.interval, self.rng = supervisor, interval, rng
        self.kills: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            prefix = KINDS[len(self.kills) % len(KINDS)] + "-"
            alive = [
                c
                for c in self.supervisor.children
                if c.name.startswith(prefix) and c.process and c.process.poll() is None
            ]
            if alive:
                victim = self.rng.choice(alive)
                victim.process.send_signal(signal.SIGKILL)
                self.kills.append(victim.name)

    def kills_by_kind(self) -> dict[str, int]:
        return {kind: sum(k.startswith(kind + "-") for k in self.kills) for kind in KINDS}

    def __enter__(self) -> Chaos:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)


@dataclass
class Storm:
    """What one chaos run did: the job's final state, the kills, the Redis restarts, the time it took."""

    job: dict
    kills: list[str]
    kills_by_kind: dict[str, int]
    redis_restarts: int
    restarted_at: list[int]  # segments done when each Redis restart began
    wall_s: float
    #: Cluster failovers (testing/cluster.Failover; ``before``/``after``: the job's done segments as
    #: its primary said just before the kill and as the promoted replica said, when it held the job)
    failovers: list = field(default_factory=list)

    @property
    def segments_lost(self) -> int:
        """Segment records the failovers took back (what the recovery, or the redelivery of entries whose
        acks the same primary lost, had to redo)."""
        return sum(len(f.before - f.after) for f in self.failovers if f.before is not None and f.after is not None)


def _job_state(client: httpx.Client, job_id: str) -> dict | None:
    try:
        response = client.get(f"/v1/jobs/{job_id}", timeout=10)
    except httpx.HTTPError:
        return None  # the API is waiting for Redis
    return response.json() if response.status_code == 200 else None


def storm(
    fleet: RunningFleet,
    client: httpx.Client,
    job_id: str,
    *,
    min_kills: int,
    interval: float,
    seed: int,
    valkey: PrivateValkey | None = None,
    restarts_at: tuple[float, ...] = (),
    outage_s: float = 5.0,
    cluster=None,
    failovers_at: tuple[float, ...] = (),
    lose_s: float = 1.5,
    timeout: float = 600,
) -> Storm:
    """Ride out a job under chaos: SIGKILL a worker every ``interval`` s (restarting the dead), until
    the job has ended and at least ``min_kills`` kills happened; restart ``valkey`` when the job has
    done each fraction in ``restarts_at`` of its segments; fail a primary of ``cluster`` over
    (testing/cluster.py ``fail_over``, losing ``lose_s`` of its writes) at each of ``failovers_at``:
    the primary of the job's keys, and every other time another primary. Waits until every child is
    back up."""
    started = time.monotonic()
    rng = random.Random(seed)
    pending = sorted(restarts_at)
    pending_failovers = sorted(failovers_at)
    restarted_at: list[int] = []
    failovers: list = []
    job: dict = {}
    job_key = Names(fleet.settings.key_prefix).job(job_id)

    done_key = Names(fleet.settings.key_prefix).done_segments(job_id)

    def done_segments(node) -> set[int] | None:
        with contextlib.closing(node.client()) as c:
            try:
                return {int(i) for i in c.hkeys(done_key)}
            except redis.ResponseError:  # MOVED: that node does not hold the job
                return None

    with Chaos(fleet.supervisor, interval=interval, rng=rng) as chaos:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            fleet.supervisor.poll()  # restart what was killed
            job = _job_state(client, job_id) or job
            if pending and valkey and job and job["segments_done"] >= pending[0] * job["segments_total"]:
                pending.pop(0)
                restarted_at.append(job["segments_done"])
                valkey.restart(outage_s)
            due = pending_failovers and job and job["segments_done"] >= pending_failovers[0] * job["segments_total"]
            if due and job.get("status") in ("queued", "running"):
                pending_failovers.pop(0)
                victim = cluster.primary_of(job_key)
                if len(failovers) % 2:
                    victim = rng.choice([i for i in cluster.primaries_now() if i != victim])
                failovers.append(cluster.fail_over(victim, lose_s=lose_s, probe=done_segments))
            if job.get("status") in ("done", "failed", "cancelled") and len(chaos.kills) >= min_kills:
                break
            time.sleep(0.2)
    while any(c.process.poll() is not None for c in fleet.supervisor.children):
        fleet.supervisor.poll()  # let the last victims come back before the checks
        time.sleep(0.2)
    return Storm(
        job=wait_done(client, job_id, timeout=300),
        kills=list(chaos.kills),
        kills_by_kind=chaos.kills_by_kind(),
        redis_restarts=valkey.restarts if valkey else 0,
        restarted_at=restarted_at,
        wall_s=round(time.monotonic() - started, 1),
        failovers=failovers,
    )


def stopped(supervisor: Supervisor, prefix: str) -> contextlib.AbstractContextManager[list]:
    """SIGSTOP every child whose name starts with ``prefix``; SIGCONT them on exit."""

    @contextlib.contextmanager
    def pause():
        victims = [c for c in supervisor.children if c.name.startswith(prefix) and c.process]
        for c in victims:
            c.process.send_signal(signal.SIGSTOP)
        try:
            yield victims
        finally:
            for c in victims:
                c.process.send_signal(signal.SIGCONT)

    return pause()


def stage_streams(names: Names, model: str = "tiny", shards: int = 1) -> list[tuple[str, str]]:
    """(stream, group) of every stage, in every shard (``task_shards``)."""
    return [
        *((names.tasks(model, shard), AR_GROUP) for shard in range(shards)),
        *((names.codes(model, shard), DECODER_GROUP) for shard in range(shards)),
        *((names.audio(shard), ASSEMBLER_GROUP) for shard in range(shards)),
    ]


def orphan_keys(r: redis.Redis, names: Names, job_ids: list[str], rq: redis.Redis | None = None) -> list[str]:
    """Keys that should not exist once these jobs have ended: any per-job key (``{p}:job:{<id>}...``)
    but the long-lived keys of these jobs (no delta hash, no scratch set, nothing of another job), RQ's
    record of their finalize (a success leaves none), and any other RQ key naming them that would never
    expire. (RQ's own housekeeping may leave a key naming the RQ job with a TTL, e.g.
    ``rq:queue:...:intermediate:first_seen:<id>`` (24 h) when its maintenance saw the job between
    dequeue and start; those expire by themselves and are not counted.) Fleet-wide keys (streams, the
    job index) are not per-job; the stage streams are checked empty by ``assert_nothing_left``.
    ``rq``: RQ's own Redis where it is another (the fleet on a cluster); default ``r``."""
    from jobs.finalize import finalize_rq_id

    allowed: set[str] = set()
    for job_id in job_ids:
        allowed |= set(names.job_keys(job_id)) - {names.scratch_keys(job_id)}
    found = {k.decode() for k in r.scan_iter(match=f"{names.prefix}:job:*", count=1000)} - allowed
    rq = rq if rq is not None else r
    for job_id in job_ids:
        for key in rq.scan_iter(match=f"rq:*{job_id}*", count=1000):
            rq_job = key.decode() == f"rq:job:{finalize_rq_id(Settings(key_prefix=names.prefix), job_id)}"
            if rq_job or rq.ttl(key) == -1:
                found.add(key.decode())
    return sorted(found)


def settled_orphan_keys(
    r: redis.Redis, names: Names, job_ids: list[str], settle_s: float = 15, rq: redis.Redis | None = None
) -> list[str]:
    """``orphan_keys`` once RQ has had ``settle_s`` to delete its record of a finalize that has just
    returned (the job turns 'done' inside the finalize, a moment before RQ marks it finished)."""
    deadline = time.monotonic() + settle_s
    while (orphans := orphan_keys(r, names, job_ids, rq)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return orphans


def assert_nothing_left(
    r: redis.Redis, names: Names, job_ids: list[str], rq: redis.Redis | None = None, shards: int = 1
) -> None:
    """No stage stream (of any of ``shards``) holds an entry or a pending delivery; no orphan key remains."""
    for stream, group in stage_streams(names, shards=shards):
        left = (r.xlen(stream), r.xpending(stream, group)["pending"])
        assert left == (0, 0), f"{stream}: {left[0]} entries, {left[1]} pending"
    orphans = settled_orphan_keys(r, names, job_ids, rq=rq)
    assert orphans == [], [(k, r.type(k), r.ttl(k)) for k in orphans]


def manifest(settings: Settings, job_id: str, tenant: str = "default") -> dict:
    """A finished job's manifest, from its storage."""
    return json.loads(storage_from_settings(settings).get_bytes(JobObjects(tenant, job_id).manifest))


def manifest_segments(settings: Settings, job_id: str, tenant: str = "default") -> list[int]:
    """The segment indices in a finished job's manifest, in file order."""
    return [s["index"] for s in manifest(settings, job_id, tenant)["segments"]]


def attempts_of(r: redis.Redis, names: Names, job_id: str) -> tuple[dict[int, int], dict[int, int]]:
    """(segment -> its latest attempt started, segment -> the attempt that completed it)."""
    started = {int(k): int(v) for k, v in r.hgetall(names.attempts(job_id)).items()}
    won = {int(k): int(v.split(b":")[0]) for k, v in r.hgetall(names.done_segments(job_id)).items()}
    return started, won


def unstarted_tasks(r: redis.Redis, names: Names, model: str = "tiny", shard: int = 0) -> int:
    """Tasks no engine has taken: queued by the scheduler, or admitted to the stream but not read."""
    queued = sum(int(r.get(f"{names.queues(model, shard)}:queued:{c}") or 0) for c in ("interactive", "batch"))
    stream = names.tasks(model, shard)
    pending = r.xpending(stream, AR_GROUP)["pending"] if r.exists(stream) else 0
    return queued + r.xlen(stream) - pending


@contextlib.contextmanager
def speech_fleet(
    redis_url: str, data_dir: Path, log_dir: Path, name: str, model: str = "espeak", **overrides
) -> Iterator[RunningFleet]:
    """A real single-stage fleet for a test module (``speech_workers``, default 1; short blocks), on
    its own key prefix (``name`` and the time), entered once every speech worker has loaded its
    engine and beats (what /v1/models says, without needing a key); its keys go when it stops."""
    prefix = f"{name}-{int(time.time() * 1000) % 10**9}"
    workers = overrides.pop("speech_workers", 1)
    ready_s = overrides.pop("ready_s", 60)
    base = dict(models=model, default_model=model, block_ms=200, heartbeat_s=1)
    settings = Settings(redis_url=redis_url, key_prefix=prefix, data_dir=data_dir, **{**base, **overrides})
    running = start_fleet(settings, log_dir, speech_workers=workers)
    try:
        deadline = time.monotonic() + ready_s
        with redis.Redis.from_url(redis_url) as r:
            while r.zcard(Names(prefix).live_workers("speech", model)) < workers:
                assert time.monotonic() < deadline, running.logs()
                time.sleep(0.2)
        yield running
    finally:
        running.stop()
        delete_prefix(redis_url, prefix)


def espeak_fleet(redis_url: str, data_dir: Path, log_dir: Path, name: str, **overrides):
    """``speech_fleet`` of eSpeak NG."""
    return speech_fleet(redis_url, data_dir, log_dir, name, "espeak", **overrides)


def connect(url: str) -> redis.Redis:
    """A synchronous client of ``url``: redis-py's cluster client for a ``redis+cluster://`` URL."""
    from fleet.redis import sync_client_of

    return sync_client_of(url)


def delete_prefix(url: str, prefix: str, rq_url: str | None = None) -> None:
    """Every key of the prefix (on a cluster: on every primary), and RQ's keys of it (on ``rq_url``,
    RQ's own Redis, where given)."""
    for server, patterns in ((url, (f"{prefix}:*", f"rq:*{prefix}*")), (rq_url, (f"rq:*{prefix}*",))):
        if server is None:
            continue
        with contextlib.closing(connect(server)) as client:
            for pattern in patterns:
                keys = list(client.scan_iter(match=pattern, count=1000))
                for i in range(0, len(keys), 500):
                    client.delete(*keys[i : i + 500])  # a cluster client splits them by slot


def wait_until(predicate: Callable[[], bool], timeout: float, what: str, every: float = 0.2) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(every)


# --- memory under back-pressure ------------------------------------------------------------------------


def words(text: str) -> int:
    return len(re.findall(r"[\w'-]+", text))


def rms(x: np.ndarray) -> float:
    return float(np.sqrt(np.mean(x.astype(np.float64) ** 2))) if x.size else 0.0


def segment_wpm(job_manifest: dict) -> dict[int, float]:
    """Words a minute of each segment of a finished job's manifest (its text over its audio)."""
    return {
        s["index"]: words(s["text"]) / ((s["end_s"] - s["start_s"]) / 60) for s in job_manifest["segments"]
    }


def syllables(i: int) -> str:
    """A short word of its own for every number ("ba", "da", ..., "dadadi"): no digits, which text
    normalisation would spell out ("Go 4999." is said "Go four thousand nine hundred ninety-nine.",
    three times the tokens of a model that never stops)."""
    consonants, vowels = "bdfgklmnprstvz", "aeiou"
    word = ""
    while True:
        word = consonants[i % len(consonants)] + vowels[i // len(consonants) % len(vowels)] + word
        i //= len(consonants) * len(vowels)
        if i == 0:
            return word


def short_sentences(n: int, per_paragraph: int = 50) -> str:
    """``n`` sentences of two short words each ("Go ba."): each is one segment of the fewest frames."""
    return "\n\n".join(
        " ".join(f"Go {syllables(i)}." for i in range(start, min(start + per_paragraph, n)))
        for start in range(0, n, per_paragraph)
    )


@dataclass
class MemoryBound:
    """What Redis may hold while decoders are stopped, from the sizes of what the fleet writes.

    With the decoders stopped nothing leaves the code-chunk stream, so it grows until the AR workers'
    back-pressure check sees more than ``max_stream_backlog`` entries; a worker checks before each read
    and then starts at most as many segments as its engine has slots (``max_num_seqs`` +
    ``interactive_slots``: a batch segment already admitted to the stream may take a reserved slot),
    so at most ``ar_workers x slots`` segments are started past the limit, each writing
    ``windows_per_segment`` chunks:

        chunk entries <= max_stream_backlog + ar_workers * slots * windows_per_segment

    Besides, the job's own keys: one task entry per segment (its text, the input; they leave the stream
    as segments start) and the plan. The audio stream and delta hashes stay empty (no decoder output).
    Measured on Valkey (MEMORY USAGE): a stream of these entries takes 1.06x their raw bytes (listpack
    headers, entry ids, radix-tree nodes), a string 1.0x; ``overhead`` = 1.5 covers that with room.
    ``margin`` (512 KiB) covers what does not grow with the job: about 180 KiB that stays allocated
    after a large MULTI (buffers), the events and the job hash, the sampler's own connection.

        bound = baseline + overhead * (tasks + plan + chunk entries * chunk bytes) + margin

    ``baseline`` is used_memory of the idle fleet (every worker connected). The bound holds once the
    submit is over: while Valkey executes the submit's MULTI it briefly holds up to ~4 copies of the
    job's tasks (query buffer, queued commands, append-only buffer, the stream): reported, not bounded
    here (it is the input's size, not the audio's).
    """

    baseline: int
    segments: int
    task_bytes: int  # all task entries (fields and values), raw
    plan_bytes: int
    chunk_entries: int
    chunk_bytes: int  # the largest code-chunk entry, raw
    slots_per_worker: int  # an AR worker's engine slots (Settings.engine_slots)
    most_chunks_per_segment: int  # windows of the segment the AR worker cuts into the most
    fewest_chunks_per_segment: int  # and into the fewest
    all_chunks: int  # windows of every segment together
    overhead: float = 1.5
    margin: int = 512 << 10

    @property
    def job_bytes(self) -> int:
        return self.task_bytes + self.plan_bytes + self.chunk_entries * self.chunk_bytes

    @property
    def bound(self) -> int:
        return self.baseline + int(self.overhead * self.job_bytes) + self.margin

    @property
    def unbounded_codes(self) -> int:
        """Raw bytes of the code chunks of every segment: what the stream would grow to without
        back-pressure (and 60x that in audio, were the assembler the one stopped)."""
        return self.all_chunks * self.chunk_bytes

    @classmethod
    def derive(cls, settings: Settings, ar_workers: int, text: str, baseline: int) -> MemoryBound:
        from fleet.messages import CodeChunk
        from jobs.service import JobRequest, tasks_for, validate
        from models.registry import get_model
        from workers.ar import StreamingConfig

        job, plan = validate(JobRequest(text=text), settings)
        tasks = tasks_for(job, plan)
        entry = lambda fields: sum(len(k) + len(v) for k, v in fields.items())  # noqa: E731
        family = get_model(job.model, settings).family
        streaming = StreamingConfig.from_settings(settings, family)  # as the AR worker chunks

        def windows(task):  # a segment's windows at its whole token budget (the tiny model never stops)
            chunker = streaming.chunker(family.layout, task.segment)  # the ramp: segment 0 only
            frames = family.max_tokens(task.text) // family.layout.codes_per_frame
            codes = family.layout.frames_to_tokens(
                np.zeros((frames, family.layout.codes_per_frame), np.int32)
            )
            return chunker.feed(codes) + chunker.finish()

        cut = {task.segment: windows(task) for task in tasks}
        chunk_bytes = max(
            entry(
                CodeChunk(job.id, segment, 99, w.seq, job.model, w.left, w.right, w.final, w.frames).encode()
            )
            for segment, cut_windows in cut.items()
            for w in cut_windows
        )
        most = max(len(w) for w in cut.values())
        slots = settings.engine_slots
        return cls(
            baseline=baseline,
            segments=len(tasks),
            task_bytes=sum(entry(t.encode()) for t in tasks),
            plan_bytes=len(plan.to_json()),
            chunk_entries=settings.max_stream_backlog + ar_workers * slots * most,
            chunk_bytes=chunk_bytes,
            slots_per_worker=slots,
            most_chunks_per_segment=most,
            fewest_chunks_per_segment=min(len(w) for w in cut.values()),
            all_chunks=sum(len(w) for w in cut.values()),
        )


@dataclass
class PausedRun:
    """What a paused-decoder run saw: memory, how far the AR stage went, and the job's end."""

    bound: MemoryBound
    peak_paused: int  # used_memory peak once the AR stage had stopped, until SIGCONT
    paused_samples: int  # how many used_memory samples that peak is the maximum of
    peak_submit: int  # used_memory peak from submit to SIGCONT (the submit's MULTI included)
    peak_run: int  # used_memory peak over the whole run (decoders and assembler at work after SIGCONT)
    started_paused: int  # segments started (attempt numbers handed out) while decoders were stopped
    tasks_left: int  # tasks never started while decoders were stopped (queued or admitted)
    codes_paused: int  # code-chunk entries waiting while decoders were stopped
    held_s: float  # how long the AR stage was watched standing still
    moved_while_held: bool  # whether anything moved while it was watched
    job: dict
    stall_s: float  # submit -> AR stage stopped
    resume_s: float  # SIGCONT -> job done
    wall_s: float

    def report(self) -> dict:
        b = self.bound
        return {
            "segments": b.segments,
            "baseline_bytes": b.baseline,
            "peak_paused_bytes": self.peak_paused,
            "paused_samples": self.paused_samples,
            "bound_bytes": b.bound,
            "peak_with_submit_bytes": self.peak_submit,
            "bound_terms": {
                "task_bytes": b.task_bytes,
                "plan_bytes": b.plan_bytes,
                "chunk_entries": b.chunk_entries,
                "chunk_bytes": b.chunk_bytes,
                "overhead": b.overhead,
                "margin_bytes": b.margin,
            },
            "codes_without_backpressure_bytes": b.unbounded_codes,
            "peak_run_bytes": self.peak_run,
            "started_while_paused": self.started_paused,
            "tasks_left_while_paused": self.tasks_left,
            "code_chunks_while_paused": self.codes_paused,
            "status": self.job["status"],
            "segments_done": self.job["segments_done"],
            "stall_s": round(self.stall_s, 1),
            "resume_s": round(self.resume_s, 1),
            "wall_s": round(self.wall_s, 1),
        }


def wait_for_consumers(r: redis.Redis, names: Names, counts: dict[str, int], timeout: float = 120) -> None:
    """Until each stage's group has this many consumers (the workers are up and reading)."""

    def ready() -> bool:
        for stream, group in stage_streams(names):
            groups = {g["name"].decode(): g for g in r.xinfo_groups(stream)} if r.exists(stream) else {}
            if group in counts and (group not in groups or groups[group]["consumers"] < counts[group]):
                return False
        return True

    wait_until(ready, timeout, "the workers did not come up")


def paused_decoders_run(
    fleet: RunningFleet, valkey: PrivateValkey, text: str, *, ar_workers: int, hold_s: float = 5.0
) -> PausedRun:
    """Submit ``text`` with every decoder SIGSTOPped; once the AR stage has stopped pulling (back-
    pressure), watch it stand still for ``hold_s`` while sampling Redis memory; SIGCONT the decoders
    and wait for the job to end."""
    names = Names(fleet.settings.key_prefix)
    r = redis.Redis.from_url(valkey.url)
    decoders = sum(c.name.startswith("decoder-") for c in fleet.supervisor.children)
    wait_for_consumers(r, names, {AR_GROUP: ar_workers, DECODER_GROUP: decoders, ASSEMBLER_GROUP: 1})
    baseline = 0
    for _ in range(5):  # the fleet idle: every worker connected, nothing submitted
        baseline = max(baseline, valkey.used_memory())
        time.sleep(0.2)
    bound = MemoryBound.derive(fleet.settings, ar_workers, text, baseline)
    codes = names.codes("tiny")
    started = time.monotonic()
    with MemorySampler(valkey.url) as whole, fleet.client() as client:
        with stopped(fleet.supervisor, "decoder-"), MemorySampler(valkey.url) as with_submit:
            job_id = submit(client, text=text)["id"]

            def state() -> tuple[int, int, int]:
                return r.hlen(names.attempts(job_id)), r.xlen(codes), unstarted_tasks(r, names)

            last, still_since = state(), time.monotonic()
            while time.monotonic() - still_since < 3.0 or last[1] <= fleet.settings.max_stream_backlog:
                time.sleep(0.5)
                now = state()
                if now != last:
                    last, still_since = now, time.monotonic()
                assert time.monotonic() - started < 300, f"the AR stage never stopped: {now}"
            stall_s = time.monotonic() - started
            with MemorySampler(valkey.url) as paused:
                time.sleep(hold_s)
            held = state()
        resumed = time.monotonic()
        job = wait_done(client, job_id, timeout=1800)
        done = time.monotonic()
    r.close()
    return PausedRun(
        bound=bound,
        peak_paused=paused.peak,
        paused_samples=paused.samples,
        peak_submit=with_submit.peak,
        peak_run=whole.peak,
        started_paused=held[0],
        tasks_left=held[2],
        codes_paused=held[1],
        held_s=hold_s + 3.0,
        moved_while_held=held != last,
        job=job,
        stall_s=stall_s,
        resume_s=done - resumed,
        wall_s=done - started,
    )


def ffprobe(path, *sections: str) -> dict:
    """What Debian's ffprobe reads of a file (``sections``: "format", "streams", "chapters"), as JSON."""
    import json
    import subprocess

    flags = [f"-show_{section}" for section in sections]
    run = subprocess.run(["ffprobe", "-v", "error", *flags, "-of", "json", str(path)], capture_output=True, text=True, check=True)
    return json.loads(run.stdout)


# --- several hosts on one Redis -------------------------------------------------------------------------


def free_ports(count: int) -> int:
    """The first of ``count`` consecutive ports free on 127.0.0.1 now (a worker's metrics each).

    Chosen below the kernel's ephemeral range: the workers bind them seconds later, and a port of
    that range can meanwhile become the local end of any process's outgoing connection (Redis, S3),
    which once left a worker without its metrics port ("Address already in use")."""
    import socket

    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    top = max(low, 20000) - count  # 10000 … the ephemeral range's start
    for _ in range(200):
        base = random.randrange(10000, top)
        held = []
        try:
            for port in range(base, base + count):
                s = socket.socket()
                held.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
    raise RuntimeError(f"no {count} consecutive free ports")


def start_host(
    settings: Settings,
    log_dir: Path,
    *,
    api: bool = True,
    ar_workers=1,
    decoders=1,
    assemblers=1,
    finalizers=1,
    speech_workers=1,
    max_backoff_s: float = 30.0,
) -> RunningFleet:
    """One host's fleet as ``narrate fleet`` starts it (``api=False``: ``narrate fleet --no-api``, and
    ``base_url`` is empty), its AR workers and decoders placed on ``settings.gpus`` as the command
    places them; several against one Redis and one storage, each with its own ``data_dir``, are one
    fleet. Returns once the API answers (with ``api``); the segment cache is off unless set."""
    from narrate.supervisor import fleet_gpu_options

    if "segment_cache" not in settings.model_fields_set:
        settings = settings.model_copy(update={"segment_cache": "off"})
    port = free_port() if api else None
    children = fleet_children(
        api=api,
        ar_workers=ar_workers,
        decoders=decoders,
        assemblers=assemblers,
        finalizers=finalizers,
        models=list(settings.model_names),
        api_port=port,
        speech_workers=speech_workers,
        metrics_port=settings.metrics_port,
        **fleet_gpu_options(settings),
    )
    supervisor = Supervisor(children, child_env(settings), log_dir=log_dir, max_backoff_s=max_backoff_s)
    supervisor.start()
    fleet = RunningFleet(settings, f"http://127.0.0.1:{port}" if api else "", supervisor, log_dir)
    deadline = time.monotonic() + 60
    while api:
        try:
            if httpx.get(f"{fleet.base_url}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            fleet.stop()
            raise RuntimeError(f"the API did not come up\n{fleet.logs()}")
        time.sleep(0.2)
    return fleet


def metrics_ports(fleet: RunningFleet) -> dict[str, int]:
    """Each worker child's metrics port (``metrics_port`` set), by child name."""
    children = fleet.supervisor.children
    return {c.name: int(c.env["NARRATE_METRICS_PORT"]) for c in children if "NARRATE_METRICS_PORT" in c.env}


def metric(port: int, name: str, **labels: str) -> float:
    """One sample of a worker's /metrics on ``port`` (0 when it has none)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return sample.value
    return 0.0
