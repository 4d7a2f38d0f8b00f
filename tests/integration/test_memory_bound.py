"""Back-pressure bounds Redis memory: a long job with every decoder stopped (SIGSTOP) leaves the AR stage
standing still once the code-chunk backlog is reached, Redis memory (a private Valkey: its INFO is this
test's alone) stays under a bound derived from what the fleet writes (tests/integration/fleetkit.py,
MemoryBound), and after SIGCONT the job completes with every segment exactly once.

CI runs the issue's 5,000 segments (five to seven minutes on a 2-core machine); bench/chaos.py runs the
same driver at any size (docs/reliability.md has the figures)."""

from __future__ import annotations

import pytest
import redis

from fleet.names import Names
from testing.fleetkit import (
    PrivateValkey,
    assert_nothing_left,
    manifest_segments,
    memory_settings,
    paused_decoders_run,
    short_sentences,
    start_fleet,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1500)]

SEGMENTS = 5000
AR_WORKERS = 2


def test_paused_decoders_keep_redis_memory_bounded_and_the_job_completes(data_dir, tiny_dir, tmp_path):
    valkey = PrivateValkey(tmp_path).start()
    settings = memory_settings(valkey.url, data_dir, SEGMENTS)
    fleet = start_fleet(settings, tmp_path / "logs", ar_workers=AR_WORKERS, decoders=2, assemblers=1)
    try:
        run = paused_decoders_run(fleet, valkey, short_sentences(SEGMENTS), ar_workers=AR_WORKERS)
        print(f"\npaused decoders: {run.report()}")
        bound = run.bound
        # the AR stage stopped pulling: most tasks were never read, and nothing moved while watched
        # (a segment writes at least `fewest` chunks: once the backlog is passed no AR worker reads more)
        # (and each worker holds at most its engine's slots: max_num_seqs + interactive_slots)
        fewest = bound.fewest_chunks_per_segment
        most_started = settings.max_stream_backlog // fewest + 1 + AR_WORKERS * bound.slots_per_worker
        assert settings.max_stream_backlog < run.codes_paused <= bound.chunk_entries
        assert 0 < run.started_paused <= most_started
        assert run.tasks_left == SEGMENTS - run.started_paused
        assert not run.moved_while_held
        # so Redis memory stayed under the bound (which the code chunks of every segment would exceed)
        assert run.paused_samples > 20 and bound.baseline < run.peak_paused < bound.bound, run.report()
        assert bound.baseline + bound.task_bytes + bound.plan_bytes + bound.unbounded_codes > bound.bound
        # resumed, the job completes: every segment exactly once, in order; nothing left behind
        assert run.job["status"] == "done", fleet.logs()
        assert run.job["segments_done"] == run.job["segments_total"] == SEGMENTS
        assert manifest_segments(settings, run.job["id"]) == list(range(SEGMENTS))
        with redis.Redis.from_url(valkey.url) as r:
            names = Names(settings.key_prefix)
            assert r.hlen(names.done_segments(run.job["id"])) == SEGMENTS
            assert_nothing_left(r, names, [run.job["id"]])
    finally:
        fleet.stop()
        valkey.stop()
