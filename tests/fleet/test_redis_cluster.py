"""fleet/redis.py: which URLs name a cluster, what a cluster's clients are, RQ's own Redis."""

from __future__ import annotations

import asyncio

import pytest
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster

from fleet.redis import (
    ClusterURL,
    RedisConfigError,
    async_client,
    is_cluster,
    parse_cluster_url,
    rq_client,
    rq_url,
    sync_client,
)
from fleet.settings import Settings


@pytest.mark.parametrize(
    ("url", "parsed"),
    [
        ("redis://127.0.0.1:6379/0", None),
        ("rediss://h:1/2", None),
        ("unix:///tmp/redis.sock", None),
        ("redis+cluster://10.0.0.1:7000", ClusterURL((("10.0.0.1", 7000),))),
        ("redis+cluster://a:7000,b:7001,c", ClusterURL((("a", 7000), ("b", 7001), ("c", 6379)))),
        ("REDIS+CLUSTER://a:1/", ClusterURL((("a", 1),))),
        ("redis+cluster://:s%40cret@a:1/0", ClusterURL((("a", 1),), None, "s@cret")),
        ("redis+cluster://me:pw@a:1,b:2", ClusterURL((("a", 1), ("b", 2)), "me", "pw")),
        ("rediss+cluster://a:1", ClusterURL((("a", 1),), ssl=True)),
        ("redis+cluster://[::1]:7000,[fe80::2]", ClusterURL((("::1", 7000), ("fe80::2", 6379)))),
    ],
)
def test_cluster_urls(url, parsed):
    assert parse_cluster_url(url) == parsed


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("redis+cluster://a:1/3", "only database 0"),
        ("redis+cluster://", "names no node"),
        ("redis+cluster://a:port", "bad node 'a:port'"),
    ],
)
def test_bad_cluster_urls(url, message):
    with pytest.raises(RedisConfigError, match=message):
        parse_cluster_url(url)


CLUSTER = "redis+cluster://127.0.0.1:7000,127.0.0.1:7001"


def test_a_cluster_without_a_redis_for_rq_is_refused_at_start_up():
    settings = Settings(redis_url=CLUSTER)
    for make in (async_client, sync_client, rq_client):
        with pytest.raises(RedisConfigError, match="NARRATE_RQ_REDIS_URL"):
            make(settings)


def test_rq_is_never_given_a_cluster():
    with pytest.raises(RedisConfigError, match="NARRATE_RQ_REDIS_URL names a Redis Cluster"):
        rq_url(Settings(redis_url="redis://x:1/0", rq_redis_url=CLUSTER))


def test_rq_url_defaults_to_the_fleets_one_server():
    assert rq_url(Settings(redis_url="redis://x:1/3")) == "redis://x:1/3"
    assert rq_url(Settings(redis_url=CLUSTER, rq_redis_url="redis://rq:2/0")) == "redis://rq:2/0"


def test_rq_redis_url_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("REDIS_URL", CLUSTER)
    monkeypatch.setenv("NARRATE_RQ_REDIS_URL", "redis://rq:2/0")
    settings = Settings()
    assert settings.rq_redis_url == "redis://rq:2/0"
    assert settings.to_env()["NARRATE_RQ_REDIS_URL"] == "redis://rq:2/0"  # children inherit it


def test_a_cluster_url_makes_cluster_clients_with_the_fleets_timeouts():
    settings = Settings(redis_url="redis+cluster://:pw@127.0.0.1:7000,127.0.0.1:7001", rq_redis_url="redis://rq:2/0")
    client = async_client(settings)  # nothing is connected until a command
    try:
        assert isinstance(client, AsyncRedisCluster) and is_cluster(client)
        assert client.connection_kwargs["socket_timeout"] == 30.0
        assert client.connection_kwargs["password"] == "pw"
        assert client.connection_kwargs["max_connections"] == 2 * settings.redis_max_connections
        assert {(n.host, n.port) for n in client.nodes_manager.startup_nodes.values()} == {
            ("127.0.0.1", 7000),
            ("127.0.0.1", 7001),
        }
    finally:
        asyncio.run(client.aclose())
    rq = rq_client(settings)
    assert not is_cluster(rq) and rq.connection_pool.connection_kwargs["host"] == "rq"
    rq.close()


def test_one_server_keeps_plain_clients():
    settings = Settings(redis_url="redis://127.0.0.1:6379/7")
    client = sync_client(settings)
    assert not is_cluster(client) and not is_cluster(rq_client(settings))
    client.close()
