"""Fault injection: SIGKILL random workers of every kind while a job runs, with and without a restart
of Redis (a private, append-only Valkey) in the middle; nothing is lost or doubled.
A longer version (more segments, more kills, several Redis restarts) is bench/chaos.py."""

from __future__ import annotations

import contextlib
import time

import numpy as np
import pytest
import redis

from fleet.names import AR_GROUP, Names
from fleet.redis import rq_url
from fleet.settings import Settings
from testing.fleetkit import (
    KINDS,
    POISON,
    PrivateValkey,
    assert_nothing_left,
    chaos_settings,
    connect,
    delete_prefix,
    download,
    manifest_segments,
    short_sentences,
    start_fleet,
    storm,
    submit,
    wait_done,
)

pytestmark = pytest.mark.integration

SEGMENTS = 320
TEXT = short_sentences(SEGMENTS, per_paragraph=10)  # two words a sentence: the fewest frames a segment
#: Victims come back within 2 s: the supervisor's crash-loop backoff (up to 30 s) is for crashes, and
#: would leave half the fleet down under a kill every 2 s.
RESTART_WITHIN_S = 2.0
#: A kill every 3 s: each worker dies about every 20 s (an AR worker spends several of them loading).
KILL_EVERY_S = 3.0


def _chaos_fleet(settings, log_dir):
    """2 AR workers, 2 decoders, 2 assemblers and an RQ worker, and the audio of the job narrated
    once undisturbed (the reference every chaos run must reproduce bit for bit)."""
    fleet = start_fleet(
        settings, log_dir, ar_workers=2, decoders=2, assemblers=2, finalizers=1, max_backoff_s=RESTART_WITHIN_S
    )
    try:
        with fleet.client() as client:
            calm = submit(client, text=TEXT)["id"]
            assert wait_done(client, calm, timeout=600)["status"] == "done", fleet.logs()
            reference = download(client, calm)[0]
        yield fleet, reference, [calm]
    finally:
        fleet.stop()


@pytest.fixture(scope="module")
def chaos_fleet(data_dir, tiny_dir, tmp_path_factory):
    """The chaos fleet on a private Valkey (restartable: the Redis-restart runs)."""
    valkey = PrivateValkey(tmp_path_factory.mktemp("chaos-valkey")).start()
    try:
        settings = chaos_settings(valkey.url, data_dir, "chaos")
        for fleet, reference, jobs in _chaos_fleet(settings, tmp_path_factory.mktemp("chaos-logs")):
            yield fleet, valkey, reference, jobs
    finally:
        valkey.stop()


@pytest.fixture(scope="module")
def cluster_chaos_fleet(valkey_cluster, redis_url, data_dir, tiny_dir, tmp_path_factory):
    """The chaos fleet on a Valkey Cluster (3 primaries + 3 replicas), three task shards; RQ on the
    machine's Redis. No Redis restart here (failover is another test's)."""
    prefix = f"chaos-cluster-{int(time.time() * 1000) % 10**9}"
    settings = chaos_settings(valkey_cluster.url, data_dir, prefix).model_copy(
        update={"rq_redis_url": redis_url, "task_shards": 3}
    )
    try:
        for fleet, reference, jobs in _chaos_fleet(settings, tmp_path_factory.mktemp("chaos-cluster-logs")):
            yield fleet, None, reference, jobs
    finally:
        delete_prefix(valkey_cluster.url, prefix, redis_url)


def check_storm(fleet, valkey, reference, jobs, **storm_args):
    names = Names(fleet.settings.key_prefix)
    with fleet.client() as client:
        stormy = submit(client, text=TEXT)["id"]
        jobs.append(stormy)
        result = storm(
            fleet, client, stormy, min_kills=20, interval=KILL_EVERY_S, valkey=valkey, **storm_args
        )
        print(f"\nchaos: {len(result.kills)} kills {result.kills_by_kind}, {result.wall_s} s: {result.kills}")
        assert result.job["status"] == "done", f"{result.job}\n{fleet.logs()}"
        assert len(result.kills) >= 20 and all(result.kills_by_kind[k] for k in KINDS), result.kills
        assert result.job["segments_done"] == result.job["segments_total"] == SEGMENTS
        assert manifest_segments(fleet.settings, stormy) == list(range(SEGMENTS))  # each once, in order
        np.testing.assert_array_equal(download(client, stormy)[0], reference)  # bit for bit
    settings = fleet.settings
    with contextlib.closing(connect(settings.redis_url)) as r, contextlib.closing(connect(rq_url(settings))) as rq:
        assert_nothing_left(r, names, jobs, rq=rq, shards=settings.task_shards)
        assert r.xlen(names.dead_letters()) == 0
    return result


