"""Which workers are alive, per kind and model: what ``GET /v1/models`` reports as ``ready``.

Every worker that serves models (AR, decoder, speech) adds itself to ``Names.live_workers(kind,
model)`` (a sorted set: consumer name -> time of its last heartbeat) every ``heartbeat_s`` and removes
itself when it stops; a worker silent for 3 heartbeats (killed) counts as dead and is pruned.
"""

from __future__ import annotations

import time

import redis.asyncio as aioredis

from fleet.names import Names

#: Heartbeats a worker may miss before it counts as dead.
MISSED_BEATS = 3


async def beat(
    redis: aioredis.Redis, names: Names, kind: str, models: list[str], member: str, heartbeat_s: float
) -> None:
    now = time.time()
    pipe = redis.pipeline(transaction=False)
    for model in models:
        key = names.live_workers(kind, model)
        pipe.zadd(key, {member: now})
        pipe.zremrangebyscore(key, "-inf", now - MISSED_BEATS * heartbeat_s)
        pipe.expire(key, max(int(MISSED_BEATS * heartbeat_s) + 1, 1))
    await pipe.execute()


async def leave(redis: aioredis.Redis, names: Names, kind: str, models: list[str], member: str) -> None:
    pipe = redis.pipeline(transaction=False)
    for model in models:
        pipe.zrem(names.live_workers(kind, model), member)
    await pipe.execute()


async def live_counts(
    redis: aioredis.Redis, names: Names, wanted: list[tuple[str, str]], heartbeat_s: float
) -> dict[tuple[str, str], int]:
    """(kind, model) -> workers heard from within the last 3 heartbeats."""
    since = time.time() - MISSED_BEATS * heartbeat_s
    pipe = redis.pipeline(transaction=False)
    for kind, model in wanted:
        pipe.zcount(names.live_workers(kind, model), since, "+inf")
    counts = await pipe.execute()
    return {pair: int(n) for pair, n in zip(wanted, counts, strict=True)}
