"""Two hosts, one fleet: two supervisors (`narrate fleet` and `narrate fleet --no-api` on two machines)
against one Redis and one storage (S3), each with its own data directory (engine-start locks, built
checkpoints), are one fleet. The stages share nothing but Redis, so the segments of one job go to the
AR workers and decoders of both hosts, and the job's audio is the audio one host alone makes of it.

Which worker did what: each worker process serves its own counters (docs/metrics.md); the AR workers'
``narrate_ar_frames_total`` and the decoders' ``narrate_audio_produced_seconds_total`` count what each
generated. One job at a time runs on this key prefix, so what moved during a job is that job's."""

from __future__ import annotations

import time

import numpy as np
import pytest
import redis

from fleet.names import Names
from fleet.settings import Settings
from testing.fleetkit import (
    BOOK,
    delete_prefix,
    download,
    free_ports,
    metric,
    metrics_ports,
    start_host,
    submit,
    wait_done,
    wait_until,
)

pytestmark = [pytest.mark.integration, pytest.mark.s3]

#: Worker children of each host (AR worker, decoder, assembler, finalizer): a metrics port each.
WORKERS = 4


def host_settings(redis_url: str, s3: str, prefix: str, data_dir, tiny_dir, metrics_port: int) -> Settings:
    """One host's settings: the shared Redis, key prefix and bucket; its own data directory (holding
    a copy of the tiny checkpoint, as each host has its own copy of a model's files)."""
    models = data_dir / "models"
    models.mkdir(parents=True, exist_ok=True)
    (models / tiny_dir.name).symlink_to(tiny_dir, target_is_directory=True)
    return Settings(
        redis_url=redis_url,
        key_prefix=prefix,
        data_dir=data_dir,
        s3_bucket="narration-test",
        s3_endpoint_url=s3,
        s3_prefix=prefix,
        block_ms=200,
        heartbeat_s=1,
        # 8 segments at a time per engine (none held for interactive jobs): the book's 33 keep both
        # engines busy from its first segments to its last
        max_num_seqs=8,
        interactive_slots=0,
        metrics_port=metrics_port,
    )


def frames(ports: dict[str, int], prefix: str) -> float:
    return sum(metric(p, "narrate_ar_frames_total", model="tiny") for n, p in ports.items() if n.startswith(prefix))


def decoded_s(ports: dict[str, int], prefix: str) -> float:
    return sum(
        metric(p, "narrate_audio_produced_seconds_total", stage="decoder", model="tiny")
        for n, p in ports.items()
        if n.startswith(prefix)
    )


def assembled(ports: dict[str, int]) -> float:
    return sum(metric(p, "narrate_segments_total", model="tiny") for n, p in ports.items() if n.startswith("assembler-"))


def test_two_hosts_on_one_redis_share_one_job(redis_url, tiny_dir, s3_server, tmp_path):
    prefix = f"twohosts-{int(time.time() * 1000) % 10**9}"
    base = free_ports(2 * WORKERS)
    settings_a = host_settings(redis_url, s3_server, prefix, tmp_path / "host-a", tiny_dir, base)
    settings_b = host_settings(redis_url, s3_server, prefix, tmp_path / "host-b", tiny_dir, base + WORKERS)
    # host B places its AR worker and decoder as `narrate fleet --no-api --gpus 1` does (on the CPU the
    # pin changes nothing, but the children, their names and environment are a GPU host's)
    settings_b = settings_b.model_copy(update={"gpus": "1"})
    names = Names(prefix)
    r = redis.Redis.from_url(redis_url)
    host_a = start_host(settings_a, tmp_path / "logs-a")
    host_b = None
    began = time.monotonic()
    try:
        ports_a = metrics_ports(host_a)
        with host_a.client() as client:

            def workers() -> dict:
                return client.get("/v1/models").json()[0]["workers"]

            wait_until(lambda: workers() == {"ar": 1, "decoder": 1}, 120, f"host A's workers\n{host_a.logs()}")
            book = BOOK.split("# Chapter Three")[0]  # two chapters: 33 segments
            request = dict(text=book, title="The Lighthouse", voice="leo", seed=11, format="wav")

            # host A alone: the reference render
            alone = submit(client, **request)
            assert wait_done(client, alone["id"], timeout=300)["status"] == "done", host_a.logs()
            audio_alone, _ = download(client, alone["id"])
            frames_alone = frames(ports_a, "ar-")
            decoded_alone = decoded_s(ports_a, "decoder-")
            assembled_alone = assembled(ports_a)
            segments = alone["segments_total"]
            assert frames_alone > 0 and assembled_alone == segments == 33

            # host B joins with workers only: its own data directory, the same Redis and bucket
            host_b = start_host(settings_b, tmp_path / "logs-b", api=False)
            ports_b = metrics_ports(host_b)
            assert list(ports_b)[:2] == ["ar-tiny-g1-0", "decoder-g1-0"]
            assert all(c.env["CUDA_VISIBLE_DEVICES"] == "1" for c in host_b.supervisor.children[:2])
            wait_until(lambda: workers() == {"ar": 2, "decoder": 2}, 120, f"host B's workers\n{host_b.logs()}")
            both = submit(client, **request)
            status = wait_done(client, both["id"], timeout=300)
            assert status["status"] == "done", host_a.logs() + host_b.logs()
            audio_both, _ = download(client, both["id"])

            # both hosts' engines and decoders took segments of the one job, and no segment ran twice
            from_a = frames(ports_a, "ar-") - frames_alone
            from_b = frames(ports_b, "ar-")
            print(f"AR frames of the job: host A {from_a:.0f}, host B {from_b:.0f} (alone: {frames_alone:.0f})")
            assert from_a > 0 and from_b > 0, (from_a, from_b)
            assert from_a + from_b == frames_alone
            decoded_a = decoded_s(ports_a, "decoder-") - decoded_alone
            decoded_b = decoded_s(ports_b, "decoder-")
            print(f"decoded seconds: host A {decoded_a:.1f}, host B {decoded_b:.1f} (alone: {decoded_alone:.1f})")
            assert decoded_a > 0 and decoded_b > 0, (decoded_a, decoded_b)
            assert assembled(ports_a) - assembled_alone + assembled(ports_b) == segments  # each once

            # the same audio, sample for sample, as host A's alone
            assert audio_both.shape == audio_alone.shape
            np.testing.assert_array_equal(audio_both, audio_alone)
            assert status["duration_s"] == pytest.approx(audio_alone.shape[0] / 24000)

        # each host's engine started under its own data directory's lock; nothing is left in flight
        assert (settings_a.data_dir / "locks").is_dir() and (settings_b.data_dir / "locks").is_dir()
        assert r.xlen(names.tasks("tiny")) == 0 and r.xlen(names.codes("tiny")) == 0
        assert r.xlen(names.audio()) == 0
        print(f"two hosts: {time.monotonic() - began:.1f} s")
    finally:
        if host_b is not None:
            host_b.stop()
        host_a.stop()
        r.close()
        delete_prefix(redis_url, prefix)
