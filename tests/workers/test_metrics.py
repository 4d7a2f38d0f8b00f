"""A worker process's metrics (workers/metrics.py): what each stage counts and times, its own /metrics
endpoint, and the ports ``narrate fleet`` hands its workers. Stages run their real loops on the
in-memory transport or fakeredis (the production Lua scripts); values are read from the registry
before and after, since the metrics are the process's."""

from __future__ import annotations

import asyncio
import re
import time
import urllib.request
from dataclasses import replace

import fakeredis
import numpy as np
import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from fleet.messages import AudioChunk, SegmentTask
from fleet.names import Names
from fleet.settings import Settings
from fleet.storage import LocalStorage
from jobs.service import JobRequest, tasks_for, validate
from jobs.store import JobStore
from narrate.supervisor import fleet_children, free_port
from workers import metrics
from workers.ar import ARWorker
from workers.assembler import Assembler
from workers.runtime import WorkerContext
from workers.stage import Stage, Work
from workers.transport import MemoryBroker


def value(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


@pytest.fixture
def ctx(tmp_path):
    settings = Settings(
        redis_url="redis://unused", key_prefix="t", data_dir=tmp_path, block_ms=10, max_deliveries=2,
        retry_backoff_ms=10,
    )  # fmt: skip
    redis = fakeredis.FakeAsyncRedis()
    names = Names("t")
    store = JobStore(redis, names, events_maxlen=1000, result_ttl_s=60)
    return WorkerContext(settings, redis, names, store, LocalStorage(tmp_path / "storage"), asyncio.Event())


async def new_job(ctx, text="One. Two.", age_s: float = 0.0, start: bool = True):
    job, plan = validate(JobRequest(text=text), ctx.settings)
    job = replace(job, created_at=time.time() - age_s)
    await ctx.store.create(job, plan, tasks_for(job, plan))
    if start:
        assert await ctx.store.start_segment(job.id, 0) > 0
    return job, plan


async def until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


class Flaky(Stage[SegmentTask]):
    """Segment 1 always fails (retried, then dead-lettered); the others succeed after ``work_s``."""

    kind = "flaky"
    group = "flaky"
    message = SegmentTask
    activity = "testing"
    batch_size = 4

    def __init__(self, ctx, transport, work_s: float) -> None:
        super().__init__(ctx, [ctx.names.tasks("tiny")], transport=transport)
        self.work_s = work_s

    async def handle(self, work: Work[SegmentTask]) -> None:
        if work.message.segment == 1:
            raise OSError("storage hiccup")
        await asyncio.sleep(self.work_s)


def test_a_stage_times_its_work_and_counts_retries_and_dead_letters(ctx):
    work = "narrate_stage_work_seconds"
    before = {
        "count": value(f"{work}_count", stage="flaky"),
        "sum": value(f"{work}_sum", stage="flaky"),
        "fast": value(f"{work}_bucket", stage="flaky", le="0.01"),
        "retries": value("narrate_retries_total", stage="flaky"),
        "dead": value("narrate_dead_letters_total", stage="flaky"),
    }

    async def main():
        broker = MemoryBroker()
        job, plan = await new_job(ctx, "One. Two. Three.", start=False)
        for task in tasks_for(job, plan):
            broker.put(ctx.names.tasks("tiny"), task.encode())
        stage = Flaky(ctx, broker.transport([ctx.names.tasks("tiny")]), work_s=0.03)
        running = asyncio.create_task(stage.run())
        try:
            await until(lambda: broker.pending() == 0)
        finally:
            ctx.stop.set()
            await asyncio.gather(running, return_exceptions=True)
        return broker

    broker = asyncio.run(main())
    assert len(broker.dead) == 1  # segment 1, after max_deliveries (2)
    assert value(f"{work}_count", stage="flaky") - before["count"] == 2  # segments 0 and 2 succeeded
    assert value(f"{work}_sum", stage="flaky") - before["sum"] >= 0.06  # 2 x 30 ms at least
    assert value(f"{work}_bucket", stage="flaky", le="0.01") == before["fast"]  # none under 10 ms
    assert value("narrate_retries_total", stage="flaky") - before["retries"] == 1  # delivery 1 of 2
    assert value("narrate_dead_letters_total", stage="flaky") - before["dead"] == 1


def test_the_wait_in_a_stream_comes_from_the_entry_id():
    before = value("narrate_stage_wait_seconds_count", stage="waiting")
    below = value("narrate_stage_wait_seconds_bucket", stage="waiting", le="0.25")
    below_half = value("narrate_stage_wait_seconds_bucket", stage="waiting", le="0.5")
    now = time.time()
    metrics.observe_wait("waiting", f"{int((now - 0.3) * 1000)}-0".encode(), now)  # 0.3 s ago
    metrics.observe_wait("waiting", b"1-0", now)  # an in-memory id: not a time
    metrics.observe_wait("waiting", b"junk", now)
    assert value("narrate_stage_wait_seconds_count", stage="waiting") - before == 1
    assert value("narrate_stage_wait_seconds_bucket", stage="waiting", le="0.25") == below
    assert value("narrate_stage_wait_seconds_bucket", stage="waiting", le="0.5") - below_half == 1


def pcm(n: int) -> bytes:
    return (np.arange(n) % 200 * 100).astype("<i2").tobytes()  # loud enough not to be a silent runaway


def test_the_assembler_counts_segments_audio_and_the_first_audio_once_per_job(ctx):
    before = {
        "segments": value("narrate_segments_total", model="tiny"),
        "audio": value("narrate_audio_seconds_total", model="tiny"),
        "first": value("narrate_time_to_first_audio_seconds_count", model="tiny"),
        "first_sum": value("narrate_time_to_first_audio_seconds_sum", model="tiny"),
        "first_fast": value("narrate_time_to_first_audio_seconds_bucket", model="tiny", le="1.0"),
        "work": value("narrate_stage_work_seconds_count", stage="assembler"),
    }

    async def main():
        job, _ = await new_job(ctx, "One. Two.", age_s=2.0)  # submitted 2 s ago
        assembler = Assembler(ctx, enqueue=lambda _settings, _job_id: None)
        chunks = [
            AudioChunk(job.id, 0, 1, 0, False, 24000, pcm(2400)),
            AudioChunk(job.id, 0, 1, 0, False, 24000, pcm(2400)),  # redelivered: not timed again
            AudioChunk(job.id, 0, 1, 1, True, 24000, pcm(4800)),
            AudioChunk(job.id, 1, 1, 0, True, 24000, pcm(12000)),
        ]
        for chunk in chunks:
            await ctx.redis.xadd(ctx.names.audio(), chunk.encode())
        await assembler.transport.setup()
        while await ctx.redis.xlen(ctx.names.audio()):
            await assembler.step()
        return await ctx.store.get(job.id)

    job = asyncio.run(main())
    assert job.segments_done == 2
    assert value("narrate_segments_total", model="tiny") - before["segments"] == 2
    assert value("narrate_audio_seconds_total", model="tiny") - before["audio"] == pytest.approx(0.8)
    assert value("narrate_time_to_first_audio_seconds_count", model="tiny") - before["first"] == 1
    first = value("narrate_time_to_first_audio_seconds_sum", model="tiny") - before["first_sum"]
    assert 2.0 <= first < 10.0
    assert value("narrate_time_to_first_audio_seconds_bucket", model="tiny", le="1.0") == before["first_fast"]
    assert value("narrate_stage_work_seconds_count", stage="assembler") - before["work"] == 4


class HeldSynthesizer:
    """Stands in for the engine: a segment runs until the test lets it go."""

    def __init__(self) -> None:
        self.started: list[int] = []
        self.release = asyncio.Event()

    async def windows(self, task, request_id):
        self.started.append(task.segment)
        await self.release.wait()
        return
        yield  # an async generator that yields no windows


def test_an_ar_worker_reports_its_engine_slots_in_use(ctx):
    def slots(name: str) -> float | None:
        return REGISTRY.get_sample_value(name, {"stage": "ar", "model": "tiny"})

    seen: dict[str, float | None] = {}

    async def main():
        broker = MemoryBroker()
        job, plan = await new_job(ctx, "One. Two. Three.", start=False)
        for task in tasks_for(job, plan):
            broker.put(ctx.names.tasks("tiny"), task.encode())
        synth = HeldSynthesizer()
        worker = ARWorker(
            ctx, "tiny", synth, max_in_flight=5, transport=broker.transport([ctx.names.tasks("tiny")]),
            interactive_slots=2,
        )  # fmt: skip
        seen["idle"] = slots("narrate_engine_slots_in_use")
        running = asyncio.create_task(worker.run())
        try:
            await until(lambda: len(synth.started) == 3)
            seen["busy"] = slots("narrate_engine_slots_in_use")
            synth.release.set()
            await until(lambda: broker.pending() == 0)
            await until(lambda: slots("narrate_engine_slots_in_use") == 0)
        finally:
            ctx.stop.set()
            synth.release.set()
            await asyncio.gather(running, return_exceptions=True)

    asyncio.run(main())
    assert seen == {"idle": 0, "busy": 3}
    assert slots("narrate_engine_slots") == 7  # max_in_flight + interactive slots


def test_a_worker_serves_its_metrics_on_its_port(tmp_path):
    port = free_port()
    settings = Settings(redis_url="redis://unused", data_dir=tmp_path, metrics_port=port)
    assert metrics.serve(settings, "test") == port
    metrics.RETRIES.labels("served").inc(3)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    retries = {s.labels["stage"]: s.value for s in families["narrate_retries"].samples}
    assert retries["served"] == 3 and families["narrate_retries"].type == "counter"
    assert families["narrate_stage_work_seconds"].type == "histogram"
    assert "process_cpu_seconds" in families  # the process's own metrics too
    assert not any(s.name.endswith("_created") for f in families.values() for s in f.samples)
    # a port that is taken: logged, and the worker goes on without an endpoint
    assert metrics.serve(settings, "test") is None
    assert metrics.serve(Settings(redis_url="redis://unused", data_dir=tmp_path), "test") is None  # 0: off


def test_narrate_fleet_gives_each_worker_its_own_port():
    children = fleet_children(
        api=True, ar_workers=2, decoders=1, assemblers=1, finalizers=1, models=["tiny", "espeak"],
        speech_workers=2, metrics_port=9500,
    )  # fmt: skip
    ports = {c.name: c.env.get("NARRATE_METRICS_PORT") for c in children}
    assert ports.pop("api") is None  # the API serves /metrics on its own port
    assert sorted(ports) == sorted(["ar-tiny-0", "ar-tiny-1", "decoder-0", "speech-0", "speech-1",
                                    "assembler-0", "finalizer-0"])  # fmt: skip
    assert sorted(int(p) for p in ports.values()) == list(range(9500, 9507))
    off = fleet_children(api=True, ar_workers=1, decoders=1, assemblers=1, finalizers=1, models=["tiny"])
    assert all(not c.env for c in off)


def test_the_supervisor_starts_a_child_with_its_own_environment(tmp_path):
    import sys

    from narrate.supervisor import Child, Supervisor

    out = tmp_path / "env.txt"
    script = f"import os; open({str(out)!r}, 'w').write(os.environ['A'] + os.environ['B'])"
    child = Child("one", [sys.executable, "-c", script], env={"B": "child"})
    sup = Supervisor([child], env={"A": "fleet-", "B": "fleet"})
    sup.start()
    child.process.wait(30)
    sup.stop()
    assert out.read_text() == "fleet-child"


def test_a_finalize_is_measured_by_the_job_state_after_it():
    from workers.finalizer import measured_worker_class

    connection = fakeredis.FakeRedis()
    names = Names("t")
    worker = measured_worker_class(names)([], connection=connection)

    class RQJob:
        id = "rq-id"

        def __init__(self, job_id):
            self.args = (job_id,)

    before = {o: value("narrate_finalizes_total", outcome=o) for o in ("done", "retry", "other")}
    timed = value("narrate_stage_work_seconds_count", stage="finalize")
    retries = value("narrate_retries_total", stage="finalize")
    connection.hset(names.job("a"), "status", "done")
    connection.hset(names.job("b"), "status", "finalizing")  # failed; RQ runs it again
    for job_id in ("a", "b", "gone"):
        worker._measure(RQJob(job_id), 1.5)
    assert {o: value("narrate_finalizes_total", outcome=o) - before[o] for o in before} == {
        "done": 1, "retry": 1, "other": 1
    }  # fmt: skip
    assert value("narrate_stage_work_seconds_count", stage="finalize") - timed == 1  # the done one
    assert value("narrate_retries_total", stage="finalize") - retries == 1


def test_metric_names_follow_prometheus_conventions():
    """narrate_ prefix, snake_case names and labels, counters sampled as _total, times in _seconds."""
    from prometheus_client.metrics import MetricWrapperBase

    ours = [m for m in vars(metrics).values() if isinstance(m, MetricWrapperBase)]
    assert len(ours) == 14  # every one is in docs/metrics.md
    for metric in ours:
        (family,) = metric.describe()
        assert re.fullmatch(r"narrate_[a-z][a-z0-9_]*[a-z]", family.name), family.name
        assert all(re.fullmatch(r"[a-z][a-z_]*", label) for label in metric._labelnames)  # noqa: SLF001
        assert not family.name.endswith("_total")  # the library adds it to a counter's samples
        if family.type == "histogram" and family.name != "narrate_decoder_batch_chunks":
            assert family.name.endswith("_seconds"), family.name
        if family.type == "counter" and "audio" in family.name:
            assert family.name.endswith("_seconds"), family.name
    counter = next(f for f in REGISTRY.collect() if f.name == "narrate_retries")
    assert counter.type == "counter" and all(s.name == "narrate_retries_total" for s in counter.samples)
