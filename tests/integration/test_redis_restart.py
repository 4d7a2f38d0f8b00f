"""A Redis (Valkey) restart in the middle of a job: workers wait it out, the job completes unchanged."""

from __future__ import annotations

import time

import numpy as np
import pytest

from fleet.settings import Settings
from testing.fleetkit import BOOK, PrivateValkey, download, start_fleet, submit, wait_done

pytestmark = pytest.mark.integration

OUTAGE_S = 15


def test_job_survives_a_redis_restart(data_dir, tiny_dir, tmp_path):
    valkey = PrivateValkey(tmp_path).start()  # the embedded Valkey: append-only
    settings = Settings(redis_url=valkey.url, key_prefix="restart", data_dir=data_dir, block_ms=200)
    fleet = start_fleet(settings, tmp_path / "logs")
    try:
        with fleet.client() as client:
            job_id = submit(client, text=BOOK)["id"]
            while client.get(f"/v1/jobs/{job_id}").json()["segments_done"] < 5:
                time.sleep(0.1)
            valkey.restart(OUTAGE_S)  # SIGTERM (Valkey flushes its append-only file), away, start again
            status = wait_done(client, job_id, timeout=180)
            assert status["status"] == "done", fleet.logs()
            restarted = download(client, job_id)[0]
            again = submit(client, text=BOOK)["id"]
            assert wait_done(client, again, timeout=180)["status"] == "done"
            np.testing.assert_array_equal(restarted, download(client, again)[0])
        crashed = {c.name: c.restarts for c in fleet.supervisor.children if c.restarts}
        stages = {n: k for n, k in crashed.items() if not n.startswith("finalizer")}
        assert not stages, f"workers died during the outage: {crashed}\n{fleet.logs()}"
        assert "Redis is back" in fleet.logs(tail=None)
    finally:
        fleet.stop()
        valkey.stop()
