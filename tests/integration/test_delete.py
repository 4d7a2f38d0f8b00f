"""DELETE releases everything a job holds, in Redis and in storage (local directory and S3), whether the
job is done, failed, or still running (then it is cancelled and the workers let go of it)."""

from __future__ import annotations

import time

import boto3
import pytest
import redis

from fleet.names import Names
from fleet.settings import Settings
from testing.fleetkit import POISON, stage_streams, start_fleet, submit, wait_done

pytestmark = pytest.mark.integration

LONG = "\n\n".join(" ".join(f"Part {p}, line {s} here." for s in range(10)) for p in range(8))  # 80 segments


def leftover_keys(r: redis.Redis, job_id: str) -> list[bytes]:
    """Every key in this Redis database that names the job (its own keys, RQ's records of it)."""
    return sorted(r.scan_iter(match=f"*{job_id}*", count=1000))


def storage_objects(settings: Settings, job_id: str) -> list[str]:
    if settings.s3_bucket:
        s3 = boto3.client("s3", endpoint_url=settings.s3_endpoint_url)
        pages = s3.get_paginator("list_objects_v2").paginate(
            Bucket=settings.s3_bucket, Prefix=settings.s3_prefix
        )
        return [o["Key"] for page in pages for o in page.get("Contents", []) if job_id in o["Key"]]
    return [str(p) for p in settings.storage_dir.rglob("*") if job_id in str(p)]


def outputs_settle(settings: Settings, job_id: str, timeout: float = 30) -> list[str]:
    """The names of a finished job's objects once its assembled parts are removed (or at timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        names = sorted(k.rsplit("/", 1)[-1] for k in storage_objects(settings, job_id))
        if not any(name.endswith(".pcm") for name in names) or time.monotonic() > deadline:
            return names
        time.sleep(0.2)


def workers_let_go(r: redis.Redis, names: Names, timeout: float = 60) -> None:
    """Wait until no stage stream holds work (the cancelled job's entries are read and dropped)."""
    streams = stage_streams(names)
    deadline = time.monotonic() + timeout
    while any(r.xlen(s) or r.xpending(s, g)["pending"] for s, g in streams):
        assert time.monotonic() < deadline, "the workers kept the deleted job's work"
        time.sleep(0.2)


def assert_gone(client, r: redis.Redis, settings: Settings, job_id: str) -> None:
    assert client.get(f"/v1/jobs/{job_id}").status_code == 404
    assert client.get(f"/v1/jobs/{job_id}/audio").status_code == 404
    assert client.get(f"/v1/jobs/{job_id}/events").status_code == 404
    assert client.delete(f"/v1/jobs/{job_id}").status_code == 404
    assert leftover_keys(r, job_id) == []
    assert storage_objects(settings, job_id) == []
    assert r.zscore(Names(settings.key_prefix).jobs_index(), job_id) is None


@pytest.mark.parametrize("storage", ["local", pytest.param("s3", marks=pytest.mark.s3)])
def test_delete_releases_every_key_and_object(storage, redis_url, data_dir, tiny_dir, tmp_path, request):
    from testing.fleetkit import delete_prefix

    prefix = f"delete-{storage}-{int(time.time() * 1000) % 10**9}"
    extra = {}
    if storage == "s3":
        extra = dict(
            s3_bucket="narration-test", s3_endpoint_url=request.getfixturevalue("s3_server"), s3_prefix=prefix
        )
    settings = Settings(
        redis_url=redis_url,
        key_prefix=prefix,
        data_dir=data_dir,
        block_ms=200,
        reclaim_idle_ms=1500,
        max_deliveries=2,
        max_model_len=200,
        **extra,
    )
    names = Names(prefix)
    r = redis.Redis.from_url(redis_url)
    fleet = start_fleet(settings, tmp_path / "logs")
    try:
        with fleet.client() as client:
            done = submit(client, text="# A title\n\nA short book. In two sentences.", format="flac")["id"]
            failed = submit(client, text=POISON)["id"]
            assert wait_done(client, done, timeout=120)["status"] == "done", fleet.logs()
            assert wait_done(client, failed, timeout=120)["status"] == "failed", fleet.logs()
            # what a finished job holds before the delete: keys, the file and its manifest
            assert (
                r.exists(names.job(done), names.plan(done), names.events(done), names.done_segments(done))
                == 4
            )
            # the assembled parts go just after "done" (finish first, so a finalizer killed between
            # the two finds its parts again): wait for that, then only the file and its manifest stay
            assert outputs_settle(settings, done) == [f"{done}.flac", f"{done}.json"]
            assert r.exists(names.job(failed), names.attempts(failed)) == 2

            for job_id in (done, failed):
                response = client.delete(f"/v1/jobs/{job_id}")
                assert response.status_code == 200 and response.json()["id"] == job_id
                assert_gone(client, r, settings, job_id)

            # a running job: cancelled at once, released once the workers have let go of it
            running = submit(client, text=LONG)["id"]
            while client.get(f"/v1/jobs/{running}").json()["segments_done"] < 3:
                time.sleep(0.1)
            assert storage_objects(settings, running)  # assembled parts were stored
            response = client.delete(f"/v1/jobs/{running}")
            assert response.status_code == 202 and response.json()["status"] == "cancelled"
            workers_let_go(r, names)
            time.sleep(1.0)  # and nothing is written afterwards by a straggler
            assert_gone(client, r, settings, running)

            # the fleet is unharmed: a new job completes
            assert (
                wait_done(client, submit(client, text="After. The deletes.")["id"], timeout=120)["status"]
                == "done"
            )
    finally:
        fleet.stop()
        r.close()
        delete_prefix(redis_url, prefix)
