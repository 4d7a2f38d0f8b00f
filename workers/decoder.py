"""Stage 1, the decoder worker: code chunks in, delta PCM out.

Reads up to ``decode_batch`` chunks at a time (from any job), decodes windows of equal length as one
batch, trims each window's left context and look-ahead, and publishes only the new samples (I1).
A chunk carries all the context it needs, so the decoder keeps no per-request state (I5) and any
decoder can take any chunk. Chunks of jobs that ended are dropped undecoded.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from fleet.messages import AudioChunk, CodeChunk, MessageError, header_of
from fleet.names import DECODER_GROUP
from models.snac_codec import to_pcm16
from workers.consumer import Delivery
from workers.runtime import WorkerContext, every, heartbeat, resilient_loop

log = logging.getLogger(__name__)


class Codec(Protocol):
    sample_rate: int

    def decode_windows(self, windows: list[tuple[np.ndarray, int, int]]) -> list[np.ndarray]: ...


def decode_chunks(codecs: dict[str, Codec], chunks: list[CodeChunk]) -> list[AudioChunk]:
    """The compute: each chunk's new audio, batched per model (no Redis here)."""
    out: dict[int, AudioChunk] = {}
    by_model: dict[str, list[int]] = {}
    for i, chunk in enumerate(chunks):
        by_model.setdefault(chunk.model, []).append(i)
    for model, idx in by_model.items():
        codec = codecs[model]
        audio = codec.decode_windows([(chunks[i].frames, chunks[i].left, chunks[i].right) for i in idx])
        for i, samples in zip(idx, audio, strict=True):
            c = chunks[i]
            out[i] = AudioChunk(
                c.job_id, c.segment, c.attempt, c.seq, c.final, codec.sample_rate, to_pcm16(samples), c.retry
            )
    return [out[i] for i in range(len(chunks))]


def _holds_a_first_segment(deliveries: list[Delivery]) -> bool:
    """A job's first segment is what a listener waits for (time to first audio): never held back
    to fill a batch. Later segments are ready long before they are played."""
    # the header only (the batch is parsed in full once, in process()); unreadable: dealt with at once
    return any((header_of(d.fields) or {}).get("segment", 0) == 0 for d in deliveries)


@dataclass
class DecodeStats:
    """What the decoder did since the last log line: is it keeping up, and how well does it batch?"""

    batches: int = 0
    chunks: int = 0
    audio_s: float = 0.0
    busy_s: float = 0.0  # decoding (compute and device waits), not waiting for chunks

    def line(self, elapsed_s: float) -> str:
        return (
            f"decoder: {self.chunks} chunks in {self.batches} batches ({self.chunks / max(self.batches, 1):.1f} "
            f"per batch), {self.audio_s:.1f} s of audio, busy {self.busy_s / elapsed_s:.0%} of "
            f"{elapsed_s:.0f} s ({self.audio_s / max(self.busy_s, 1e-9):.0f}x real time while busy)"
        )


class DecoderWorker:
    def __init__(self, ctx: WorkerContext, codecs: dict[str, Codec]) -> None:
        self.ctx = ctx
        self.codecs = codecs
        self.consumer = ctx.consumer([ctx.names.codes(m) for m in codecs], DECODER_GROUP, "decoder")
        self.stats = DecodeStats()
        self._stats_since = time.monotonic()

    async def _log_stats(self) -> None:
        now = time.monotonic()
        if self.stats.batches:
            log.info(self.stats.line(now - self._stats_since))
        self.stats, self._stats_since = DecodeStats(), now

    async def run(self) -> None:
        chores = [
            asyncio.create_task(self.consumer.lease_loop(self.ctx.stop)),
            asyncio.create_task(heartbeat(self.ctx, "decoder", list(self.codecs))),
            asyncio.create_task(every(10.0, self.ctx.stop, self._log_stats, "decoder stats line")),
        ]
        log.info("decoder for %s", ", ".join(self.codecs))
        try:
            await resilient_loop(self._step, self.ctx, self.consumer, "decoder")
        finally:
            for chore in chores:
                chore.cancel()
            await asyncio.gather(*chores, return_exceptions=True)

    async def _step(self) -> None:
        s = self.ctx.settings
        deliveries = await self.consumer.next_batch(
            s.decode_batch, s.block_ms, s.decode_linger_s(), urgent=_holds_a_first_segment
        )
        if deliveries:
            await self.process(deliveries)  # idempotent: a batch interrupted by an outage is redone
        self.consumer.batch_done()

    async def process(self, deliveries: list[Delivery]) -> None:
        # 1) parse; unreadable entries are dead-lettered and fail their job
        work: list[tuple[Delivery, CodeChunk]] = []
        for d in deliveries:
            try:
                chunk = CodeChunk.decode(d.fields)
                if chunk.model not in self.codecs:
                    raise MessageError(f"this decoder does not serve model {chunk.model!r}")
                work.append((d, chunk))
            except MessageError as exc:
                job_id = await self.consumer.dead_letter(d, f"unreadable code chunk: {exc}")
                if job_id:
                    await self.ctx.store.fail(job_id, f"a code chunk could not be read: {exc}")
        # 2) drop chunks of jobs that ended (cancelled, failed) or vanished
        statuses = await self.ctx.store.statuses({c.job_id for _, c in work})
        dropped = [d for d, c in work if statuses[c.job_id] is None or statuses[c.job_id].terminal]
        work = [(d, c) for d, c in work if not (statuses[c.job_id] is None or statuses[c.job_id].terminal)]
        # 3) decode in a thread (the event loop keeps renewing leases), 4) publish, then 5) ack
        if work:
            started = time.perf_counter()
            try:
                audio = await asyncio.to_thread(decode_chunks, self.codecs, [c for _, c in work])
            except Exception:  # noqa: BLE001 - leave the batch pending: it is redelivered, then dead-lettered
                log.exception("decoding a batch of %d chunks failed", len(work))
                self.consumer.release(*(d for d, _ in work))
                await self.consumer.ack(*dropped)
                return
            stats = self.stats
            stats.busy_s += time.perf_counter() - started
            stats.batches += 1
            stats.chunks += len(audio)
            stats.audio_s += sum(len(a.pcm) // 2 / a.sample_rate for a in audio)
            pipe = self.ctx.redis.pipeline(transaction=False)
            for chunk in audio:
                pipe.xadd(self.ctx.names.audio(), chunk.encode())
            await pipe.execute()
        await self.consumer.ack(*dropped, *(d for d, _ in work))


async def run_decoder_worker(ctx: WorkerContext, models: list[str]) -> None:
    from models.registry import get_model, load_codec
    from workers.runtime import configure_torch

    configure_torch(ctx.settings)
    codecs = {}
    for model in models:
        codecs[model] = await asyncio.to_thread(load_codec, get_model(model, ctx.settings), ctx.settings)
    await DecoderWorker(ctx, codecs).run()
