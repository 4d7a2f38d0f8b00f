"""A job's audio while it renders: int16 PCM at the model's rate, in book order with its pauses, for a
listener who starts before the job ends (GET /v1/jobs/{id}/stream, POST /v1/audio/speech).

Where each segment's audio is, as the fleet makes it:

- being rendered: the delta PCM of its newest attempt, in the attempt's delta hash by chunk number
  (the assembler's, ``Names.deltas``), read in order as chunks arrive;
- assembled: its part in storage (or the segment cache's object, for a reused segment), named by the
  done-segments hash;
- the job is done: the parts are gone, the finished file is read instead (PyAV decodes it from the
  manifest's position of where the listener is, resampled to the model's rate).

Nothing is pushed to a reader: it polls (``poll_s``) the one segment it waits for, a pipelined round
trip, so a listener costs Redis a few commands a poll and the fleet nothing. An attempt given up for a
retry (a crashed worker, a runaway) is continued by the next one from the same sample, so the
listener hears each sample once; the finished file has the winner's audio throughout.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import numpy as np

from fleet.storage import Storage, StorageError
from jobs.audio import Pauses
from jobs.errors import InvalidRequest
from jobs.model import Job, JobStatus
from jobs.progressive import StreamEncoder, StreamFormat
from jobs.segmentation import Plan, Segment
from jobs.store import JobStore

log = logging.getLogger(__name__)

#: Delta chunks read in one round trip.
CHUNKS_PER_READ = 16


class LiveEnded(Exception):
    """The job failed or was cancelled (or deleted) before the listener reached its end."""


class _Finished(Exception):
    """The job is done: its parts are gone, the finished file has the rest."""


@dataclass
class LiveAudio:
    store: JobStore
    storage: Storage
    job: Job
    plan: Plan
    pauses: Pauses
    #: The model's sample rate: what every piece is at.
    rate: int
    poll_s: float = 0.04
    _started: bool = False  # the listener has had audio

    def first_segment(self, chapter: int) -> int:
        """Where chapter ``chapter`` (from 1) starts, or ``InvalidRequest``."""
        chapters = self.plan.chapters
        if not chapters and chapter == 1:
            return 0
        if not 1 <= chapter <= len(chapters):
            raise InvalidRequest(f"chapter {chapter} is out of range: this job has chapters 1 to {max(1, len(chapters))}")
        return chapters[chapter - 1].first_segment

    async def pcm(self, chapter: int = 1) -> AsyncIterator[np.ndarray]:
        """The audio from the start of ``chapter`` to the job's end, as it becomes available."""
        first = self.first_segment(chapter)
        if self.job.status == JobStatus.DONE:
            async for piece in self._finished(first, 0):
                yield piece
            return
        if self.job.status.terminal:
            raise LiveEnded(f"job {self.job.id} is {self.job.status.value}")
        for segment in self.plan.segments[first:]:
            sent = 0
            try:
                async for piece in self._segment(segment):
                    sent += piece.size
                    yield piece
            except _Finished:
                async for piece in self._finished(segment.index, sent):
                    yield piece
                return
            gap = self.pauses.after(segment, self.rate)
            if gap:
                yield np.zeros(gap, dtype=np.int16)

    async def _segment(self, segment: Segment) -> AsyncIterator[np.ndarray]:
        """One segment's audio: its deltas as they arrive, then the rest from its assembled part."""
        names, redis, index = self.store.names, self.store.redis, segment.index
        attempt, seq, sent, skip = 0, 0, 0, 0
        while True:
            async with redis.pipeline(transaction=False) as pipe:
                pipe.hget(names.done_segments(self.job.id), index)
                pipe.hget(names.attempts(self.job.id), index)
                pipe.hget(names.job(self.job.id), "status")
                done, attempts, status = await pipe.execute()
            status = JobStatus(status.decode()) if status else None
            if done is not None:
                pcm = await self._part(index, int(done.decode().split(":")[0]), status)
                if sent < pcm.size:
                    yield pcm[sent:]
                return
            if status is None or status in (JobStatus.FAILED, JobStatus.CANCELLED):
                raise LiveEnded(f"job {self.job.id} is {status.value if status else 'deleted'}")
            if status == JobStatus.DONE:
                raise _Finished
            newest = int(attempts or 0)
            if newest != attempt:  # a new attempt: continue from the sample the listener is at
                attempt, seq, skip = newest, 0, sent
            fresh = 0
            if attempt:
                fields = [str(s) for s in range(seq, seq + CHUNKS_PER_READ)]
                pieces = await redis.hmget(names.deltas(self.job.id, index, attempt), fields)
                taken = []
                for piece in pieces:
                    if piece is None:
                        break  # chunks are used in order: a later one waits for the gap
                    taken.append(piece)
                seq, fresh = seq + len(taken), len(taken)
                if taken:
                    pcm = np.frombuffer(b"".join(taken), dtype="<i2")
                    drop = min(skip, pcm.size)
                    skip -= drop
                    if pcm.size > drop:
                        sent += pcm.size - drop
                        self._started = True
                        yield pcm[drop:]
            if fresh < CHUNKS_PER_READ:
                # until the listener's first audio, four times as often: that wait is the stream's latency
                await asyncio.sleep(self.poll_s if self._started else self.poll_s / 4)

    async def _part(self, index: int, attempt: int, status: JobStatus | None) -> np.ndarray:
        reused = self.plan.reused.get(index)  # from the segment cache (jobs/segcache.py)
        key = reused[0] if reused else self.job.objects.part(index, attempt)
        try:
            data = await asyncio.to_thread(self.storage.get_bytes, key)
        except StorageError:
            # the parts go once the file is made (or with the job)
            if await self.store.status(self.job.id) == JobStatus.DONE:
                raise _Finished from None
            raise LiveEnded(f"job {self.job.id} has ended; segment {index} is no longer stored") from None
        return np.frombuffer(data, dtype="<i2")

    async def _finished(self, segment: int, offset: int) -> AsyncIterator[np.ndarray]:
        """The finished file from ``offset`` samples (model rate) into ``segment`` to its end."""
        job = await self.store.get(self.job.id)  # as it is now: done, with its file's key
        try:
            if job is None or not job.audio_key:
                raise StorageError("no file")
            manifest = json.loads(await asyncio.to_thread(self.storage.get_bytes, job.objects.manifest))
        except StorageError as exc:
            raise LiveEnded(f"the audio of job {self.job.id} is no longer stored") from exc
        entry = manifest["segments"][segment]
        start_s = entry["start_s"] + offset / self.rate
        queue: asyncio.Queue = asyncio.Queue(maxsize=8)
        loop = asyncio.get_running_loop()
        stop = False

        def decode() -> None:  # in a thread: PyAV blocks
            try:
                for piece in decode_file(self.storage, job.audio_key, start_s, self.rate):
                    if stop:
                        return
                    asyncio.run_coroutine_threadsafe(queue.put(piece), loop).result()
                asyncio.run_coroutine_threadsafe(queue.put(None), loop).result()
            except BaseException as exc:  # noqa: BLE001 - handed to the reader
                if not stop:
                    asyncio.run_coroutine_threadsafe(queue.put(exc), loop).result()

        worker = loop.run_in_executor(None, decode)
        try:
            while (piece := await queue.get()) is not None:
                if isinstance(piece, BaseException):
                    raise LiveEnded(f"the audio of job {self.job.id} could not be read: {piece}") from piece
                yield piece
        finally:
            stop = True
            while not queue.empty():
                queue.get_nowait()
            worker.cancel()


