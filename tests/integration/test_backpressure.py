"""Back-pressure: with the decoders gone, AR workers stop taking segments; the backlog stays bounded."""

from __future__ import annotations

import time

import pytest
import redis

from fleet.names import Names
from fleet.settings import Settings
from narrate.supervisor import Child, Supervisor, child_env, cli_argv
from testing.fleetkit import start_fleet, submit, unstarted_tasks, wait_done

pytestmark = pytest.mark.integration


def test_ar_workers_wait_for_slow_decoders(redis_url, data_dir, tiny_dir, tmp_path):
    from testing.fleetkit import delete_prefix

    prefix = f"backpressure-{int(time.time() * 1000) % 10**9}"
    settings = Settings(
        redis_url=redis_url,
        key_prefix=prefix,
        data_dir=data_dir,
        block_ms=200,
        max_num_seqs=4,
        max_stream_backlog=10,
    )
    names = Names(prefix)
    r = redis.Redis.from_url(redis_url)
    fleet = start_fleet(settings, tmp_path / "logs", decoders=0)
    decoder = Supervisor(
        [Child("decoder-late", cli_argv("decoder-worker"))], child_env(settings), log_dir=tmp_path / "logs"
    )
    try:
        with fleet.client() as client:
            job_id = submit(client, text=" ".join(f"Sentence number {i} is here." for i in range(60)))["id"]
            peak = 0
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                peak = max(peak, r.xlen(names.codes("tiny")))
                time.sleep(0.1)
            # at most the backlog limit, plus what the segments already in flight finish producing
            windows_per_segment = 3
            assert 10 < peak <= 10 + 4 * windows_per_segment
            assert r.xlen(names.codes("tiny")) == peak  # nothing moves without decoders
            assert unstarted_tasks(r, names) >= 60 - (10 + 4)  # most segments were never started
            decoder.start()
            assert wait_done(client, job_id, timeout=180)["status"] == "done"
            assert r.xlen(names.codes("tiny")) == 0 and r.xlen(names.audio()) == 0
    finally:
        decoder.stop()
        fleet.stop()
        r.close()
        delete_prefix(redis_url, prefix)
