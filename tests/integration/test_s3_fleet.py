"""The fleet storing into S3: parts and the finished file go to the bucket, download is a presigned redirect."""

from __future__ import annotations

import io
import time

import boto3
import httpx
import pytest
import soundfile as sf

from fleet.settings import Settings
from testing.fleetkit import start_fleet, submit, wait_done

pytestmark = [pytest.mark.integration, pytest.mark.s3]


def test_fleet_with_s3_storage(redis_url, data_dir, tiny_dir, s3_server, tmp_path):
    from testing.fleetkit import delete_prefix

    prefix = f"s3test-{int(time.time() * 1000) % 10**9}"
    settings = Settings(
        redis_url=redis_url,
        key_prefix=prefix,
        data_dir=data_dir,
        block_ms=200,
        s3_bucket="narration-test",
        s3_endpoint_url=s3_server,
        s3_prefix=prefix,
        presign_ttl_s=300,
    )
    fleet = start_fleet(settings, tmp_path / "logs")
    try:
        with fleet.client() as client:
            job_id = submit(
                client, text="# Title\n\nA short book. In two sentences.", format="flac", sample_rate=16000
            )["id"]
            job = wait_done(client, job_id, timeout=120)
            assert job["status"] == "done", fleet.logs()
            response = client.get(f"/v1/jobs/{job_id}/audio")
            assert response.status_code == 307
            location = response.headers["location"]
            assert location.startswith(s3_server) and "X-Amz-Signature" in location
        audio = httpx.get(location, timeout=30)
        assert audio.status_code == 200
        data, rate = sf.read(io.BytesIO(audio.content), dtype="int16")
        assert rate == 16000 and data.shape[0] / rate == pytest.approx(job["duration_s"], abs=1e-3)
        keys = [
            o["Key"]
            for o in boto3.client("s3", endpoint_url=s3_server).list_objects_v2(
                Bucket="narration-test", Prefix=prefix
            )["Contents"]
        ]
        assert sorted(keys) == [
            f"{prefix}/tenants/default/audio/{job_id}.flac",
            f"{prefix}/tenants/default/audio/{job_id}.json",
        ]  # parts removed
    finally:
        fleet.stop()
        delete_prefix(redis_url, prefix)
