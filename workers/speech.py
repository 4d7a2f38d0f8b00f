"""The speech worker: segment tasks of single-stage models in, delta audio out (no decoder stage).

``SegmentSpeaker`` is the compute (an engine that yields audio itself; no Redis): it runs one
synthesis in a thread and hands the audio on as the engine produces it, in pieces of about
``speech_chunk_ms`` (the first one as soon as there is any audio). ``SpeechWorker`` is the transport:
it reads one task at a time from the task streams of the models it serves (group ``speech``), marks
the segment started (attempt numbers as for AR workers), publishes each piece as an ``AudioChunk`` on
its job's shard of the audio stream exactly as a decoder does (seq from 0, ``final`` on the last), and
acks once the final piece is out. The assembler cannot tell the two paths apart.

One engine per family and process, one segment at a time (eSpeak NG keeps its state in globals;
a Piper voice's onnxruntime session runs on its share of the cores): parallel synthesis means several
speech worker processes (``NARRATE_SPEECH_WORKERS``). The engine comes from the model's family
(models/single_stage.py), loaded before the worker announces itself ready.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator

import numpy as np

from fleet.messages import AudioChunk, SegmentTask
from fleet.names import SPEECH_GROUP
from models.single_stage import SingleStageFamily, SpeechEngine
from workers import metrics
from workers.errors import PermanentError
from workers.runtime import WorkerContext
from workers.stage import Stage, Work
from workers.transport import Transport

log = logging.getLogger(__name__)


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


class SpeechWorker(Stage[SegmentTask]):
    kind = "speech"
    group = SPEECH_GROUP
    message = SegmentTask
    activity = "narrating"
    #: Two tasks a read, spoken one after the other: the read's round trips are paid once for two
    #: segments, and the second is held for one segment's time at most (~20 ms with eSpeak NG, ~0.1-0.3 s
    #: with a Piper voice on one core).
    batch_size = 2
    drop_ended_first = False  # START_SEGMENT refuses an ended job

    def __init__(
        self, ctx: WorkerContext, speakers: dict[str, SegmentSpeaker], transport: Transport | None = None
    ) -> None:
        models = list(speakers)
        super().__init__(
            ctx,
            [ctx.names.tasks(m, shard) for m in models for shard in ctx.shards],
            transport=transport,
            live_models=models,
            # no new segment while the assemblers have a backlog
            backlog_streams=[[ctx.names.audio(shard) for shard in ctx.shards]],
            admit_models=models,
        )
        self.speakers = speakers
        self._speaking = 0  # segments being synthesized now (one engine: 0 or 1)
        label = ",".join(models)  # one segment at a time, whichever engine
        metrics.SLOTS.labels(self.kind, label).set(1)
        metrics.SLOTS_IN_USE.labels(self.kind, label).set_function(lambda: self._speaking)
        log.info("speech worker for %s", ", ".join(models))

    def check(self, task: SegmentTask) -> None:
        if task.model not in self.speakers:
            raise PermanentError(f"this speech worker does not serve model {task.model!r}")

    async def handle(self, work: Work[SegmentTask]) -> None:
        # 1) start the segment (attempt number; nothing to do if the job ended); 2) synthesize,
        # publishing audio as it comes (an interrupted batch is redone as a new attempt)
        task = work.message
        attempt = await self.ctx.store.start_segment(task.job_id, task.segment)
        if attempt:
            self._speaking += 1
            try:
                await self._speak(task, attempt)
            finally:
                self._speaking -= 1

    async def _speak(self, task: SegmentTask, attempt: int) -> None:
        speaker = self.speakers[task.model]
        produced = metrics.AUDIO_PRODUCED.labels(self.kind, task.model)
        stream = self.ctx.names.audio(self.ctx.shard(task.job_id))
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
            await self.transport.publish(stream, [chunk.encode()])
            produced.inc(pcm.size / speaker.engine.sample_rate)
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
    from models.registry import get_model

    speakers = {}
    for model in models:
        spec = get_model(model, ctx.settings)
        if not isinstance(spec.family, SingleStageFamily):
            raise ValueError(f"model {model!r} is a two-stage model: it runs on AR and decoder workers")
        engine = await asyncio.to_thread(spec.family.engine, ctx.settings)  # the process's one of the family
        speakers[model] = SegmentSpeaker(engine, spec.family, ctx.settings.speech_chunk_ms)
    await SpeechWorker(ctx, speakers).run()
