"""Redis connections. Payloads are binary (PCM, codes), so clients never decode responses."""

from __future__ import annotations

import redis
import redis.asyncio as aioredis
from redis.backoff import ExponentialBackoff
from redis.exceptions import BusyLoadingError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry as RedisRetry

from fleet.settings import Settings

#: Socket read timeout, seconds. Must exceed every XREAD/XREADGROUP BLOCK the fleet uses (at most 5 s):
#: redis-py's default (5 s) would cut blocking reads short.
SOCKET_TIMEOUT_S = 30.0

#: Errors after which a command is retried on a fresh connection (Redis restarting, network blips).
TRANSIENT_ERRORS = (RedisConnectionError, RedisTimeoutError, BusyLoadingError, ConnectionResetError)


def redis_url(settings: Settings) -> str:
    if not settings.redis_url:
        raise RuntimeError(
            "REDIS_URL is not set (the fleet commands start an embedded Valkey when it is unset)"
        )
    return settings.redis_url


def async_client(settings: Settings) -> aioredis.Redis:
    """A client whose pool makes callers wait for a free connection rather than fail: a worker with
    hundreds of segments in flight must queue its Redis calls, not crash on "Too many connections"."""
    from redis.asyncio.retry import Retry as AsyncRetry

    pool = aioredis.BlockingConnectionPool.from_url(
        redis_url(settings),
        max_connections=settings.redis_max_connections,
        timeout=SOCKET_TIMEOUT_S,
        decode_responses=False,
        socket_timeout=SOCKET_TIMEOUT_S,
        socket_connect_timeout=5.0,
        health_check_interval=30,
        retry=AsyncRetry(ExponentialBackoff(cap=2.0, base=0.05), retries=8),
        retry_on_error=list(TRANSIENT_ERRORS),
    )
    return aioredis.Redis.from_pool(pool)  # the client owns the pool: aclose() closes it


def sync_client(settings: Settings) -> redis.Redis:
    return redis.Redis.from_url(
        redis_url(settings),
        decode_responses=False,
        socket_timeout=SOCKET_TIMEOUT_S,
        socket_connect_timeout=5.0,
        health_check_interval=30,
        retry=RedisRetry(ExponentialBackoff(cap=2.0, base=0.05), retries=8),
        retry_on_error=list(TRANSIENT_ERRORS),
    )
