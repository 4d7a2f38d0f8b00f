"""The finalize job (run by RQ): stitch a finished job's segments, encode, upload, mark it done.

Idempotent: it only acts on a job in ``finalizing``, writes the same keys every time, and the final
state change happens at most once (a second run, or a run after a cancel, changes nothing).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import tempfile
import zipfile
from pathlib import Path

from fleet.names import JobObjects
from fleet.redis import async_client, rq_client
from fleet.settings import Settings
from fleet.storage import Storage, storage_from_settings
from jobs.audio import Pauses, format_named, stitch
from jobs.encoding import Cover, read_cover
from jobs.model import JobStatus
from jobs.segcache import SegmentCache
from jobs.store import JobStore
from models.registry import MODELS

log = logging.getLogger(__name__)


def audio_url(job_id: str) -> str:
    """The API path that serves (or redirects to) a job's file."""
    return f"/v1/jobs/{job_id}/audio"


def finalize_job(job_id: str) -> str:
    """RQ entry point. Settings come from the worker's environment."""
    return asyncio.run(_finalize(Settings(), job_id))


async def _finalize(settings: Settings, job_id: str) -> str:
    redis = async_client(settings)
    try:
        store = JobStore.for_settings(redis, settings)
        return await Finalizer(settings, store, storage_from_settings(settings)).run(job_id)
    finally:
        await redis.aclose()


class Finalizer:
    def __init__(self, settings: Settings, store: JobStore, storage: Storage) -> None:
        self.settings = settings
        self.store = store
        self.storage = storage

    def _put_chapters(self, job, chapter_dir: Path, zip_path: Path) -> None:
        """Each chapter's file, and all of them in one zip (stored: the audio is compressed already)."""
        content_type = format_named(job.format).content_type
        files = sorted(chapter_dir.iterdir())
        with zipfile.ZipFile(zip_path, "w", compression=zipfile.ZIP_STORED) as archive:
            for path in files:
                archive.write(path, arcname=path.name)
        for path in files:
            self.storage.put_file(job.objects.chapter(path.name), path, content_type)
        self.storage.put_file(job.objects.chapters_zip, zip_path, "application/zip")

    async def _cover(self, job) -> Cover | None:
        if not job.cover:
            return None
        return await asyncio.to_thread(_read_cover, self.storage, job.objects.cover, self.settings.max_cover_bytes)

    async def run(self, job_id: str) -> str:
        job = await self.store.get(job_id)
        if job is None or job.status != JobStatus.FINALIZING:
            log.info("finalize %s: nothing to do (status %s)", job_id, job.status if job else "gone")
            return "skipped"
        plan = await self.store.plan(job_id)
        winners = await self.store.completed_segments(job_id)
        missing = [s.index for s in plan.segments if s.index not in winners]
        if missing:
            reason = f"finalize found {len(missing)} segment(s) without audio (first: {missing[0]})"
            await self.store.fail(job_id, reason)
            return "failed"
        model_rate = MODELS[job.model].family.sample_rate
        pauses = Pauses.of(self.settings)

        def read_segment(index: int) -> bytes:
            attempt, samples = winners[index]
            reused = plan.reused.get(index)  # from the segment cache (jobs/segcache.py)
            pcm = self.storage.get_bytes(reused[0] if reused else job.objects.part(index, attempt))
            if len(pcm) != 2 * samples:
                raise RuntimeError(
                    f"segment {index}: stored part has {len(pcm) // 2} samples, expected {samples}"
                )
            return pcm

        key = job.objects.audio(job.format)
        with tempfile.TemporaryDirectory(prefix="narrate-final-") as tmp:
            out = Path(tmp) / f"{job_id}.{job.format}"
            chapter_dir = Path(tmp) / "chapters" if job.chapter_files else None
            if chapter_dir is not None:
                chapter_dir.mkdir()
            manifest = await asyncio.to_thread(
                stitch,
                plan,
                read_segment,
                out,
                fmt=job.format,
                model_rate=model_rate,
                out_rate=job.sample_rate,
                pauses=pauses,
                samples={index: samples for index, (_, samples) in winners.items()},
                kbps=job.bitrate_kbps,
                tags=job.tags(),
                loudness=(job.loudness_lufs, job.true_peak_dbtp) if job.loudness_lufs else None,
                cover=await self._cover(job),
                chapter_dir=chapter_dir,
            )
            flags = await self.store.flags(job_id)
            document = {**manifest.to_dict(job_id), "title": job.title, "flagged_segments": sorted(flags)}
            for entry in document["segments"]:
                if entry["index"] in flags:
                    entry["runaway"] = flags[entry["index"]]  # kept after its last retry: see docs/models.md
            body = json.dumps(document, ensure_ascii=False).encode()
            await asyncio.to_thread(self.storage.put_bytes, job.objects.manifest, body)
            if chapter_dir is not None:
                await asyncio.to_thread(self._put_chapters, job, chapter_dir, Path(tmp) / "chapters.zip")
            await asyncio.to_thread(self.storage.put_file, key, out, format_named(job.format).content_type)
        await self._keep_segments(job, plan, winners, flags)  # before done: a revision sent at once finds them
        if not await self.store.finish(job_id, key, manifest.duration_s, audio_url(job_id)):
            # cancelled or deleted while we stitched: what we wrote is garbage, unless another run of
            # this job finished it first (then the file is the job's: same content, same keys)
            if await self.store.status(job_id) != JobStatus.DONE:
                await asyncio.to_thread(delete_outputs, self.storage, job.objects)
            return "skipped"
        await asyncio.to_thread(self.storage.delete_prefix, job.objects.parts_prefix)
        await self.store.unmark_finalizing(job_id)
        log.info("finalized %s: %.1f s of audio in %s", job_id, manifest.duration_s, key)
        return "done"


    async def _keep_segments(self, job, plan, winners, flags) -> None:
        """The job's rendered segments into the segment cache (not those flagged as runaways, which
        a later job should render afresh); the reused ones' last use is now. A cache that cannot be
        written costs later jobs time, never this one its audio: it is logged, not raised."""
        if not plan.cache_scope or len(plan.cache_keys) != len(plan.segments):
            return
        cache = SegmentCache(self.store.redis, self.store.names, self.settings)
        fresh = [
            (job.objects.part(i, winners[i][0]), plan.cache_keys[i], winners[i][1])
            for i in range(len(plan.segments))
            if i not in plan.reused and i not in flags
        ]
        try:
            kept = await cache.promote(self.storage, plan.cache_scope, fresh)
            await cache.touch(plan.cache_scope, [plan.cache_keys[i] for i in plan.reused])
            log.info("finalize %s: %d segment(s) kept for reuse, %d reused", job.id, kept, len(plan.reused))
        except Exception:  # noqa: BLE001
            log.warning("finalize %s: could not keep its segments for reuse", job.id, exc_info=True)


