"""Redis connections. Payloads are binary (PCM, codes), so clients never decode responses.

``REDIS_URL`` names one server (``redis://``, ``rediss://``, ``unix://``) or a Redis/Valkey Cluster
(``redis+cluster://[user:password@]host:port[,host:port...]``, ``rediss+cluster://`` with TLS; the
nodes are startup nodes, the client finds the rest). On a cluster every client is redis-py's
``RedisCluster``, and RQ (which does not support Redis Cluster) gets the standalone server of
``NARRATE_RQ_REDIS_URL``: ``rq_client``, never the fleet's client, is what RQ is given.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from urllib.parse import unquote

import redis
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.backoff import ExponentialBackoff
from redis.cluster import RedisCluster
from redis.exceptions import AskError, BusyLoadingError, MovedError, RedisError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry as RedisRetry

from fleet.settings import Settings

#: Socket read timeout, seconds. Must exceed every XREAD/XREADGROUP BLOCK the fleet uses (at most 5 s):
#: redis-py's default (5 s) would cut blocking reads short.
SOCKET_TIMEOUT_S = 30.0

#: Errors after which a command is retried on a fresh connection (Redis restarting, network blips).
TRANSIENT_ERRORS = (RedisConnectionError, RedisTimeoutError, BusyLoadingError, ConnectionResetError)

#: URL schemes that name a cluster, and the scheme of one of its nodes.
CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}


class RedisConfigError(RuntimeError):
    """The Redis settings cannot work (said at start-up, before anything is read or written)."""


class NotReplicatedError(RedisError):
    """Fewer replicas than asked for acknowledged a write in time (``write_durably``)."""


@dataclass(frozen=True)
class ClusterURL:
    nodes: tuple[tuple[str, int], ...]
    username: str | None = None
    password: str | None = None
    ssl: bool = False


def parse_cluster_url(url: str) -> ClusterURL | None:
    """The startup nodes and credentials of a ``redis+cluster://`` URL; None for any other URL."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in CLUSTER_SCHEMES:
        return None
    netloc, _, path = rest.partition("/")
    path = path.partition("?")[0]
    if path not in ("", "0"):
        raise RedisConfigError(f"a Redis Cluster has only database 0, not {path!r} ({scheme}://...)")
    auth, _, hosts = netloc.rpartition("@")
    user, _, password = auth.partition(":")
    nodes = []
    for item in filter(None, (h.strip() for h in hosts.split(","))):
        if item.startswith("["):  # [ipv6]:port
            host, _, port = item[1:].partition("]")
            port = port.lstrip(":")
        else:
            host, _, port = item.rpartition(":") if ":" in item else (item, "", "")
        try:
            nodes.append((host, int(port or 6379)))
        except ValueError:
            raise RedisConfigError(f"bad node {item!r} in the Redis Cluster URL") from None
    if not nodes:
        raise RedisConfigError("a redis+cluster:// URL names no node")
    return ClusterURL(
        tuple(nodes), unquote(user) or None, unquote(password) or None, scheme.lower() == "rediss+cluster"
    )


def redis_url(settings: Settings) -> str:
    if not settings.redis_url:
        raise RuntimeError(
            "REDIS_URL is not set (the fleet commands start an embedded Valkey when it is unset)"
        )
    return settings.redis_url


def cluster_of(settings: Settings) -> ClusterURL | None:
    """The fleet's cluster (None: one server). Refuses a cluster without a Redis for RQ."""
    cluster = parse_cluster_url(redis_url(settings))
    if cluster is not None and not settings.rq_redis_url:
        raise RedisConfigError(
            "REDIS_URL names a Redis Cluster, which RQ (the finalize queue) does not support: set "
            "NARRATE_RQ_REDIS_URL to a standalone Redis for it"
        )
    return cluster


def _cluster_nodes(cluster: ClusterURL, node_class) -> dict:
    """The cluster clients' startup nodes and credentials (redis-py's sync and asyncio ClusterNode)."""
    return dict(
        startup_nodes=[node_class(host, port) for host, port in cluster.nodes],
        username=cluster.username,
        password=cluster.password,
        ssl=cluster.ssl,
    )


def is_cluster(client) -> bool:
    return isinstance(client, RedisCluster | AsyncRedisCluster)