def decode_file(storage: Storage, key: str, start_s: float, rate: int):
    """int16 mono pieces of a stored audio file from ``start_s``, at ``rate`` (a generator)."""
    import av

    with storage.open_read(key) as raw, av.open(raw) as container:
        stream = container.streams.audio[0]
        origin = stream.start_time or 0  # the first sample's time stamp (after an MP3's encoder delay)
        if start_s > 0:  # to the packet at or before the point; the samples before it are dropped
            container.seek(int(start_s / stream.time_base) + origin, stream=stream, backward=True)
        resampler = av.AudioResampler(format="s16", layout="mono", rate=rate)
        skip_to = round(start_s * rate)
        for frame in container.decode(stream):
            at = round(float((frame.pts - origin) * stream.time_base) * rate) if frame.pts is not None else None
            for out in resampler.resample(frame):
                pcm = out.to_ndarray().reshape(-1)
                if at is not None and at < skip_to:
                    pcm = pcm[min(pcm.size, skip_to - at) :]
                    at += out.samples
                if pcm.size:
                    yield pcm
        for out in resampler.resample(None):
            yield out.to_ndarray().reshape(-1)


async def encoded(live: LiveAudio, fmt: StreamFormat, chapter: int = 1, tempo: float = 1.0) -> AsyncIterator[bytes]:
    """``live``'s audio from ``chapter`` as the bytes of a ``fmt`` stream; a job that fails or is
    cancelled ends the stream where it was (a playable file of what was heard)."""
    encoder = StreamEncoder(fmt, live.rate, tempo)
    closed = False
    try:
        try:
            async for pcm in live.pcm(chapter):
                # a whole stored segment (seconds of audio) encodes off the event loop
                data = encoder.feed(pcm) if pcm.size < live.rate else await asyncio.to_thread(encoder.feed, pcm)
                if data:
                    yield data
        except LiveEnded as exc:
            log.info("live stream of %s ends early: %s", live.job.id, exc)
        closed = True
        yield encoder.close()
    finally:
        if not closed:
            encoder.abort()
