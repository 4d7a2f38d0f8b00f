"""Stage 0, the AR worker: segment tasks in, chunks of codec codes out; keeps its engine full.

``SegmentSynthesizer`` is the compute (engine + family + chunker; no Redis, no transport).
``ARWorker`` is the stage (workers/stage.py): it takes tasks from the model's task stream whenever
engine slots are free (continuous batching across jobs), runs each segment as its own asyncio task,
publishes one entry per window (never per token), settles the task when the final window is out,
and aborts the engine requests of jobs that were cancelled. A dead engine is fatal: the worker
hands back what it holds and exits so that its supervisor restarts it.

Runaways (models/runaway.py): the synthesizer raises ``RunawayError`` when a segment never stops or
loops on the same frames; the worker then queues a retry with another seed (up to
``runaway_retries``), or, on the last try, keeps the audio up to the detection and flags the segment.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import nullcontext
from dataclasses import dataclass

from fleet.messages import CodeChunk, SegmentTask
from fleet.names import AR_GROUP
from fleet.redis import TRANSIENT_ERRORS
from fleet.settings import Settings
from models.engines.base import Engine, FrameConstraint, SamplingParams
from models.family import CodecLMFamily, TextTokenizer
from models.runaway import NEVER_STOPS, REPEATS, RepeatDetector, RunawayError, retry_seed
from models.streaming import FrameChunker, Window
from workers import metrics
from workers.errors import PermanentError
from workers.runtime import WorkerContext, every
from workers.stage import Stage, Work, first_of
from workers.transport import Transport

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StreamingConfig:
    chunk_frames: int
    first_chunk_frames: int
    left_context: int
    lookahead: int
    uniform: bool = False

    @classmethod
    def from_settings(cls, s: Settings, family: CodecLMFamily) -> StreamingConfig:
        """The settings' chunk sizes; context and look-ahead from the settings if set, else the
        family's (its codec's measured receptive field)."""
        left = family.left_context_frames if s.left_context_frames is None else s.left_context_frames
        right = family.lookahead_frames if s.lookahead_frames is None else s.lookahead_frames
        return cls(s.chunk_frames, s.first_chunk_frames, left, right, s.uniform_windows)

    def first_chunk_for(self, segment: int) -> int:
        """The ramp (a small first chunk) only where a listener waits for it: a job's first segment.
        Later segments run alongside it and are ready long before playback reaches them; for them a
        ramp would only add windows, i.e. decoder launches and re-decoded context."""
        return self.first_chunk_frames if segment == 0 else self.chunk_frames

    def chunker(self, layout, segment: int) -> FrameChunker:
        """A new chunker for one segment's codes, as the AR worker cuts them."""
        return FrameChunker(
            layout,
            chunk_frames=self.chunk_frames,
            first_chunk_frames=self.first_chunk_for(segment),
            left_context=self.left_context,
            lookahead=self.lookahead,
            uniform=self.uniform,
        )


class SegmentSynthesizer:
    """One segment task -> the code windows of its audio, as the engine streams tokens."""

    def __init__(
        self, family: CodecLMFamily, tokenizer: TextTokenizer, engine: Engine, streaming: StreamingConfig
    ) -> None:
        self.family = family
        self.tokenizer = tokenizer
        self.engine = engine
        self.streaming = streaming

    @classmethod
    def for_model(cls, spec, settings: Settings, engine: Engine) -> SegmentSynthesizer:
        """The synthesizer of a served model (``models.registry.ModelSpec``) on ``engine``: the
        checkpoint's own tokenizer and the settings' streaming (chunk sizes, context)."""
        from models.registry import load_tokenizer

        streaming = StreamingConfig.from_settings(settings, spec.family)
        return cls(spec.family, load_tokenizer(spec, settings), engine, streaming)

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
        chunker = self.streaming.chunker(self.family.layout, task.segment)
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


