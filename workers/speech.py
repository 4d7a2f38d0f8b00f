"""The speech worker: segment tasks of single-stage models in, delta audio out (no decoder stage).

``SegmentSpeaker`` is the compute (an engine that yields audio itself; no Redis): it runs one
synthesis in a thread and hands the audio on as the engine produces it, in pieces of about
``speech_chunk_ms`` (the first one as soon as there is any audio). ``SpeechWorker`` is the transport:
it reads one task at a time from the task streams of the models it serves (group ``speech``), marks
the segment started (attempt numbers as for AR workers), publishes each piece as an ``AudioChunk`` on
the audio stream exactly as a decoder does (seq from 0, ``final`` on the last), and acks once the final
piece is out. The assembler cannot tell the two paths apart.

One engine per process and one segment at a time: eSpeak NG keeps its state in globals, so parallel
synthesis means several speech worker processes (``NARRATE_SPEECH_WORKERS``).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator
from typing import Protocol

import numpy as np

from fleet.messages import AudioChunk, MessageError, SegmentTask
from fleet.names import SPEECH_GROUP
from fleet.redis import TRANSIENT_ERRORS
from models.espeak import UnsupportedTextError, VoiceError
from models.single_stage import SingleStageFamily
from workers.consumer import Delivery
from workers.runtime import WorkerContext, heartbeat, resilient_loop

log = logging.getLogger(__name__)

#: Errors that retrying cannot fix: the task is dead-lettered and its job failed with the reason.
PERMANENT_ERRORS = (UnsupportedTextError, VoiceError)


class SpeechEngine(Protocol):
    sample_rate: int

    def check_text(self, text: str, voice: str) -> None: ...

    def synthesize(self, text: str, voice: str, on_audio, *, rate: int, pitch: int) -> None: ...


class SegmentSpeaker:
    """One segment task -> (int16 PCM, final) pieces, as the engine synthesizes them (delta audio)."""

    def __init__(self, engine: SpeechEngine, family: SingleStageFamily, chunk_ms: int) -> None:
        self.engine = engine
        self.family = family
        self.chunk_samples = max(1, engine.sample_rate * chunk_ms // 1000)

    async def pieces(self, task: SegmentTask) -> AsyncIterator[tuple[np.ndarray, bool]]:
        self.engine.check_text(task.text, task.voice)  # UnsupportedTextError: before any audio
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[np.ndarray | None] = asyncio.Queue()
        abort = threading.Event()

        def on_audio(piece: np.ndarray) -> bool:
            if abort.is_set():
                return False
            loop.call_soon_threadsafe(queue.put_nowait, piece)
            return True

        def run() -> None:
            try:
                self.engine.synthesize(
                    task.text,
                    task.voice,
                    on_audio,
                    rate=task.rate or self.family.default_rate,
                    pitch=task.pitch or self.family.default_pitch,
                )
            finally:
                loop.call_soon_threadsafe(queue.put_nowait, None)

        synthesis = asyncio.ensure_future(asyncio.to_thread(run))
        try:
            held: list[np.ndarray] = []
            first = True
            while (piece := await queue.get()) is not None:
                held.append(piece)
                if first or sum(p.size for p in held) >= self.chunk_samples:
                    yield np.concatenate(held), False
                    held, first = [], False
            await synthesis  # the engine's error, if any
            yield (np.concatenate(held) if held else np.zeros(0, np.int16)), True
        finally:
            abort.set()  # a consumer that left early stops the synthesis at its next piece
            await asyncio.gather(synthesis, return_exceptions=True)


class SpeechWorker:
    def __init__(self, ctx: WorkerContext, speakers: dict[str, SegmentSpeaker]) -> None:
        self.ctx = ctx
        self.speakers = speakers
        self.models = list(speakers)
        self.consumer = ctx.consumer([ctx.names.tasks(m) for m in self.models], SPEECH_GROUP, "speech")

    async def run(self) -> None:
        chores = [
            asyncio.create_task(self.consumer.lease_loop(self.ctx.stop)),
            asyncio.create_task(heartbeat(self.ctx, "speech", self.models)),
        ]
        log.info("speech worker for %s", ", ".join(self.models))
        try:
            await resilient_loop(self._step, self.ctx, self.consumer, "speech worker")
        finally:
            self.ctx.stop.set()
            await asyncio.gather(*chores, return_exceptions=True)

    async def _step(self) -> None:
        # back-pressure: no new segment while the assemblers have a backlog (as for AR workers)
        if await self.ctx.redis.xlen(self.ctx.names.audio()) > self.ctx.settings.max_stream_backlog:
            await asyncio.sleep(0.2)
            return
        # one segment at a time: this process has one engine, which synthesizes one text at a time
        for delivery in await self.consumer.next_batch(1, self.ctx.settings.block_ms):
            await self.handle(delivery)  # a batch interrupted by an outage is redone as a new attempt
        self.consumer.batch_done()

    async def handle(self, delivery: Delivery) -> None:
        # 1) read the task; 2) start the segment (attempt number; nothing to do if the job ended)
        try:
            task = SegmentTask.decode(delivery.fields)
            if task.model not in self.speakers:
                raise MessageError(f"this speech worker does not serve model {task.model!r}")
        except MessageError as exc:
            job_id = await self.consumer.dead_letter(delivery, f"unreadable segment task: {exc}")
            if job_id:
                await self.ctx.store.fail(job_id, f"a segment task could not be read: {exc}")
            return
        attempt = await self.ctx.store.start_segment(task.job_id, task.segment)
        if not attempt:
            await self.consumer.ack(delivery)
            return
        # 3) synthesize, publishing audio as it comes; 4) ack once the final piece is out
        try:
            await self._speak(task, attempt)
        except PERMANENT_ERRORS as exc:
            await self.consumer.dead_letter(delivery, str(exc))
            await self.ctx.store.fail(task.job_id, f"segment {task.segment}: {exc}")
            return
        except TRANSIENT_ERRORS:
            raise  # Redis is away: the loop waits and redoes the task (as a new attempt)
        except Exception as exc:  # noqa: BLE001 - retried via redelivery, then dead-lettered
            log.exception("segment %s:%d failed (attempt %d)", task.job_id, task.segment, attempt)
            self.consumer.release(delivery)
            if delivery.deliveries >= self.ctx.settings.max_deliveries:
                await self.consumer.dead_letter(delivery, f"{type(exc).__name__}: {exc}")
                await self.ctx.store.fail(
                    task.job_id, f"segment {task.segment} failed {delivery.deliveries} times: {exc}"
                )
            return
        await self.consumer.ack(delivery)

    async def _speak(self, task: SegmentTask, attempt: int) -> None:
        speaker = self.speakers[task.model]
        seq = samples = 0
        async for pcm, final in speaker.pieces(task):
            samples += pcm.size
            chunk = AudioChunk(
                task.job_id,
                task.segment,
                attempt,
                seq,
                final,
                speaker.engine.sample_rate,
                pcm.astype("<i2", copy=False).tobytes(),
            )
            await self.ctx.redis.xadd(self.ctx.names.audio(), chunk.encode())
            seq += 1
        log.info(
            "segment %s:%d (attempt %d): %.2f s of audio in %d chunks",
            task.job_id,
            task.segment,
            attempt,
            samples / speaker.engine.sample_rate,
            seq,
        )


async def run_speech_worker(ctx: WorkerContext, models: list[str]) -> None:
    from models import espeak
    from models.registry import get_model

    engine = await asyncio.to_thread(espeak.engine)  # this process's one engine
    speakers = {}
    for model in models:
        spec = get_model(model, ctx.settings)
        if not isinstance(spec.family, SingleStageFamily):
            raise ValueError(f"model {model!r} is a two-stage model: it runs on AR and decoder workers")
        speakers[model] = SegmentSpeaker(engine, spec.family, ctx.settings.speech_chunk_ms)
    await SpeechWorker(ctx, speakers).run()
