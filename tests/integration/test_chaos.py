"""Fault injection: SIGKILL random workers of every kind while a job runs; nothing is lost or doubled.
A longer version (more segments, more kills, a Redis restart) is bench/chaos.py."""

from __future__ import annotations

import random
import signal
import threading
import time

import numpy as np
import pytest
import redis

from fleet.names import AR_GROUP, ASSEMBLER_GROUP, DECODER_GROUP, Names
from fleet.settings import Settings
from tests.integration.fleetkit import download, start_fleet, submit, wait_done

pytestmark = pytest.mark.integration

TEXT = "\n\n".join(
    " ".join(f"Paragraph {p}, sentence {s} is short." for s in range(10)) for p in range(32)
)  # 320 segments


class Chaos:
    """Kills a random worker (SIGKILL) every ``interval`` seconds, visiting every kind in turn."""

    def __init__(self, supervisor, interval: float, rng: random.Random) -> None:
        self.supervisor, self.interval, self.rng = supervisor, interval, rng
        self.kills: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        kinds = ["ar-", "decoder-", "assembler-", "finalizer-"]
        while not self._stop.wait(self.interval):
            prefix = kinds[len(self.kills) % len(kinds)]
            alive = [
                c
                for c in self.supervisor.children
                if c.name.startswith(prefix) and c.process and c.process.poll() is None
            ]
            if alive:
                victim = self.rng.choice(alive)
                victim.process.send_signal(signal.SIGKILL)
                self.kills.append(victim.name)

    def __enter__(self) -> Chaos:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)


def assert_nothing_left(r: redis.Redis, names: Names, job_ids: list[str]) -> None:
    for stream, group in (
        (names.tasks("tiny"), AR_GROUP),
        (names.codes("tiny"), DECODER_GROUP),
        (names.audio(), ASSEMBLER_GROUP),
    ):
        assert r.xlen(stream) == 0, stream
        assert r.xpending(stream, group)["pending"] == 0, stream
    for job_id in job_ids:
        assert r.keys(f"{names.job(job_id)}:deltas:*") == []
        assert not r.exists(names.scratch_keys(job_id))


def test_sigkill_every_worker_kind_during_a_job(redis_url, data_dir, tiny_dir, tmp_path):
    from tests.conftest import delete_prefix

    prefix = f"chaos-{int(time.time() * 1000) % 10**9}"
    settings = Settings(
        redis_url=redis_url,
        key_prefix=prefix,
        data_dir=data_dir,
        block_ms=200,
        max_num_seqs=16,
        reclaim_idle_ms=3000,
        finalize_timeout_s=20,
    )
    names = Names(prefix)
    r = redis.Redis.from_url(redis_url)
    fleet = start_fleet(settings, tmp_path / "logs", ar_workers=2, decoders=2, assemblers=2, finalizers=1)
    try:
        with fleet.client() as client:
            calm = submit(client, text=TEXT)["id"]
            assert wait_done(client, calm, timeout=600)["status"] == "done"
            reference = download(client, calm)[0]

            stormy = submit(client, text=TEXT)["id"]
            with Chaos(fleet.supervisor, interval=2.0, rng=random.Random(7)) as chaos:
                deadline = time.monotonic() + 600
                while time.monotonic() < deadline:
                    fleet.supervisor.poll()  # restart what was killed
                    job = client.get(f"/v1/jobs/{stormy}").json()
                    if job["status"] in ("done", "failed") and len(chaos.kills) >= 20:
                        break
                    time.sleep(0.2)
            while any(c.process.poll() is not None for c in fleet.supervisor.children):
                fleet.supervisor.poll()  # let the last victims come back before the checks
                time.sleep(0.2)
            status = wait_done(client, stormy, timeout=300)
            assert status["status"] == "done", f"{status}\n{fleet.logs()}"
            assert len(chaos.kills) >= 20 and {k.split("-")[0] for k in chaos.kills} == {
                "ar",
                "decoder",
                "assembler",
                "finalizer",
            }
            assert status["segments_done"] == status["segments_total"] == 320
            np.testing.assert_array_equal(
                download(client, stormy)[0], reference
            )  # every segment once, in order
        assert_nothing_left(r, names, [calm, stormy])
        assert r.xlen(names.dead_letters()) == 0
    finally:
        fleet.stop()
        r.close()
        delete_prefix(redis_url, prefix)


def test_a_poison_segment_is_dead_lettered_and_fails_only_its_job(redis_url, data_dir, tiny_dir, tmp_path):
    from tests.conftest import delete_prefix

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
            poisoned = submit(client, text="Fine. Long" + " word" * 50 + " end. Fine again.")["id"]
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
