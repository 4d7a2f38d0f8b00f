"""Readiness entries on a real Redis: a heartbeat makes a worker live, leaving or silence ends it."""

from __future__ import annotations

import asyncio

from fleet import readiness
from fleet.names import Names
from fleet.redis import async_client
from fleet.settings import Settings


def test_heartbeats_leave_and_silence(redis_url, key_prefix):
    settings = Settings(redis_url=redis_url, key_prefix=key_prefix)
    names = Names(key_prefix)
    wanted = [("speech", "espeak"), ("ar", "tiny")]

    async def scenario() -> list[dict]:
        redis = async_client(settings)
        try:
            seen = [await readiness.live_counts(redis, names, wanted, 0.2)]
            await readiness.beat(redis, names, "speech", ["espeak"], "speech-a", 0.2)
            await readiness.beat(redis, names, "speech", ["espeak"], "speech-b", 0.2)
            seen.append(await readiness.live_counts(redis, names, wanted, 0.2))
            await readiness.leave(redis, names, "speech", ["espeak"], "speech-a")
            seen.append(await readiness.live_counts(redis, names, wanted, 0.2))
            await asyncio.sleep(0.7)  # speech-b misses 3 heartbeats: killed, as far as anyone can tell
            seen.append(await readiness.live_counts(redis, names, wanted, 0.2))
            return seen
        finally:
            await redis.aclose()

    counts = [[c[w] for w in wanted] for c in asyncio.run(scenario())]
    assert counts == [[0, 0], [2, 0], [1, 0], [0, 0]]
