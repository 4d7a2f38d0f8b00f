"""Failover on a real Valkey Cluster: primaries SIGKILLed mid-job after their replicas fell behind (so
the promotion really loses acknowledged writes); the job completes with every segment once, in
order, bit-identical to an undisturbed run (jobs/recovery.py redoes what was lost). And a job's
creation that no replica acknowledges is refused with a 503, nothing kept (``durable_replicas``)."""

from __future__ import annotations

import contextlib
import signal
import time

import numpy as np
import pytest

from fleet.names import Names
from fleet.redis import rq_url
from testing.fleetkit import (
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

SEGMENTS = 300
TEXT = short_sentences(SEGMENTS, per_paragraph=10)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A cluster of this module's own: its primaries are killed."""
    from testing.cluster import ValkeyCluster

    with ValkeyCluster(tmp_path_factory.mktemp("failover-cluster")) as c:
        yield c


@pytest.fixture(scope="module")
def fleet(cluster, redis_url, data_dir, tiny_dir, tmp_path_factory):
    prefix = f"failover-{int(time.time() * 1000) % 10**9}"
    settings = chaos_settings(cluster.url, data_dir, prefix).model_copy(
        update={
            "rq_redis_url": redis_url, "task_shards": 3, "durable_replicas": 1, "durable_timeout_ms": 300,
            "sweep_interval_s": 1.0,  # the recovery starts within a second of a failover
        }
    )  # fmt: skip
    running = start_fleet(settings, tmp_path_factory.mktemp("failover-logs"), ar_workers=2, decoders=2, assemblers=2)
    try:
        yield running
    finally:
        running.stop()
        delete_prefix(cluster.url, prefix, redis_url)


def shares_a_primary(settings, cluster, job_id: str) -> bool:
    """Whether the job's keys and its shard's streams or admission queue are served by one primary (a
    promotion takes over exactly its victim's slots, so this holds through the failovers)."""
    names = Names(settings.key_prefix)
    with contextlib.closing(connect(settings.redis_url)) as r:
        model, shard = (v.decode() for v in r.hmget(names.job(job_id), "model", "shard"))
    keys = [names.tasks(model, int(shard)), names.queues(model, int(shard)), names.audio(int(shard))]
    return cluster.primary_of(names.job(job_id)) in {cluster.primary_of(k) for k in keys}


def test_a_creation_no_replica_acknowledges_is_refused_and_nothing_is_kept(fleet, cluster):
    """(First in the module: the API's slot map is fresh. After failovers it may still name a killed
    primary's address, where a stopped replica now listens and would hang the call, not MOVE it.)"""
    replicas = [cluster.nodes[r].process for r in cluster.replica_of]
    with fleet.client() as client:
        before = {j["id"] for j in client.get("/v1/jobs", params={"limit": 100}).json()["jobs"]}
        for process in replicas:
            process.send_signal(signal.SIGSTOP)  # shorter than the node timeout: no failover
        try:
            refused = client.post("/v1/jobs", json={"text": "Nobody keeps this one."}, timeout=10)
        finally:
            for process in replicas:
                process.send_signal(signal.SIGCONT)
        assert refused.status_code == 503, refused.text
        assert "could not be stored safely" in refused.json()["detail"] and refused.headers["Retry-After"]
        after = {j["id"] for j in client.get("/v1/jobs", params={"limit": 100}).json()["jobs"]}
        assert after == before
        accepted = submit(client, text="This one is kept.")
        assert wait_done(client, accepted["id"], timeout=120)["status"] == "done"


@pytest.mark.timeout(900)
def test_a_job_survives_failovers_that_lose_its_writes(fleet, cluster):
    with fleet.client() as client:
        calm = submit(client, text=TEXT)["id"]
        assert wait_done(client, calm, timeout=600)["status"] == "done", fleet.logs()
        reference = download(client, calm)[0]
        stormy = submit(client, text=TEXT)["id"]
        colocated = shares_a_primary(fleet.settings, cluster, stormy)
        # no worker kills here (test_chaos.py's storm has them): four failovers, two of the job's primary
        result = storm(
            fleet, client, stormy, min_kills=0, interval=3600, seed=3, cluster=cluster,
            failovers_at=(0.1, 0.3, 0.5, 0.7), lose_s=1.5,
        )  # fmt: skip
        summary = [
            (f.killed, f.promoted, f.stalled_s, f.promoted_s, None if f.before is None else len(f.before - f.after))
            for f in result.failovers
        ]  # (killed, promoted, replicas stopped s, promotion s, segment records lost)
        print(f"\nfailovers: {summary}, {result.segments_lost} segment records lost, {result.wall_s} s, {colocated=}")
        assert result.job["status"] == "done", f"{result.job}\n{fleet.logs()}"
        assert len(result.failovers) == 4, summary
        # the promotions took back segment records the job's primary had acknowledged
        assert result.segments_lost > 0, summary
        assert result.job["segments_done"] == result.job["segments_total"] == SEGMENTS
        assert manifest_segments(fleet.settings, stormy) == list(range(SEGMENTS))  # each once, in order
        np.testing.assert_array_equal(download(client, stormy)[0], reference)  # bit for bit
        jobs = [j["id"] for j in client.get("/v1/jobs", params={"limit": 100}).json()["jobs"]]  # this module's
    logs = fleet.logs(tail=None)  # the API's log is mostly polls: a tail may have lost the lines
    assert "recovering what may have been lost" in logs  # each promotion showed a new run id
    if not colocated:
        # its streams and admission queue kept their acks and pops: only the recovery could redo a
        # record the job's primary lost. (Where they share it, the lost acks and pops put the same
        # work back on their own, and the recovery may find nothing missing.)
        assert "queued again after Redis lost writes" in logs
    settings, names = fleet.settings, Names(fleet.settings.key_prefix)
    with contextlib.closing(connect(settings.redis_url)) as r, contextlib.closing(connect(rq_url(settings))) as rq:
        assert_nothing_left(r, names, jobs, rq=rq, shards=settings.task_shards)
        assert r.xlen(names.dead_letters()) == 0