class _WaitingCluster(AsyncRedisCluster):
    """The asyncio cluster client raises MaxConnectionsError when a node's connections are all in
    use; the fleet's callers wait instead (as with the BlockingConnectionPool of one server)."""

    def __init__(self, *args, waiting_limit: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._waiting = asyncio.Semaphore(waiting_limit)

    async def execute_command(self, *args, **kwargs):
        async with self._waiting:
            return await super().execute_command(*args, **kwargs)


def async_client(settings: Settings) -> aioredis.Redis:
    """A client whose pool makes callers wait for a free connection rather than fail: a worker with
    hundreds of segments in flight must queue its Redis calls, not crash on "Too many connections"."""
    from redis.asyncio.cluster import ClusterNode
    from redis.asyncio.retry import Retry as AsyncRetry

    retry = AsyncRetry(ExponentialBackoff(cap=2.0, base=0.05), retries=8)
    common = dict(
        decode_responses=False,
        socket_timeout=SOCKET_TIMEOUT_S,
        socket_connect_timeout=5.0,
        health_check_interval=30,
        retry=retry,
        retry_on_error=list(TRANSIENT_ERRORS),
    )
    cluster = cluster_of(settings)
    if cluster is not None:
        return _WaitingCluster(
            **_cluster_nodes(cluster, ClusterNode),
            # per node; pipelines take connections beside the waiting commands: room for them
            max_connections=2 * settings.redis_max_connections,
            waiting_limit=settings.redis_max_connections,
            **common,
        )
    pool = aioredis.BlockingConnectionPool.from_url(
        redis_url(settings), max_connections=settings.redis_max_connections, timeout=SOCKET_TIMEOUT_S, **common
    )
    return aioredis.Redis.from_pool(pool)  # the client owns the pool: aclose() closes it


def _sync_options() -> dict:
    return dict(
        decode_responses=False,
        socket_timeout=SOCKET_TIMEOUT_S,
        socket_connect_timeout=5.0,
        health_check_interval=30,
        retry=RedisRetry(ExponentialBackoff(cap=2.0, base=0.05), retries=8),
        retry_on_error=list(TRANSIENT_ERRORS),
    )


def sync_client(settings: Settings) -> redis.Redis:
    """The fleet's keys, from synchronous code (a ``RedisCluster`` on a cluster). Not for RQ."""
    cluster_of(settings)  # refuses a cluster without a Redis for RQ
    return sync_client_of(redis_url(settings))


def sync_client_of(url: str) -> redis.Redis:
    """A synchronous client of ``url``: redis-py's ``RedisCluster`` for a ``redis+cluster://`` URL."""
    from redis.cluster import ClusterNode

    cluster = parse_cluster_url(url)
    if cluster is not None:
        return RedisCluster(**_cluster_nodes(cluster, ClusterNode), **_sync_options())
    return redis.Redis.from_url(url, **_sync_options())


def rq_url(settings: Settings) -> str:
    """RQ's Redis: ``NARRATE_RQ_REDIS_URL``, else the fleet's own (when that is one server)."""
    url = settings.rq_redis_url or redis_url(settings)
    if parse_cluster_url(url) is not None:
        what = "NARRATE_RQ_REDIS_URL" if settings.rq_redis_url else "REDIS_URL"
        raise RedisConfigError(
            f"{what} names a Redis Cluster, which RQ (the finalize queue) does not support: set "
            "NARRATE_RQ_REDIS_URL to a standalone Redis for it"
        )
    return url


def rq_client(settings: Settings) -> redis.Redis:
    """RQ's connection (RQ pickles payloads: a client without decode_responses)."""
    return redis.Redis.from_url(rq_url(settings), **_sync_options())


#: Options of a cluster node's connections that a client of that node alone takes over.
_NODE_OPTIONS = ("username", "password", "credential_provider", "socket_timeout", "socket_connect_timeout")


async def write_durably(
    client, key: str, write: Callable[[aioredis.Redis], Awaitable[None]], replicas: int, timeout_ms: int
) -> None:
    """``write(pinned)`` on one connection to the server holding ``key``, then WAIT until ``replicas``
    replicas hold it (``NotReplicatedError`` after ``timeout_ms``): WAIT counts only the writes of the
    connection it is sent on, and the fleet's clients pool theirs. A write sent to a server that no
    longer holds the slot (a failover the client has not heard of) is told MOVED, and goes there.
    Opens a connection each time: for rare writes (a job's creation), not per segment. ``write``
    must be all or nothing (one MULTI/EXEC: a MOVED aborts it whole)."""
    address = None
    for _ in range(3):
        async with _one_connection(client, key, address) as pinned:
            try:
                await write(pinned)
            except (MovedError, AskError) as exc:
                address = (exc.host, exc.port)
                continue
            acked = int(await pinned.execute_command("WAIT", replicas, timeout_ms))
            if acked < replicas:
                raise NotReplicatedError(
                    f"{acked} of {replicas} replica(s) acknowledged the write within {timeout_ms} ms"
                )
            return
    raise NotReplicatedError(f"the slot of {key!r} kept moving")


#: Options of a cluster node's connections that a client of that node alone takes over.
_NODE_OPTIONS = ("username", "password", "credential_provider", "socket_timeout", "socket_connect_timeout")


@contextlib.asynccontextmanager
async def _one_connection(client, key: str, address: tuple[str, int] | None) -> AsyncIterator[aioredis.Redis]:
    """A client of a single connection (a pool of one) to the server holding ``key``, or at
    ``address`` (a cluster's MOVED)."""
    if is_cluster(client):
        await client.initialize()  # no-op once the slot map is known
        node = client.get_node_from_key(key)
        host, port = address or (node.host, node.port)
        options = {
            k: v for k, v in node.connection_kwargs.items() if k in _NODE_OPTIONS or k.startswith("ssl")
        }
        pool = aioredis.BlockingConnectionPool(
            connection_class=node.connection_class, max_connections=1, host=host, port=port, **options
        )
    else:
        base = client.connection_pool
        pool = aioredis.BlockingConnectionPool(
            connection_class=base.connection_class, max_connections=1, **base.connection_kwargs
        )
    pinned = aioredis.Redis.from_pool(pool)
    try:
        yield pinned
    finally:
        await pinned.aclose()


async def server_runs(client) -> set[str]:
    """The run ids of the servers that hold the fleet's keys (every primary of a cluster). A server
    restarted, or a replica promoted in a failover, has a run id not seen before: the sign that
    acknowledged writes may be gone (replication and AOF fsync are asynchronous)."""
    if is_cluster(client):
        replies = await client.info("server", target_nodes=AsyncRedisCluster.PRIMARIES)
        infos = replies.values() if isinstance(replies, dict) and "run_id" not in replies else [replies]
    else:
        infos = [await client.info("server")]
    return {str(info["run_id"]) for info in infos}
