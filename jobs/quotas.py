"""A tenant's rates: requests a minute and characters a day, counted in Redis by the ``limits``
library (shared by every API process), refused with the seconds until there is room again.

Characters are tested before they are counted, so a refused job spends none of the day's budget
(two requests racing for the last room may both pass the test; the second is then refused by the
count, which keeps what it counted).
"""

from __future__ import annotations

import math
import time

import redis.asyncio as aioredis
from limits import RateLimitItemPerDay, RateLimitItemPerMinute
from limits.aio.storage import RedisClusterStorage, RedisStorage
from limits.aio.strategies import FixedWindowRateLimiter, SlidingWindowCounterRateLimiter

from fleet.names import Names
from fleet.redis import is_cluster
from jobs.errors import QuotaExceeded


def _cluster_storage(redis, names: Names) -> RedisClusterStorage:
    """The limits library's cluster storage, on the nodes and credentials of the fleet's client
    (it makes its own client: it cannot take one; its keys carry hash tags of their own)."""
    nodes = ",".join(f"{n.host}:{n.port}" for n in redis.nodes_manager.startup_nodes.values())
    kwargs = redis.connection_kwargs
    options = {k: kwargs[k] for k in ("username", "password") if kwargs.get(k)}
    if kwargs.get("connection_class") is not None and "SSL" in kwargs["connection_class"].__name__:
        options["ssl"] = True
    return RedisClusterStorage(
        f"async+redis+cluster://{nodes}", implementation="redispy", key_prefix=names.rate_limits(), **options
    )


class RateQuotas:
    def __init__(self, redis: aioredis.Redis, names: Names) -> None:
        storage = _cluster_storage(redis, names) if is_cluster(redis) else RedisStorage(
            "async+redis://",
            implementation="redispy",
            connection_pool=redis.connection_pool,
            key_prefix=names.rate_limits(),
        )
        self._requests = SlidingWindowCounterRateLimiter(storage)
        self._chars = FixedWindowRateLimiter(storage)

    @staticmethod
    def _wait(reset_time: float) -> int:
        return math.ceil(max(reset_time - time.time(), 1))

    async def request(self, tenant: str, per_minute: int) -> None:
        item = RateLimitItemPerMinute(per_minute)
        if not await self._requests.hit(item, tenant):
            stats = await self._requests.get_window_stats(item, tenant)
            raise QuotaExceeded(
                f"tenant {tenant} is over its {per_minute:,} requests a minute", self._wait(stats.reset_time)
            )

    async def characters(self, tenant: str, per_day: int, count: int) -> None:
        item = RateLimitItemPerDay(per_day)
        if count > per_day:
            raise QuotaExceeded(
                f"{count:,} characters are more than tenant {tenant}'s {per_day:,} a day", 24 * 3600
            )
        if not await self._chars.test(item, tenant, cost=count) or not await self._chars.hit(
            item, tenant, cost=count
        ):
            stats = await self._chars.get_window_stats(item, tenant)
            raise QuotaExceeded(
                f"tenant {tenant} has {stats.remaining:,} of its {per_day:,} characters a day left; this job has "
                f"{count:,}",
                self._wait(stats.reset_time),
            )

    async def give_back_characters(self, tenant: str, per_day: int, count: int) -> None:
        """Uncount a job's characters (it was refused after they were counted: nothing was kept)."""
        item = RateLimitItemPerDay(per_day)
        await self._chars.storage.incr(item.key_for(tenant), item.get_expiry(), amount=-count)
