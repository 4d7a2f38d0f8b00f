"""Graceful stop of an AR worker mid-job: its segments are handed back at once and redone elsewhere."""

from __future__ import annotations

import signal
import time

import numpy as np
import pytest
import redis

from fleet.messages import SegmentTask
from fleet.names import AR_GROUP, Names
from fleet.settings import Settings
from narrate.supervisor import Child, Supervisor, child_env, cli_argv
from testing.fleetkit import BOOK, attempts_of, download, start_fleet, submit, wait_done

pytestmark = pytest.mark.integration


def test_sigterm_hands_segments_back_and_the_job_is_unchanged(redis_url, data_dir, tiny_dir, tmp_path):
    from testing.fleetkit import delete_prefix

    prefix = f"handback-{int(time.time() * 1000) % 10**9}"
    # a lease far longer than the test: only the hand-back can make the work move quickly
    settings = Settings(
        redis_url=redis_url,
        key_prefix=prefix,
        data_dir=data_dir,
        block_ms=200,
        reclaim_idle_ms=120_000,
        max_num_seqs=8,
    )
    names = Names(prefix)
    r = redis.Redis.from_url(redis_url)
    fleet = start_fleet(settings, tmp_path / "logs")  # includes one AR worker
    extra = Supervisor(
        [Child("ar-second", cli_argv("ar-worker"))], child_env(settings), log_dir=tmp_path / "logs"
    )
    try:
        with fleet.client() as client:
            job_id = submit(client, text=BOOK)["id"]
            while client.get(f"/v1/jobs/{job_id}").json()["segments_done"] < 3:
                time.sleep(0.1)
            first_ar = next(c for c in fleet.supervisor.children if c.name.startswith("ar-"))
            fleet.supervisor.children.remove(first_ar)  # no restart: it is meant to stay down
            first_ar.process.send_signal(signal.SIGTERM)
            assert first_ar.process.wait(timeout=30) == 0
            pending = r.xpending_range(names.tasks("tiny"), AR_GROUP, min="-", max="+", count=100)
            assert pending and all(p["time_since_delivered"] >= 120_000 for p in pending)  # handed back
            handed = [
                SegmentTask.decode(r.xrange(names.tasks("tiny"), p["message_id"], p["message_id"])[0][1]).segment
                for p in pending
            ]
            started, _ = attempts_of(r, names, job_id)  # by the first
            stopped = time.monotonic()
            extra.start()
            status = wait_done(client, job_id, timeout=120)
            assert status["status"] == "done" and time.monotonic() - stopped < 60  # well inside the lease
            _, won = attempts_of(r, names, job_id)
            redone = [s for s in handed if s in started and won[s] > started[s]]
            assert redone, (handed, started, won)  # a later attempt completed segments handed back
            disturbed, _ = download(client, job_id)
            again = submit(client, text=BOOK)["id"]
            assert wait_done(client, again, timeout=120)["status"] == "done"
            np.testing.assert_array_equal(disturbed, download(client, again)[0])  # nothing lost or doubled
        assert "handed back" in (tmp_path / "logs" / f"{first_ar.name}.log").read_text()
    finally:
        extra.stop()
        fleet.stop()
        r.close()
        delete_prefix(redis_url, prefix)
