"""Stage 0, the AR worker: segment tasks in, chunks of codec codes out; keeps its engine full.

``SegmentSynthesizer`` is the compute (engine + family + chunker; no Redis). ``ARWorker`` is the
transport: it pulls tasks from the model's task stream whenever engine slots are free (continuous
batching across jobs), runs each segment as its own asyncio task, publishes one stream entry per
window (never per token), acks when the final window is out, and aborts the engine requests of jobs
that were cancelled.

Runaways (models/runaway.py): the synthesizer raises ``RunawayError`` when a segment never stops or
loops on the same frames; the worker then queues a retry with another seed (up to
``runaway_retries``), or, on the last try, keeps the audio up to the detection and flags the segment.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fleet.messages import CodeChunk, MessageError, SegmentTask
from fleet.names import AR_GROUP
from fleet.settings import Settings
from models.engines.base import Engine, FrameConstraint, SamplingParams
from models.family import CodecLMFamily, InvalidCodeError, TextTokenizer
from models.runaway import NEVER_STOPS, REPEATS, RepeatDetector, RunawayError, retry_seed
from models.streaming import FrameChunker, Window
from workers.consumer import Delivery
from workers.runtime import WorkerContext, every, heartbeat, resilient_loop

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StreamingConfig:
    chunk_frames: int
    first_chunk_frames: int
    left_context: int
    lookahead: int

    @classmethod
    def from_settings(cls, s: Settings, family: CodecLMFamily) -> StreamingConfig:
        """The settings' chunk sizes; context and look-ahead from the settings if set, else the
        family's (its codec's measured receptive field)."""
        left = family.left_context_frames if s.left_context_frames is None else s.left_context_frames
        right = family.lookahead_frames if s.lookahead_frames is None else s.lookahead_frames
        return cls(s.chunk_frames, s.first_chunk_frames, left, right)

    def first_chunk_for(self, segment: int) -> int:
        """The ramp (a small first chunk) only where a listener waits for it: a job's first segment.
        Later segments run alongside it and are ready long before playback reaches them; for them a
        ramp would only add windows, i.e. decoder launches and re-decoded context."""
        return self.first_chunk_frames if segment == 0 else self.chunk_frames


class SegmentSynthesizer:
    """One segment task -> the code windows of its audio, as the engine streams tokens."""

    def __init__(
        self, family: CodecLMFamily, tokenizer: TextTokenizer, engine: Engine, streaming: StreamingConfig
    ) -> None:
        self.family = family
        self.tokenizer = tokenizer
        self.engine = engine
        self.streaming = streaming

    def sampling_params(self, task: SegmentTask) -> SamplingParams:
        d = self.family.sampling
        return SamplingParams(
            max_tokens=self.family.max_tokens(task.text),
            temperature=d.temperature,
            top_p=d.top_p,
            top_k=d.top_k,
            repetition_penalty=d.repetition_penalty,
            seed=retry_seed(task.seed, task.retry),
            stop_token_ids=self.family.layout.stop_token_ids,
            constraint=FrameConstraint(self.family.layout),
        )

    async def windows(self, task: SegmentTask, request_id: str) -> AsyncIterator[list[Window]]:
        """The segment's windows as they become decodable; raises ``RunawayError`` (leaving the
        engine request, which aborts it) when the segment loops or ends without the stop token."""
        s = self.streaming
        chunker = FrameChunker(
            self.family.layout,
            chunk_frames=s.chunk_frames,
            first_chunk_frames=s.first_chunk_for(task.segment),
            left_context=s.left_context,
            lookahead=s.lookahead,
        )
        limits = self.family.runaway
        repeats = RepeatDetector(limits.max_cycle_frames, self.family.repeat_limit_frames)
        prompt = self.family.build_prompt(self.tokenizer, task.text, task.voice)
        finish_reason = None
        async for delta in self.engine.generate(request_id, prompt, self.sampling_params(task)):
            ready = chunker.feed(delta.token_ids)
            if chunker.frames > repeats.frames and (
                loop := repeats.push(chunker.all_frames()[repeats.frames :])
            ):
                cycle, run = loop
                raise RunawayError(
                    REPEATS,
                    f"a cycle of {cycle} frame(s) repeated for {run} frames "
                    f"({run * self.family.frame_seconds:.1f} s) from frame {chunker.frames - run}",
                    ready + chunker.finish(),
                )
            if ready:
                yield ready
            finish_reason = delta.finish_reason
        stopped = chunker.stopped or finish_reason == "stop"  # whether or not the engine echoes the stop id
        if limits.stop_required and not stopped and finish_reason != "abort":
            raise RunawayError(
                NEVER_STOPS,
                f"no stop token after {chunker.frames} frames ({chunker.frames * self.family.frame_seconds:.1f} s, "
                f"the budget for {len(task.text)} characters)",
                chunker.finish(),
            )
        yield chunker.finish()


class ARWorker:
    def __init__(self, ctx: WorkerContext, model: str, synth: SegmentSynthesizer, max_in_flight: int) -> None:
        self.ctx = ctx
        self.model = model
        self.synth = synth
        self.max_in_flight = max_in_flight
        self.consumer = ctx.consumer([ctx.names.tasks(model)], AR_GROUP, f"ar-{model}")
        self.codes_stream = ctx.names.codes(model)
        self._segments: dict[asyncio.Task, str] = {}  # in-flight segment task -> job id
        self._ended_jobs: set[str] = set()
        self._slot_freed = asyncio.Event()
        self._admit_at: float | None = None  # with ar_admit_batch > 1: when free slots are taken anyway
        self._frames_published = 0
        self._throughput_mark = (time.monotonic(), 0)

    async def run(self) -> None:
        stop = self.ctx.stop
        chores = [
            asyncio.create_task(self.consumer.lease_loop(stop)),
            asyncio.create_task(every(0.25, stop, self._abort_ended_jobs, "cancel check")),
            asyncio.create_task(heartbeat(self.ctx, "ar", [self.model])),
            asyncio.create_task(every(10.0, stop, self._log_throughput, "throughput line")),
        ]
        log.info("AR worker for %s: up to %d segments in flight", self.model, self.max_in_flight)
        try:
            await resilient_loop(self._step, self.ctx, self.consumer, f"AR worker ({self.model})")
        finally:
            # Stop: abort the segments in flight (their engine requests with them) and hand their
            # tasks back at once; another AR worker redoes them as new attempts.
            for task in list(self._segments):
                task.cancel()
            await asyncio.gather(*self._segments, return_exceptions=True)
            await asyncio.gather(*chores, return_exceptions=True)
            handed = await self.consumer.hand_back()
            log.info("AR worker stopped; handed back %d segment(s)", handed)

    async def _step(self) -> None:
        """Start as many segments as there are free engine slots (continuous batching)."""
        stop = self.ctx.stop
        free = self.max_in_flight - len(self._segments)
        if free <= 0:
            self._slot_freed.clear()
            await _first(self._slot_freed.wait(), stop.wait())
            return
        if wait := self._admission_wait(free):  # before the Redis round trip of the backlog check
            self._slot_freed.clear()
            await _first(self._slot_freed.wait(), stop.wait(), asyncio.sleep(wait))
            return
        if await self._downstream_behind():
            await _first(asyncio.sleep(0.2), stop.wait())
            return
        for delivery in await self.consumer.read(free, self.ctx.settings.block_ms):
            task = asyncio.create_task(self._handle(delivery))
            self._segments[task] = ""
            task.add_done_callback(self._segment_finished)

    def _admission_wait(self, free: int) -> float:
        """Seconds to wait before starting segments in ``free`` slots (0: start now). With
        ``ar_admit_batch`` > 1 a busy engine takes new segments in groups, not one per freed slot."""
        s = self.ctx.settings
        if not self._segments or free >= min(s.ar_admit_batch, self.max_in_flight):
            self._admit_at = None
            return 0.0
        now = time.monotonic()
        if self._admit_at is None:
            self._admit_at = now + s.ar_admit_wait_ms / 1000
        if now >= self._admit_at:
            self._admit_at = None
            return 0.0
        return self._admit_at - now

    async def _downstream_behind(self) -> bool:
        """Back-pressure: hold new segments while decoders or assemblers have a backlog."""
        pipe = self.ctx.redis.pipeline(transaction=False)
        pipe.xlen(self.codes_stream)
        pipe.xlen(self.ctx.names.audio())
        codes, audio = await pipe.execute()
        return max(codes, audio) > self.ctx.settings.max_stream_backlog

    async def _log_throughput(self) -> None:
        """Is the engine kept full, and how fast does it go? (vLLM's own statistics are off.)"""
        now, frames = time.monotonic(), self._frames_published
        then, before = self._throughput_mark
        self._throughput_mark = (now, frames)
        if self._segments or frames != before:
            log.info(
                "AR %s: %d/%d segments in flight, %.1f frames/s",
                self.model,
                len(self._segments),
                self.max_in_flight,
                (frames - before) / max(now - then, 1e-9),
            )

    def _segment_finished(self, task: asyncio.Task) -> None:
        self._segments.pop(task, None)
        self._slot_freed.set()

    async def _abort_ended_jobs(self) -> None:
        jobs = {job for job in self._segments.values() if job}
        if not jobs:
            return
        for job_id, status in (await self.ctx.store.statuses(jobs)).items():
            if status is None or status.terminal:
                self._ended_jobs.add(job_id)
                for task, job in list(self._segments.items()):
                    if job == job_id:
                        task.cancel()  # leaving engine.generate aborts the request in the engine

    async def _handle(self, delivery: Delivery) -> None:
        try:
            task = SegmentTask.decode(delivery.fields)
        except MessageError as exc:
            await self._fail_unreadable(delivery, exc)
            return
        attempt = await self.ctx.store.start_segment(task.job_id, task.segment)
        if not attempt:
            await self.consumer.ack(delivery)  # cancelled or gone: drop, spend nothing
            return
        self._segments[asyncio.current_task()] = task.job_id
        request_id = f"{task.job_id}:{task.segment}:{attempt}"
        try:
            async for windows in self.synth.windows(task, request_id):
                await self._publish(task, attempt, windows)
            await self.consumer.ack(delivery)
        except asyncio.CancelledError:
            if task.job_id in self._ended_jobs:
                await self.consumer.ack(delivery)
            raise
        except RunawayError as exc:
            await self._runaway(delivery, task, attempt, exc)
        except InvalidCodeError as exc:
            await self.consumer.dead_letter(delivery, str(exc))
            await self.ctx.store.fail(
                task.job_id, f"segment {task.segment}: the model produced invalid codes ({exc})"
            )
        except Exception as exc:  # noqa: BLE001 - EngineError and the unforeseen: retry via redelivery
            log.exception("segment %s failed (attempt %d); it will be retried", request_id, attempt)
            self.consumer.release(delivery)
            if delivery.deliveries >= self.ctx.settings.max_deliveries:
                await self.consumer.dead_letter(delivery, f"{type(exc).__name__}: {exc}")
                await self.ctx.store.fail(
                    task.job_id, f"segment {task.segment} failed {delivery.deliveries} times: {exc}"
                )

    async def _runaway(self, delivery: Delivery, task: SegmentTask, attempt: int, exc: RunawayError) -> None:
        """Retry the segment with the next seed, or, after ``runaway_retries`` retries, keep what the
        last try produced (up to the detection) and flag the segment."""
        where = f"{task.job_id} segment {task.segment} (attempt {attempt}, retry {task.retry})"
        if task.retry < self.ctx.settings.runaway_retries:
            log.warning("runaway %s: %s; retrying with another seed", where, exc)
            await self.ctx.store.retry_runaway(task, attempt, exc.kind, exc.detail)
        else:
            log.warning("runaway %s: %s; no retries left, keeping it flagged", where, exc)
            await self.ctx.store.flag_segment(task.job_id, task.segment, exc.kind, exc.detail, task.retry)
            await self._publish(task, attempt, exc.flush)
        await self.consumer.ack(delivery)

    async def _publish(self, task: SegmentTask, attempt: int, windows: list[Window]) -> None:
        pipe = self.ctx.redis.pipeline(transaction=False)
        for w in windows:
            chunk = CodeChunk(
                job_id=task.job_id,
                segment=task.segment,
                attempt=attempt,
                seq=w.seq,
                model=task.model,
                left=w.left,
                right=w.right,
                final=w.final,
                frames=w.frames,
                retry=task.retry,
            )
            pipe.xadd(self.codes_stream, chunk.encode())
            self._frames_published += w.new_frames
        await pipe.execute()

    async def _fail_unreadable(self, delivery: Delivery, exc: Exception) -> None:
        job_id = await self.consumer.dead_letter(delivery, f"unreadable segment task: {exc}")
        if job_id:
            await self.ctx.store.fail(job_id, f"a segment task could not be read: {exc}")


async def _first(*aws) -> None:
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()


async def run_ar_worker(ctx: WorkerContext, model: str) -> None:
    from models.registry import get_model, load_engine, load_tokenizer
    from workers.runtime import StopRequested, configure_torch, engine_start_lock

    configure_torch(ctx.settings)
    spec = get_model(model, ctx.settings)
    try:
        async with engine_start_lock(ctx.settings, ctx.stop):  # AR workers may share this machine's GPU
            engine = await asyncio.to_thread(load_engine, spec, ctx.settings)
            await engine.start()
    except StopRequested:
        log.info("AR worker for %s stopped before its engine started", model)
        return
    tokenizer = await asyncio.to_thread(load_tokenizer, spec, ctx.settings)
    streaming = StreamingConfig.from_settings(ctx.settings, spec.family)
    synth = SegmentSynthesizer(spec.family, tokenizer, engine, streaming)
    try:
        await ARWorker(ctx, model, synth, engine.max_num_seqs).run()
    finally:
        await engine.shutdown()