@pytest.mark.timeout(900)
@pytest.mark.parametrize("where", ["server", "cluster"])
def test_sigkill_every_worker_kind_during_a_job(where, request):
    check_storm(*request.getfixturevalue("chaos_fleet" if where == "server" else "cluster_chaos_fleet"), seed=7)


@pytest.mark.timeout(900)
def test_sigkill_chaos_with_a_redis_restart_in_the_middle(chaos_fleet):
    _, valkey, _, _ = chaos_fleet
    restarts = valkey.restarts
    result = check_storm(*chaos_fleet, seed=11, restarts_at=(0.4,), outage_s=5.0)
    # Valkey went away in the middle of the job (a 5 s outage is mostly absorbed by the clients' own
    # retries; test_redis_restart.py holds it away 15 s, past them, into the workers' backoff loops)
    assert result.redis_restarts == restarts + 1
    assert len(result.restarted_at) == 1 and 0 < result.restarted_at[0] < SEGMENTS, result.restarted_at


def test_a_poison_segment_is_dead_lettered_and_fails_only_its_job(redis_url, data_dir, tiny_dir, tmp_path):
    from testing.fleetkit import delete_prefix

    prefix = f"poison-{int(time.time() * 1000) % 10**9}"
    # a prompt longer than the engine's context can never be generated: every delivery fails
    settings = Settings(
        redis_url=redis_url,
        key_prefix=prefix,
        data_dir=data_dir,
        block_ms=200,
        max_model_len=200,
        reclaim_idle_ms=1500,
        max_deliveries=3,
    )
    names = Names(prefix)
    r = redis.Redis.from_url(redis_url)
    fleet = start_fleet(settings, tmp_path / "logs")
    try:
        with fleet.client() as client:
            poisoned = submit(client, text=POISON)["id"]
            healthy = submit(client, text="A healthy job. It completes.")["id"]
            assert wait_done(client, healthy, timeout=120)["status"] == "done"
            failed = wait_done(client, poisoned, timeout=120)
            assert (
                failed["status"] == "failed"
                and "segment 1" in failed["error"]
                and "max_model_len" in failed["error"]
            )
            events = [e for e in r.xrange(names.events(poisoned))]
            assert events[-1][1][b"type"] == b"failed"
        letters = r.xrange(names.dead_letters())
        assert len(letters) == 1 and poisoned.encode() in letters[0][1][b"h"]
        assert r.xlen(names.tasks("tiny")) == 0 and r.xpending(names.tasks("tiny"), AR_GROUP)["pending"] == 0
    finally:
        fleet.stop()
        r.close()
        delete_prefix(redis_url, prefix)


@pytest.mark.timeout(1200)
def test_sigkill_chaos_with_three_tenants_jobs_at_once(chaos_fleet):
    """Three tenants' jobs admitted side by side (jobs/scheduler.py) under the same storm: each
    completes with every segment once, in order, and the audio of the undisturbed run."""
    import asyncio

    from fleet.redis import async_client
    from jobs.service import JobRequest
    from jobs.service import submit as submit_job
    from jobs.store import JobStore

    fleet, valkey, reference, jobs = chaos_fleet

    async def three() -> list[str]:
        client = async_client(fleet.settings)
        store = JobStore.for_settings(client, fleet.settings)
        made = [
            (await submit_job(store, fleet.settings, JobRequest(text=TEXT, tenant=t, priority="batch"))).id
            for t in ("alice", "bob", "carol")
        ]
        await client.aclose()
        return made

    ids = asyncio.run(three())
    jobs.extend(ids)
    with fleet.client() as client:
        result = storm(fleet, client, ids[-1], min_kills=20, interval=KILL_EVERY_S, seed=13, valkey=valkey)
        print(f"\nchaos, 3 tenants: {len(result.kills)} kills {result.kills_by_kind}, {result.wall_s} s")
        for job_id, tenant in zip(ids, ("alice", "bob", "carol"), strict=True):
            job = wait_done(client, job_id, timeout=600)
            assert job["status"] == "done" and job["tenant"] == tenant, f"{job}\n{fleet.logs()}"
            assert manifest_segments(fleet.settings, job_id, tenant) == list(range(SEGMENTS))
            np.testing.assert_array_equal(download(client, job_id)[0], reference)
    names = Names(fleet.settings.key_prefix)
    with redis.Redis.from_url(valkey.url) as r:
        assert_nothing_left(r, names, jobs)
        assert r.xlen(names.dead_letters()) == 0
