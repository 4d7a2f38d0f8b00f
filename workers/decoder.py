"""Stage 1, the decoder worker: code chunks in, delta PCM out.

Reads up to ``decode_batch`` chunks at a time (from any job, any shard), decodes windows of equal
length as one batch, trims each window's left context and look-ahead, and publishes only the new
samples (I1), each to its job's shard of the audio stream.
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

from fleet.messages import AudioChunk, CodeChunk, header_of
from fleet.names import DECODER_GROUP
from models.snac_codec import to_pcm16
from workers import metrics
from workers.errors import PermanentError
from workers.runtime import WorkerContext, every, gpu_memory_peak
from workers.stage import Stage, Work
from workers.transport import Delivery, Transport

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


def _is_first_audio(chunk: CodeChunk) -> bool:
    """A job's very first window: the audio its listener is waiting for."""
    return chunk.segment == 0 and chunk.seq == 0


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
            f"per batch), {self.audio_s:.1f} s of audio, busy {self.busy_s / elapsed_s:.1%} of "
            f"{elapsed_s:.1f} s ({self.audio_s / max(self.busy_s, 1e-9):.0f}x real time while busy)"
        )


class DecoderWorker(Stage[CodeChunk]):
    kind = "decoder"
    group = DECODER_GROUP
    message = CodeChunk
    activity = "decoding"

    def __init__(
        self, ctx: WorkerContext, codecs: dict[str, Codec], transport: Transport | None = None
    ) -> None:
        streams = [ctx.names.codes(m, shard) for m in codecs for shard in ctx.shards]
        super().__init__(ctx, streams, transport=transport, live_models=list(codecs))
        self.codecs = codecs
        self.batch_size = ctx.settings.decode_batch
        self.stats = DecodeStats()
        self._stats_since = time.monotonic()
        log.info("decoder for %s", ", ".join(codecs))

    def chores(self):
        return [*super().chores(), every(10.0, self.ctx.stop, self._log_stats, "decoder stats line")]

    async def _log_stats(self) -> None:
        now = time.monotonic()
        if self.stats.batches:
            log.info(self.stats.line(now - self._stats_since) + gpu_memory_peak())
        self.stats, self._stats_since = DecodeStats(), now

    def check(self, chunk: CodeChunk) -> None:
        if chunk.model not in self.codecs:
            raise PermanentError(f"this decoder does not serve model {chunk.model!r}")

    def linger_s(self) -> float:
        return self.ctx.settings.decode_linger_s()

    def urgent(self, deliveries: list[Delivery]) -> bool:
        return _holds_a_first_segment(deliveries)

    async def process(self, work: list[Work[CodeChunk]]) -> None:
        """Jobs' first windows first (time to first audio), then the rest of the batch."""
        first = [w for w in work if _is_first_audio(w.message)]
        if first and len(first) < len(work):
            await self._process_batch(first)
            work = [w for w in work if not _is_first_audio(w.message)]
        await self._process_batch(work)

    async def _process_batch(self, work: list[Work[CodeChunk]]) -> None:
        """Decode the batch as one; if that fails, chunk by chunk, so that a chunk that cannot be
        decoded fails alone (retried, then dead-lettered) and the others go on."""
        error = await self.attempt(self._decode_and_publish(work))
        if error is None:
            await self.transport.ack(*(w.delivery for w in work))
            return
        if len(work) > 1:
            log.warning(
                "decoding a batch of %d chunks failed (%s); decoding them one by one", len(work), error
            )
            await super().process(work)
            return
        await self.settle(work[0], error)

    async def handle(self, work: Work[CodeChunk]) -> None:
        await self._decode_and_publish([work])

    async def _decode_and_publish(self, work: list[Work[CodeChunk]]) -> None:
        # 1) decode in a thread (the event loop keeps renewing leases), 2) publish the new samples
        started = time.perf_counter()
        audio = await asyncio.to_thread(decode_chunks, self.codecs, [w.message for w in work])
        stats = self.stats
        stats.busy_s += time.perf_counter() - started
        stats.batches += 1
        stats.chunks += len(audio)
        seconds = [a.samples / a.sample_rate for a in audio]
        stats.audio_s += sum(seconds)
        by_shard: dict[int, list] = {}
        for a in audio:
            by_shard.setdefault(self.ctx.shard(a.job_id), []).append(a.encode())
        for shard, entries in by_shard.items():
            await self.transport.publish(self.ctx.names.audio(shard), entries)
        metrics.DECODER_BATCH.observe(len(audio))
        for w, s in zip(work, seconds, strict=True):
            metrics.AUDIO_PRODUCED.labels(self.kind, w.message.model).inc(s)


async def run_decoder_worker(ctx: WorkerContext, models: list[str]) -> None:
    from models.registry import get_model, load_codec
    from workers.runtime import configure_torch, limit_gpu_memory

    configure_torch(ctx.settings)
    limited = limit_gpu_memory(ctx.settings.decoder_gpu_memory_gb, ctx.settings.device)
    if limited:
        log.info("decoder GPU memory limited to %s", limited)
    codecs = {}
    for model in models:
        codecs[model] = await asyncio.to_thread(load_codec, get_model(model, ctx.settings), ctx.settings)
    await DecoderWorker(ctx, codecs).run()
