"""Rendered segments, kept and found again: a revised book renders only the sentences that changed.

A segment's audio is addressed by a hash of everything that determines it (``key_of``): the model
and its identity (checkpoint files, engine version: models/registry.py), the voice, rate and pitch,
the segment's seed (from the job's seed, the voice and what is said), what is said (after the
lexicon), and the streaming settings that shape its windows. A finished job's segments are copied
into the cache when it is finalized (``promote``; flagged runaway segments are not kept); a new job
looks its segments up when it is queued (``lookup``): those found are not rendered again, they are
recorded done at once and the finalizer reads them from the cache.

Scope: each tenant has its own cache (``segment_cache="tenant"``, the default) unless the fleet is
configured to share one (``"shared"``); ``"off"`` keeps nothing. Retention: an entry is kept
``segment_cache_retention_s`` after its last use (a job queued with it, or a finalize reading it);
the sweep (jobs/sweep.py) releases older ones, their objects first. A job that reuses an entry
touches it when queued and when finalized, so no entry a live job needs ages out first unless the
job outlives the whole retention.

Keys (fleet/names.py): ``{p}:segcache:{scope}`` (hash: key -> samples) and ``{p}:segcache:{scope}:used``
(zset: key -> last use); objects ``segments/{scope}/{key}.pcm``.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from concurrent.futures import ThreadPoolExecutor

from fleet.settings import Settings
from fleet.storage import Storage
from jobs.model import Job
from jobs.segmentation import Plan
from models.registry import get_model, model_identity

SHARED = "shared"
#: Segments copied into the cache at once when a job is finalized.
COPY_THREADS = 8


def scope_of(settings: Settings, tenant: str) -> str | None:
    """The cache a tenant's jobs use (None: no cache)."""
    if settings.segment_cache == "off":
        return None
    return SHARED if settings.segment_cache == SHARED else f"t-{tenant}"


def keys_of(job: Job, plan: Plan, settings: Settings) -> list[str]:
    """Each segment's cache key (CPU: runs where the job is validated, in a thread)."""
    from jobs.service import segment_seed

    spec = get_model(job.model, settings)
    family = spec.family
    streaming = ""
    if not spec.single_stage:
        left = family.left_context_frames if settings.left_context_frames is None else settings.left_context_frames
        right = family.lookahead_frames if settings.lookahead_frames is None else settings.lookahead_frames
        streaming = f"{settings.chunk_frames}/{left}/{right}"
    base = "\x1f".join(
        [model_identity(spec, settings), job.voice, str(job.rate), str(job.pitch), str(family.sample_rate), streaming]
    )
    keys = []
    for segment in plan.segments:
        said = segment.spoken_text
        first = settings.first_chunk_frames if segment.index == 0 and not spec.single_stage else 0
        raw = f"{base}\x1f{first}\x1f{segment_seed(job.seed, job.voice, said)}\x1f{said}"
        keys.append(hashlib.blake2b(raw.encode(), digest_size=20).hexdigest())
    return keys


def object_key(scope: str, key: str) -> str:
    return f"segments/{scope}/{key}.pcm"


class SegmentCache:
    def __init__(self, redis, names, settings: Settings) -> None:
        self.redis = redis
        self.names = names
        self.settings = settings

    async def lookup(self, scope: str, keys: list[str]) -> dict[int, tuple[str, int]]:
        """The segments already rendered: index -> (object key, samples); touches what it finds."""
        if not keys:
            return {}
        found = await self.redis.hmget(self.names.segment_cache(scope), keys)
        hits = {i: (object_key(scope, k), int(v)) for i, (k, v) in enumerate(zip(keys, found, strict=True)) if v}
        if hits:
            await self.touch(scope, [keys[i] for i in hits])
        return hits

    async def touch(self, scope: str, keys: list[str]) -> None:
        if keys:
            now = time.time()
            await self.redis.zadd(self.names.segment_cache_used(scope), dict.fromkeys(keys, now))

    async def promote(self, storage: Storage, scope: str, entries: list[tuple[str, str, int]]) -> int:
        """Keep finished segments: (the part's object key, the cache key, samples) each; objects
        first, then the index (an entry never points at a missing object). How many were new."""
        index = self.names.segment_cache(scope)
        known = await self.redis.hmget(index, [k for _, k, _ in entries]) if entries else []
        new = [(part, key, samples) for (part, key, samples), have in zip(entries, known, strict=True) if not have]
        if new:  # copies side by side (S3: server-side, ~20 ms each)
            with ThreadPoolExecutor(COPY_THREADS) as pool:
                copies = [pool.submit(storage.copy, part, object_key(scope, key)) for part, key, _ in new]
                await asyncio.gather(*(asyncio.wrap_future(c) for c in copies))
        if new:
            await self.redis.hset(index, mapping={key: samples for _, key, samples in new})
        await self.touch(scope, [key for _, key, _ in entries])
        return len(new)

    async def release_old(self, storage: Storage, scope: str, older_than_s: float) -> int:
        """Drop the entries unused for ``older_than_s``: index first (no job finds them any more),
        then their objects."""
        used = self.names.segment_cache_used(scope)
        cutoff = time.time() - older_than_s
        old = [k.decode() for k in await self.redis.zrangebyscore(used, "-inf", cutoff, start=0, num=10_000)]
        if not old:
            return 0
        await self.redis.hdel(self.names.segment_cache(scope), *old)
        await self.redis.zrem(used, *old)
        for key in old:
            await asyncio.to_thread(storage.delete_prefix, object_key(scope, key))
        return len(old)

    async def scopes(self) -> list[str]:
        """Every scope with entries (for the sweep)."""
        pattern = self.names.segment_cache_used("*")
        head, tail = pattern.split("*")
        return [raw.decode()[len(head) : -len(tail)] async for raw in self.redis.scan_iter(match=pattern, count=1000)]
