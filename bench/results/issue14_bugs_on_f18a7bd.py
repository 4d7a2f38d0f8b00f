"""Issue 14's bugs, checked against the code of f18a7bd with only its own APIs: every test here FAILS there
(run: git worktree add /tmp/oldmain f18a7bd; cp bench/results/issue14_bugs_on_f18a7bd.py /tmp/oldmain/tests/;
cd /tmp/oldmain; PYTHONPATH=$PWD python -m pytest tests/issue14_bugs_on_f18a7bd.py). The same checks pass on main in
tests/workers/test_failures.py and tests/integration/test_failures.py."""

from __future__ import annotations

import asyncio
import time

import numpy as np
from tests.integration.fleetkit import POISON, start_fleet, wait_done
from tests.integration.fleetkit import submit as submit_http

from fleet.messages import AudioChunk, CodeChunk
from fleet.settings import Settings
from fleet.storage import LocalStorage
from jobs.model import JobStatus
from jobs.service import JobRequest, submit
from models.engines.base import EngineError
from models.registry import get_model, load_codec, load_tokenizer
from workers.ar import ARWorker, SegmentSynthesizer, StreamingConfig
from workers.assembler import Assembler
from workers.decoder import DecoderWorker
from workers.runtime import WorkerContext


def fast(make_settings, key_prefix):
    return make_settings(key_prefix, reclaim_idle_ms=400, max_deliveries=3, block_ms=50)


async def run_for(stage, ctx, seconds, done):
    running = asyncio.create_task(stage.run())
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not await done():
        await asyncio.sleep(0.05)
    ctx.stop.set()
    await asyncio.gather(running, return_exceptions=True)


def test_decoder_poison_fails_its_job(make_settings, key_prefix):
    settings = fast(make_settings, key_prefix)

    async def main():
        ctx = WorkerContext.create(settings)
        job = await submit(ctx.store, settings, JobRequest(text="One here. Two there."))
        await ctx.store.start_segment(job.id, 0)
        chunk = CodeChunk(job.id, 1, 1, 0, "tiny", 0, 0, True, np.full((4, 7), 99_999, np.int32))
        await ctx.redis.xadd(ctx.names.codes("tiny"), chunk.encode())
        worker = DecoderWorker(ctx, {"tiny": load_codec(get_model("tiny", settings), settings)})

        async def failed():
            return await ctx.store.status(job.id) == JobStatus.FAILED

        await run_for(worker, ctx, 20, failed)
        status = await ctx.store.status(job.id)
        letters = await ctx.redis.xlen(ctx.names.dead_letters())
        await ctx.close()
        return status, letters

    status, letters = asyncio.run(main())
    assert letters == 1  # it was dead-lettered...
    assert status == JobStatus.FAILED, status  # ...but its job was never failed


class FailingStorage(LocalStorage):
    def put_bytes(self, key, data):
        raise OSError(28, "No space left on device")


def test_assembler_poison_fails_its_job(make_settings, key_prefix, tmp_path):
    settings = fast(make_settings, key_prefix)

    async def main():
        ctx = WorkerContext.create(settings)
        ctx.storage = FailingStorage(tmp_path / "s")
        job = await submit(ctx.store, settings, JobRequest(text="Only one."))
        await ctx.store.start_segment(job.id, 0)
        loud = (np.arange(2000) % 200 * 100).astype("<i2").tobytes()
        await ctx.redis.xadd(ctx.names.audio(), AudioChunk(job.id, 0, 1, 0, True, 24000, loud).encode())
        assembler = Assembler(ctx, enqueue=lambda *_: None)

        async def failed():
            return await ctx.store.status(job.id) == JobStatus.FAILED

        await run_for(assembler, ctx, 20, failed)
        status = await ctx.store.status(job.id)
        letters = await ctx.redis.xlen(ctx.names.dead_letters())
        await ctx.close()
        return status, letters

    status, letters = asyncio.run(main())
    assert letters == 1
    assert status == JobStatus.FAILED, status


class DeadEngine:
    max_num_seqs = 4

    async def generate(self, request_id, prompt, params):
        await asyncio.sleep(0.05)
        raise EngineError("vLLM failed request: EngineCore encountered an issue (engine dead)")
        yield

    async def abort(self, request_id):
        pass


def test_a_dead_engine_stops_its_worker(make_settings, key_prefix):
    settings = make_settings(key_prefix, reclaim_idle_ms=60_000)
    spec = get_model("tiny", settings)
    synth = SegmentSynthesizer(
        spec.family,
        load_tokenizer(spec, settings),
        DeadEngine(),
        StreamingConfig.from_settings(settings, spec.family),
    )

    async def main():
        ctx = WorkerContext.create(settings)
        await submit(ctx.store, settings, JobRequest(text="One. Two. Three."))
        running = asyncio.create_task(ARWorker(ctx, "tiny", synth, 4).run())
        await asyncio.sleep(5)
        still_running = not running.done()
        ctx.stop.set()
        await asyncio.gather(running, return_exceptions=True)
        await ctx.close()
        return still_running

    assert not asyncio.run(main()), "the worker kept running (and heartbeating ready) with a dead engine"


def test_a_permanent_engine_error_fails_its_job_within_seconds(redis_url, data_dir, tiny_dir, tmp_path):
    settings = Settings(
        redis_url=redis_url, key_prefix=f"old-perm-{int(time.time())}", data_dir=data_dir, max_model_len=200
    )
    fleet = start_fleet(settings, tmp_path / "logs")
    try:
        with fleet.client() as client:
            time.sleep(5)
            started = time.monotonic()
            job_id = submit_http(client, text=POISON)["id"]
            try:
                status = wait_done(client, job_id, timeout=20)["status"]
            except Exception:  # noqa: BLE001
                status = client.get(f"/v1/jobs/{job_id}").json()["status"]
            took = time.monotonic() - started
        assert status == "failed" and took < 5, (status, took)
    finally:
        fleet.stop()


def test_a_finalize_that_always_fails_fails_its_job(redis_url, data_dir, tiny_dir, tmp_path):
    own = tmp_path / "data"
    models = tiny_dir.parent
    (own / models.relative_to(data_dir)).parent.mkdir(parents=True, exist_ok=True)
    (own / models.relative_to(data_dir)).symlink_to(models)
    (own / "storage").mkdir(parents=True)
    (own / "storage" / "audio").write_text("not a directory")
    settings = Settings(
        redis_url=redis_url,
        key_prefix=f"old-fin-{int(time.time())}",
        data_dir=own,
        block_ms=200,
        reclaim_idle_ms=5000,
    )
    fleet = start_fleet(settings, tmp_path / "logs")
    try:
        with fleet.client() as client:
            job_id = submit_http(client, text="# A book\n\nIt cannot be stored. Sadly.")["id"]
            deadline = time.monotonic() + 240  # past RQ's 3 retries at 5, 30 and 120 s
            while time.monotonic() < deadline:
                status = client.get(f"/v1/jobs/{job_id}").json()["status"]
                if status in ("done", "failed"):
                    break
                time.sleep(1)
        assert status == "failed", status
    finally:
        fleet.stop()
