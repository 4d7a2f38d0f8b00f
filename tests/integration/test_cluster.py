"""The fleet's keys on a real Valkey Cluster (testing/cluster.py): where a thousand jobs' keys land,
and the transport's reads over streams of several slots. (The whole fleet on a cluster:
test_fleet.py and test_chaos.py, their ``[cluster]`` variants.)"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter

import pytest
from redis.crc import key_slot

from fleet.names import COUNTER_PARTS, Names
from fleet.redis import async_client, is_cluster
from fleet.settings import Settings
from testing.fleetkit import connect, delete_prefix

pytestmark = pytest.mark.integration

JOBS = 1000


@pytest.fixture
def cluster_settings(valkey_cluster, redis_url, data_dir, tiny_dir):
    prefix = f"spread-{int(time.time() * 1000) % 10**9}"
    yield Settings(
        redis_url=valkey_cluster.url, rq_redis_url=redis_url, key_prefix=prefix, data_dir=data_dir, task_shards=3,
        segment_cache="off",
    )  # fmt: skip
    delete_prefix(valkey_cluster.url, prefix, redis_url)


def _primary_of_slot(valkey_cluster) -> dict[int, int]:
    """slot -> the port of the primary serving it."""
    with contextlib.closing(connect(valkey_cluster.url)) as r:
        return {slot: r.nodes_manager.get_node_from_slot(slot).port for slot in range(16384)}


def test_a_thousand_jobs_keys_spread_over_the_primaries(cluster_settings, valkey_cluster):
    """Each job's keys share its hash tag (one slot: its scripts and MULTI are legal); the jobs spread
    evenly over the primaries; the keys every job writes besides its own are few and known."""
    from jobs.service import JobRequest, submit
    from jobs.store import JobStore

    settings = cluster_settings
    names = Names(settings.key_prefix)

    async def make() -> list[str]:
        client = async_client(settings)
        assert is_cluster(client)
        store = JobStore.for_settings(client, settings)
        ids = []
        try:
            for i in range(JOBS):
                job = await submit(store, settings, JobRequest(text=f"Line {i}. And one more.", tenant=f"t{i % 7}"))
                ids.append(job.id)
            for job_id in ids[: JOBS // 2]:
                await store.cancel(job_id)  # jobs end too: the counters take their parts
        finally:
            await client.aclose()
        return ids

    started = time.monotonic()
    ids = asyncio.run(make())
    made_s = time.monotonic() - started
    owner = _primary_of_slot(valkey_cluster)
    primaries = sorted(set(owner.values()))
    assert len(primaries) == 3

    per_primary: Counter = Counter()
    job_slots = set()
    with contextlib.closing(connect(valkey_cluster.url)) as r:
        for job_id in ids:
            keys = names.job_keys(job_id)
            slots = {key_slot(k.encode()) for k in keys}
            assert len(slots) == 1, keys  # one slot per job
            job_slots |= slots
            per_primary[owner[slots.pop()]] += 1
        # what is there, by primary (SCAN on each primary: what was written, not what was computed)
        stored: dict[int, Counter] = {}
        for node in r.get_primaries():
            kinds: Counter = Counter()
            for key in node.redis_connection.scan_iter(match=f"{settings.key_prefix}:*", count=1000):
                kinds["job" if key.startswith(f"{settings.key_prefix}:job:".encode()) else "shared"] += 1
            stored[node.port] = kinds
        shared = sorted(
            k.decode() for k in r.scan_iter(match=f"{settings.key_prefix}:*", count=1000)
            if not k.startswith(f"{settings.key_prefix}:job:".encode())
        )  # fmt: skip
    counter_ports = Counter(owner[key_slot(names.counters(p).encode())] for p in range(COUNTER_PARTS))
    print(
        f"\n{JOBS} jobs made in {made_s:.1f} s over {len(job_slots)} slots; jobs per primary: "
        f"{dict(sorted(per_primary.items()))}; keys stored per primary: "
        f"{ {port: dict(c) for port, c in sorted(stored.items())} }; counter parts per primary: "
        f"{dict(sorted(counter_ports.items()))}; shared keys: {len(shared)}"
    )
    # binomial(1000, 1/3): 333 +- 15; 250..420 is beyond 5 standard deviations
    assert set(per_primary) == set(primaries)
    assert all(250 <= n <= 420 for n in per_primary.values()), per_primary
    assert all(stored[p]["job"] > 0 for p in primaries)
    assert len(counter_ports) >= 2  # the jobs_ended counter is not one slot
    # the shared keys: indexes (one write per job), the tenants' own (one tag each), the 3 shards'
    # admission keys, the counter parts; nothing else
    allowed = (":jobs", ":tenants", ":tenant:{", ":q:{tiny.", ":tasks:{tiny.", ":counters")
    assert all(any(part in k for part in allowed) for k in shared), shared


def test_the_transport_reads_every_slot_in_turn_and_blocks_across_them(cluster_settings):
    """A consumer of streams in three slots: one read takes from the next slot each time (no shard
    is favoured), and a blocking read on empty streams wakes for an entry in any of them."""
    from workers.transport import RedisStreams

    settings = cluster_settings
    names = Names(settings.key_prefix)
    streams = [names.tasks("tiny", shard) for shard in range(3)]
    assert len({key_slot(s.encode()) for s in streams}) == 3

    async def scenario():
        client = async_client(settings)
        try:
            transport = RedisStreams(
                client, streams, "ar", "c1", dead_letter_stream=names.dead_letters(), reclaim_idle_ms=60_000
            )
            await transport.setup()
            for stream in streams:
                for i in range(3):
                    await client.xadd(stream, {"i": str(i)})
            order = [(await transport.read(1, None))[0].stream for _ in range(9)]
            assert await transport.read(5, None) == []
            # all empty: a blocking read wakes for an entry in any slot, well before its block ends
            wakes = []
            for stream in streams:
                async def later(stream=stream):
                    await asyncio.sleep(0.3)
                    await client.xadd(stream, {"late": "1"})

                task = asyncio.create_task(later())
                started = time.monotonic()
                got = await transport.read(1, 3000)
                wakes.append(time.monotonic() - started)
                await task
                assert [d.stream for d in got] == [stream]
            started = time.monotonic()
            assert await transport.read(1, 400) == []
            waited = time.monotonic() - started
            return order, wakes, waited
        finally:
            await client.aclose()

    order, wakes, waited = asyncio.run(scenario())
    assert Counter(order) == dict.fromkeys(streams, 3)  # three from each
    assert all(order[i] != order[i + 1] for i in range(len(order) - 1))  # never the same slot twice
    assert all(w < 1.0 for w in wakes), wakes
    assert 0.35 < waited < 1.0, waited


def test_kill_primary_promotes_its_replica(tmp_path):
    """testing/cluster.py's failover helper (for the failover tests to come), on a cluster of its own:
    a SIGKILLed primary's replica serves its slots, with what was replicated before the kill."""
    from testing.cluster import ValkeyCluster

    with ValkeyCluster(tmp_path / "cluster") as cluster:
        before = cluster.primary_ports()
        victim = cluster.nodes[0].port
        with contextlib.closing(cluster.client()) as r:
            for i in range(300):
                r.set(f"k{i}", i)
            r.execute_command("WAIT", 1, 2000, target_nodes=r.get_primaries())
        started = time.monotonic()
        promoted = cluster.kill_primary(0)
        took = time.monotonic() - started
        after = cluster.primary_ports()
        print(f"\nfailover of {victim} to {promoted.port} in {took:.1f} s")
        assert victim in before and victim not in after and promoted.port in after and len(after) == 3
        with contextlib.closing(cluster.client()) as r:
            assert [int(r.get(f"k{i}")) for i in range(300)] == list(range(300))
