"""No job is ever stuck, with real processes on a real Redis: a finalize that always fails (RQ's
retries exhausted) fails its job; a permanent engine error fails its job within seconds under the
default lease; a dead vLLM engine makes its AR worker exit and the supervisor restart it, and the
job completes."""

from __future__ import annotations

import importlib.util
import signal
import time

import pytest
import redis

from fleet.names import Names
from fleet.settings import Settings
from testing.fleetkit import POISON, delete_prefix, read_sse, start_fleet, submit, wait_done, wait_until
from tests.conftest import require
from tests.integration.test_vllm_fleet import vllm_fleet_settings

pytestmark = pytest.mark.integration


def unique(prefix: str) -> str:
    return f"{prefix}-{int(time.time() * 1000) % 10**9}"


def test_a_finalize_that_always_fails_fails_its_job(redis_url, data_dir, tiny_dir, tmp_path):
    # a data directory of its own whose storage cannot hold the finished file (its parts it can)
    own = tmp_path / "data"
    models = tiny_dir.parent
    (own / models.relative_to(data_dir)).parent.mkdir(parents=True, exist_ok=True)
    (own / models.relative_to(data_dir)).symlink_to(models)
    (own / "storage" / "tenants" / "default").mkdir(parents=True)
    (own / "storage" / "tenants" / "default" / "audio").write_text("not a directory")
    settings = Settings(
        redis_url=redis_url,
        key_prefix=unique("finalize"),
        data_dir=own,
        block_ms=200,
        reclaim_idle_ms=5000,
        finalize_retries=1,
        finalize_retry_intervals_s="1",
    )
    names = Names(settings.key_prefix)
    r = redis.Redis.from_url(redis_url)
    fleet = start_fleet(settings, tmp_path / "logs")
    try:
        with fleet.client() as client:
            job_id = submit(client, text="# A book\n\nIt cannot be stored. Sadly.")["id"]
            events = list(read_sse(client, f"/v1/jobs/{job_id}/events", timeout=120))
            status = client.get(f"/v1/jobs/{job_id}").json()
        assert [e.event for e in events][-1] == "failed", fleet.logs()
        assert status["status"] == "failed"
        assert status["error"].startswith("finalizing failed after 2 tries: "), status["error"]
        assert "audio" in status["error"]  # the storage's own words
        assert r.zscore(names.finalizing(), job_id) is None
        assert r.ttl(names.job(job_id)) > 0  # an ended job expires
        log = (tmp_path / "logs" / "finalizer-0.log").read_text()
        assert log.count("finalize_job") >= 2  # RQ ran it twice: the try and its one retry
    finally:
        fleet.stop()
        r.close()
        delete_prefix(redis_url, settings.key_prefix)


def test_a_permanent_engine_error_fails_its_job_within_seconds(redis_url, data_dir, tiny_dir, tmp_path):
    # the default lease and delivery limit: redelivering would take 5 x 60 s before the failure
    settings = Settings(
        redis_url=redis_url, key_prefix=unique("permanent"), data_dir=data_dir, max_model_len=200
    )
    assert settings.reclaim_idle_ms == 60_000 and settings.max_deliveries == 5
    fleet = start_fleet(settings, tmp_path / "logs")
    try:
        with fleet.client() as client:
            wait_until(lambda: client.get("/v1/models").json()[0]["ready"], 60, "a ready fleet")
            started = time.monotonic()
            job_id = submit(client, text=POISON)["id"]
            failed = wait_done(client, job_id, timeout=30)
            took = time.monotonic() - started
        assert failed["status"] == "failed" and took < 5, (took, failed)
        assert failed["error"].startswith("segment 1 failed while narrating: the prompt of ")
        assert "does not fit the engine (max_model_len 200)" in failed["error"]
    finally:
        fleet.stop()
        delete_prefix(redis_url, settings.key_prefix)


@pytest.mark.vllm
def test_a_dead_vllm_engine_core_restarts_its_worker_and_the_job_completes(
    redis_url, data_dir, tiny_dir, tmp_path, monkeypatch
):
    require(importlib.util.find_spec("psutil") is not None, "psutil finds the engine core process")
    import psutil

    settings = vllm_fleet_settings(
        redis_url, data_dir, monkeypatch, "deadengine", max_num_seqs=4, heartbeat_s=1
    )
    names = Names(settings.key_prefix)
    r = redis.Redis.from_url(redis_url)
    text = " ".join(f"Sentence {i} is here." for i in range(40))
    fleet = start_fleet(settings, tmp_path / "logs")
    try:
        with fleet.client() as client:
            ready = lambda: client.get("/v1/models").json()[0]["ready"]  # noqa: E731
            wait_until(ready, 600, "the vLLM AR worker")
            job_id = submit(client, text=text)["id"]
            wait_until(lambda: client.get(f"/v1/jobs/{job_id}").json()["segments_done"] >= 2, 300, "progress")
            ar = next(c for c in fleet.supervisor.children if c.name.startswith("ar-"))
            worker = psutil.Process(ar.process.pid)
            cores = [
                p for p in worker.children(recursive=True) if "EngineCore" in " ".join(p.cmdline()) + p.name()
            ]
            assert cores, [(p.pid, p.name(), p.cmdline()) for p in worker.children(recursive=True)]
            for core in cores:
                core.send_signal(signal.SIGKILL)
            killed = time.monotonic()
            assert ar.process.wait(timeout=60) == 70  # the worker stopped on the fatal error
            exited_in = time.monotonic() - killed
            print(f"the AR worker exited {exited_in:.1f} s after its engine core was killed")
            live = r.zcard(names.live_workers("ar", "tiny"))
            deadline = time.monotonic() + 900
            while client.get(f"/v1/jobs/{job_id}").json()["status"] not in ("done", "failed"):
                assert time.monotonic() < deadline, fleet.logs()
                fleet.supervisor.poll()  # restarts the worker; its new engine takes the tasks back
                time.sleep(0.2)
            done = client.get(f"/v1/jobs/{job_id}").json()
        assert live == 0, "the dead worker still counted as live"
        assert done["status"] == "done" and done["segments_done"] == 40, fleet.logs()
        assert ar.exits[:1] == [70] and ar.restarts >= 1 and exited_in < 30
        log = (tmp_path / "logs" / f"{ar.name}.log").read_text()
        assert "fatal error, stopping" in log and log.count("vLLM engine up") >= 2
        assert r.xlen(names.dead_letters()) == 0  # nothing was the tasks' fault
    finally:
        fleet.stop()
        r.close()
        delete_prefix(redis_url, settings.key_prefix)