class ARWorker(Stage[SegmentTask]):
    """Keeps the engine full: every free slot takes a task, and each segment runs as its own asyncio
    task (``_run_segment``), settled on its own when it ends."""

    kind = "ar"
    group = AR_GROUP
    message = SegmentTask
    activity = "narrating"
    drop_ended_first = False  # START_SEGMENT refuses an ended job

    def __init__(
        self,
        ctx: WorkerContext,
        model: str,
        synth: SegmentSynthesizer,
        max_in_flight: int,
        transport: Transport | None = None,
        interactive_slots: int = 0,
    ) -> None:
        """``max_in_flight``: segments of batch jobs at once; ``interactive_slots`` more only
        interactive jobs' segments take (the engine has room for both)."""
        names, shards = ctx.names, ctx.shards
        super().__init__(
            ctx,
            [names.tasks(model, shard) for shard in shards],
            transport=transport,
            live_models=[model],
            # decoders or assemblers behind: hold new segments
            backlog_streams=[[names.codes(model, s) for s in shards], [names.audio(s) for s in shards]],
            admit_models=[model],  # free slots take the next segments the scheduler picks
        )
        self.model = model
        self.synth = synth
        self.max_in_flight = max_in_flight
        self.interactive_slots = interactive_slots
        self._interactive: set[asyncio.Task] = set()  # in-flight segments of interactive jobs
        self._segments: dict[asyncio.Task, str] = {}  # in-flight segment task -> job id
        self._ended_jobs: set[str] = set()
        self._slot_freed = asyncio.Event()
        self._admit_at: float | None = None  # with ar_admit_batch > 1: when free slots are taken anyway
        self._frames_published = 0
        self._throughput_mark = (time.monotonic(), 0)
        metrics.SLOTS.labels(self.kind, model).set(max_in_flight + interactive_slots)
        metrics.SLOTS_IN_USE.labels(self.kind, model).set_function(lambda: len(self._segments))
        self._frames_counter = metrics.AR_FRAMES.labels(model)
        log.info("AR worker for %s: up to %d segments in flight", model, max_in_flight)

    def chores(self):
        stop = self.ctx.stop
        return [
            *super().chores(),
            every(0.25, stop, self._abort_ended_jobs, "cancel check"),
            every(10.0, stop, self._log_throughput, "throughput line"),
        ]

    def check(self, task: SegmentTask) -> None:
        if task.model != self.model:
            raise PermanentError(f"this AR worker serves {self.model!r}, not {task.model!r}")

    async def room(self) -> int:
        """Free engine slots (continuous batching), after admission grouping and back-pressure. Of
        these, ``interactive_room`` are the reserved slots that only interactive segments take: they
        are read for even while the batch slots wait for their admission group."""
        stop = self.ctx.stop
        total = self.max_in_flight + self.interactive_slots - len(self._segments)
        batch_in_flight = len(self._segments) - len(self._interactive)
        free = min(total, self.max_in_flight - batch_in_flight)
        self.interactive_room = 0
        if total <= 0:
            self._slot_freed.clear()
            await first_of(self._slot_freed.wait(), stop.wait())
            return 0
        if free > 0 and (wait := self._admission_wait(free)):  # before the backlog check's round trip
            if total == free:  # no reserved slot free either: wait for the group
                self._slot_freed.clear()
                await first_of(self._slot_freed.wait(), stop.wait(), asyncio.sleep(wait))
                return 0
            free = 0  # batch slots wait for their group; the reserved ones are read for now
        if await self.backlogged():
            await first_of(asyncio.sleep(0.2), stop.wait())
            return 0
        self.interactive_room = total - max(free, 0)
        return total

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

    async def process(self, work: list[Work[SegmentTask]]) -> None:
        """Start each segment as its own task; the loop goes on reading while they run."""
        for item in work:
            task = asyncio.create_task(self._run_segment(item))
            self._segments[task] = item.message.job_id
            if item.message.interactive:
                self._interactive.add(task)
            task.add_done_callback(self._segment_finished)

    async def _run_segment(self, work: Work[SegmentTask]) -> None:
        try:
            error = await self.attempt(self.handle(work))
        except TRANSIENT_ERRORS as exc:  # a segment cannot wait for the loop: retry it later
            error = exc
        except asyncio.CancelledError:
            if work.message.job_id in self._ended_jobs:
                await self.transport.ack(work.delivery)  # its job ended: nothing to redo
            raise  # stopping: the delivery is handed back
        try:
            await self.settle(work, error)
        except TRANSIENT_ERRORS:
            log.warning("could not settle %s (Redis away); its lease runs out instead", self._what(work))

    def _segment_finished(self, task: asyncio.Task) -> None:
        self._segments.pop(task, None)
        self._interactive.discard(task)
        self._slot_freed.set()

    async def wind_down(self) -> None:
        """Stop: abort the segments in flight (their engine requests with them) and hand their tasks
        back at once; another AR worker redoes them as new attempts."""
        for task in list(self._segments):
            task.cancel()
        await asyncio.gather(*self._segments, return_exceptions=True)
        await super().wind_down()

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

    async def _abort_ended_jobs(self) -> None:
        jobs = set(self._segments.values())
        if not jobs:
            return
        for job_id, status in (await self.ctx.store.statuses(jobs)).items():
            if status is None or status.terminal:
                self._ended_jobs.add(job_id)
                for task, job in list(self._segments.items()):
                    if job == job_id:
                        task.cancel()  # leaving engine.generate aborts the request in the engine

    async def handle(self, work: Work[SegmentTask]) -> None:
        task = work.message
        attempt = await self.ctx.store.start_segment(task.job_id, task.segment)
        if not attempt:
            return  # cancelled or gone: drop, spend nothing
        request_id = f"{task.job_id}:{task.segment}:{attempt}"
        try:
            async for windows in self.synth.windows(task, request_id):
                await self._publish(task, attempt, windows)
        except RunawayError as exc:
            await self._runaway(task, attempt, exc)

    async def _runaway(self, task: SegmentTask, attempt: int, exc: RunawayError) -> None:
        """Retry the segment with the next seed, or, after ``runaway_retries`` retries, keep what the
        last try produced (up to the detection) and flag the segment."""
        where = f"{task.job_id} segment {task.segment} (attempt {attempt}, retry {task.retry})"
        if task.retry < self.ctx.settings.runaway_retries:
            log.warning("runaway %s: %s; retrying with another seed", where, exc)
            await self.ctx.store.retry_runaway(task, attempt, exc.kind, exc.detail)
            metrics.RUNAWAYS.labels(self.kind, exc.kind, "retry").inc()
        else:
            log.warning("runaway %s: %s; no retries left, keeping it flagged", where, exc)
            metrics.RUNAWAYS.labels(self.kind, exc.kind, "flag").inc()
            await self.ctx.store.flag_segment(task.job_id, task.segment, exc.kind, exc.detail, task.retry)
            await self._publish(task, attempt, exc.flush)

    async def _publish(self, task: SegmentTask, attempt: int, windows: list[Window]) -> None:
        chunks = [
            CodeChunk(
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
            ).encode()
            for w in windows
        ]
        await self.transport.publish(self.ctx.names.codes(self.model, self.ctx.shard(task.job_id)), chunks)
        frames = sum(w.new_frames for w in windows)
        self._frames_published += frames
        self._frames_counter.inc(frames)


