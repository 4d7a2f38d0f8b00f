"""Prometheus metrics of a real fleet on a real Redis (docs/metrics.md): the API's /metrics (the fleet's
state read from Redis) and every worker's own endpoint, scraped over HTTP while a job runs and parsed
with prometheus-client's text parser; the values move as the job goes, and end where the job ends.

eSpeak NG's fleet (speech worker, assembler, finalizer) when it is installed: a book of a few hundred
short segments runs for seconds on two cores; else the tiny model's (AR worker and decoder instead)."""

from __future__ import annotations

import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fleet.settings import Settings
from models.espeak import unavailable_reason
from testing.fleetkit import BOOK, delete_prefix, free_ports, start_fleet, submit, wait_done

pytestmark = pytest.mark.integration

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(url: str) -> Samples:
    response = httpx.get(url, timeout=10)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(response.text)
        for s in family.samples
    }


def get(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def poll(what: str, timeout: float, probe):
    """``probe()`` until it returns something true (polling, with a deadline); that value."""
    deadline = time.monotonic() + timeout
    while True:
        if found := probe():
            return found
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def fleet(redis_url, data_dir, tmp_path_factory):
    espeak = unavailable_reason() is None
    model = "espeak" if espeak else "tiny"
    if not espeak:
        from models.tiny import ensure_tiny_checkpoint

        ensure_tiny_checkpoint(data_dir)
    kinds = ["speech", "assembler", "finalize"] if espeak else ["ar", "decoder", "assembler", "finalize"]
    prefix = f"metrics-{int(time.time() * 1000) % 10**9}"
    settings = Settings(
        redis_url=redis_url,
        key_prefix=prefix,
        data_dir=data_dir,
        models=model,
        default_model=model,
        block_ms=200,
        heartbeat_s=1,
        max_text_chars=100_000,
        metrics_port=free_ports(len(kinds)),
    )
    running = start_fleet(settings, tmp_path_factory.mktemp("metrics-logs"), speech_workers=1)
    # fleet_children's order: each worker child its port, from metrics_port on
    ports = {c.name: int(c.env["NARRATE_METRICS_PORT"]) for c in running.supervisor.children if c.env}
    running.model = model
    running.endpoints = {
        kind: f"http://127.0.0.1:{port}/metrics" for kind, port in zip(kinds, ports.values(), strict=True)
    }
    yield running
    running.stop()
    delete_prefix(redis_url, prefix)


def test_metrics_move_while_a_job_runs(fleet, client):
    model, ep = fleet.model, fleet.endpoints
    api = f"{fleet.base_url}/metrics"
    producer = "speech" if model == "espeak" else "decoder"
    engine = "speech" if model == "espeak" else "ar"

    # every worker answers (its own endpoint, up before or with its engine), and readiness shows them
    for kind, url in ep.items():
        poll(f"{kind}'s endpoint", 60, lambda url=url: _answers(url))
    poll("live workers", 60, lambda: get(scrape(api), "narrate_workers_live", stage=engine, model=model) == 1)
    idle = scrape(api)
    assert get(idle, "narrate_redis_up") == 1 and get(idle, "narrate_jobs", state="running") == 0
    done_before = get(idle, "narrate_jobs_ended_total", state="done")

    # eSpeak NG: 153 segments in a few seconds; the tiny model on the CPU: a chapter (17) in tens
    text = "\n\n".join([BOOK] * 3) if model == "espeak" else BOOK.split("# Chapter Two")[0]
    job = submit(client, text=text, title="Metrics")
    total = job["segments_total"]
    step = 5 if model == "espeak" else 2  # segments between the two scrapes

    # 1) the job is running and segments are being recorded: first scrape of each endpoint
    def running_with_segments():
        fleet_now, assembled = scrape(api), scrape(ep["assembler"])
        if (
            get(fleet_now, "narrate_jobs", state="running") == 1
            and 0 < get(assembled, "narrate_segments_total", model=model) < total - 2 * step
        ):
            return fleet_now, assembled, scrape(ep[producer])
        return None

    fleet_a, assembler_a, producer_a = poll("the job running", 60, running_with_segments)
    assert get(fleet_a, "narrate_jobs", state="queued") == 0
    # work in flight shows in the streams or the admission queue
    in_flight = sum(
        v for (name, _), v in fleet_a.items() if name in ("narrate_stream_length", "narrate_tasks_queued")
    )
    assert in_flight > 0
    engines = scrape(ep[engine])
    assert get(engines, "narrate_engine_slots", stage=engine, model=model) >= 1
    assert get(engines, "narrate_engine_slots_in_use", stage=engine, model=model) <= get(
        engines, "narrate_engine_slots", stage=engine, model=model
    )

    # 2) a later scrape during the same job: the counters moved
    def moved():
        assembled = scrape(ep["assembler"])
        if (
            get(assembled, "narrate_segments_total", model=model)
            >= get(assembler_a, "narrate_segments_total", model=model) + step
        ):
            return assembled
        return None

    assembler_b = poll("more segments assembled", 60, moved)
    producer_b = scrape(ep[producer])
    for name, labels in [
        ("narrate_audio_seconds_total", {"model": model}),
        ("narrate_stage_work_seconds_count", {"stage": "assembler"}),
        ("narrate_stage_wait_seconds_count", {"stage": "assembler"}),
    ]:
        assert get(assembler_b, name, **labels) > get(assembler_a, name, **labels), name
    produced = ("narrate_audio_produced_seconds_total", {"stage": producer, "model": model})
    assert get(producer_b, *produced[:1], **produced[1]) > get(producer_a, *produced[:1], **produced[1])
    assert get(producer_b, "narrate_stage_work_seconds_count", stage=producer) > get(
        producer_a, "narrate_stage_work_seconds_count", stage=producer
    )
    # the job's first audio was timed once, from its submission
    first = get(assembler_b, "narrate_time_to_first_audio_seconds_count", model=model)
    first_s = get(assembler_b, "narrate_time_to_first_audio_seconds_sum", model=model)
    assert first == 1 and 0 < first_s < 30
    assert get(assembler_b, "narrate_time_to_first_audio_seconds_bucket", model=model, le="60.0") == 1

    # 3) the job ends: the fleet's gauges and counters say so, the finalize worker measured it
    assert wait_done(client, job["id"], timeout=120)["status"] == "done"
    fleet_end, assembler_end = scrape(api), scrape(ep["assembler"])
    assert get(fleet_end, "narrate_jobs", state="running") == 0
    assert get(fleet_end, "narrate_jobs_ended_total", state="done") == done_before + 1
    assert get(assembler_end, "narrate_segments_total", model=model) == total
    assert get(fleet_end, "narrate_stream_length", stream="audio", model="") == 0
    finalizer = scrape(ep["finalize"])
    assert get(finalizer, "narrate_finalizes_total", outcome="done") == 1
    assert get(finalizer, "narrate_stage_work_seconds_count", stage="finalize") == 1
    assert get(finalizer, "narrate_retries_total", stage="finalize") == 0
    assert get(finalizer, "process_resident_memory_bytes") > 0  # each worker's process metrics


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