def _read_cover(storage: Storage, key: str, max_bytes: int) -> Cover:
    return read_cover(storage.get_bytes(key), max_bytes)


def delete_outputs(storage: Storage, objects: JobObjects) -> None:
    """Remove everything a job has in storage: assembled parts, the finished file, its manifest."""
    for prefix in objects.prefixes:
        storage.delete_prefix(prefix)


def finalize_rq_id(settings: Settings, job_id: str) -> str:
    return f"{settings.key_prefix}-finalize-{job_id}"


def forget_finalize(settings: Settings, job_id: str, connection=None) -> None:
    """Delete RQ's record of a job's finalize (a queued or failed one; a successful one leaves none).

    A finalize that succeeds between RQ's fetch and its delete takes its record with it, and RQ's
    delete then cannot read its status (InvalidJobOperation): gone is what was asked for."""
    from rq.exceptions import InvalidJobOperation, NoSuchJobError
    from rq.job import Job as RQJob

    own = connection is None
    connection = connection or rq_client(settings)
    try:
        RQJob.fetch(finalize_rq_id(settings, job_id), connection=connection).delete()
    except (NoSuchJobError, InvalidJobOperation):
        pass
    finally:
        if own:
            connection.close()


def enqueue_finalize(settings: Settings, job_id: str, connection=None) -> None:
    """Queue the finalize job once (a second call for the same job is a no-op). RQ retries a failed
    run ``finalize_retries`` times; after the last, ``finalize_failed`` fails the narration job."""
    from rq import Callback, Queue, Retry
    from rq.exceptions import DuplicateJobError
    from rq.job import Job as RQJob

    connection = connection or rq_client(settings)
    rq_id = finalize_rq_id(settings, job_id)
    if RQJob.exists(rq_id, connection=connection):
        return
    queue = Queue(settings.finalize_queue, connection=connection)
    retry = Retry(max=settings.finalize_retries, interval=settings.finalize_retry_intervals)
    with contextlib.suppress(DuplicateJobError):
        queue.enqueue_call(
            finalize_job,
            args=(job_id,),
            job_id=rq_id,
            unique=True,
            timeout=settings.finalize_timeout_s,
            retry=retry if settings.finalize_retries else None,
            on_failure=Callback(finalize_failed),
            result_ttl=0,  # a success leaves no record in RQ (the job's own hash says 'done')
            failure_ttl=settings.result_ttl_s,
        )


def finalize_failed(rq_job, connection, exc_type, exc_value, traceback) -> None:
    """RQ's failure callback, run after every failed (or abandoned: its worker died) finalize. While
    RQ will retry it, nothing happens; after the last try the narration job fails with the reason."""
    if rq_job.retries_left:
        log.warning(
            "finalize %s failed (%s); RQ retries it (%d left)", rq_job.id, exc_value, rq_job.retries_left
        )
        return
    settings = Settings()  # the RQ worker's environment, as for finalize_job
    error = str(exc_value).strip() or getattr(exc_type, "__name__", "an error")
    reason = f"finalizing failed after {settings.finalize_retries + 1} tries: {error[:500]}"
    asyncio.run(_fail(settings, rq_job.args[0], reason))


async def _fail(settings: Settings, job_id: str, reason: str) -> None:
    redis = async_client(settings)
    try:
        store = JobStore.for_settings(redis, settings)
        if await store.fail(job_id, reason):
            log.error("job %s failed: %s", job_id, reason)
        await store.unmark_finalizing(job_id)
    finally:
        await redis.aclose()


def finalize_problem(settings: Settings, job_id: str, connection) -> str | None:
    """What went wrong with a job's finalize, as RQ knows it: ``"missing"`` (no record: lost), the
    failure (RQ gave up on it), or None (queued, scheduled for a retry, or running)."""
    from rq.exceptions import NoSuchJobError
    from rq.job import Job as RQJob
    from rq.job import JobStatus as RQStatus

    try:
        rq_job = RQJob.fetch(finalize_rq_id(settings, job_id), connection=connection)
    except NoSuchJobError:
        return "missing"
    if rq_job.get_status() not in (RQStatus.FAILED, RQStatus.STOPPED, RQStatus.CANCELED):
        return None
    result = rq_job.latest_result()
    lines = (result.exc_string or "").strip().splitlines() if result is not None else []
    return lines[-1][:500] if lines else f"RQ marked it {rq_job.get_status()}"