def measures_memory_at_start(settings) -> bool:
    """Whether the engine profiles its GPU memory at start, which an engine starting beside it would
    upset (hence the engine-start lock): every engine but vLLM's given its KV cache size."""
    return not (settings.engine == "vllm" and settings.vllm_kv_cache_memory_gb)


async def run_ar_worker(ctx: WorkerContext, model: str) -> None:
    from models.registry import get_model, load_engine
    from workers.runtime import StopRequested, configure_torch, engine_start_lock

    configure_torch(ctx.settings)
    spec = get_model(model, ctx.settings)
    try:
        # AR workers may share this machine's GPU: one at a time while an engine profiles its memory
        lock = engine_start_lock(ctx.settings, ctx.stop) if measures_memory_at_start(ctx.settings) else nullcontext()
        async with lock:
            engine = await asyncio.to_thread(load_engine, spec, ctx.settings)
            await engine.start()
    except StopRequested:
        log.info("AR worker for %s stopped before its engine started", model)
        return
    synth = await asyncio.to_thread(SegmentSynthesizer.for_model, spec, ctx.settings, engine)
    try:
        reserved = min(ctx.settings.interactive_slots, engine.max_num_seqs - 1)
        await ARWorker(ctx, model, synth, engine.max_num_seqs - reserved, interactive_slots=reserved).run()
    finally:
        await engine.shutdown()
