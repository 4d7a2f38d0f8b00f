"""Reading a stage's streams through a consumer group: deliveries, leases, reclaim, ack, dead letters.

At-least-once delivery: an entry stays pending until ``ack``; while this worker holds it, a lease
task keeps its idle time low (XCLAIM JUSTID to ourselves); when a worker dies its entries go idle
and any live consumer takes them over with XAUTOCLAIM. ``ack`` also deletes the entry (each stream
has one group), so streams hold only unfinished work. Entries delivered ``max_deliveries`` times
go to the dead-letter stream instead of being processed again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from fleet.messages import DeadLetter, Fields, job_id_of

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Delivery:
    stream: str
    entry_id: bytes
    fields: Fields
    deliveries: int  # 1 for a first delivery


def consumer_name(kind: str) -> str:
    return f"{kind}-{socket.gethostname()}-{os.getpid()}"


class StreamConsumer:
    def __init__(
        self,
        redis: aioredis.Redis,
        streams: list[str],
        group: str,
        name: str,
        *,
        dead_letter_stream: str,
        reclaim_idle_ms: int,
        max_deliveries: int,
    ) -> None:
        self.redis = redis
        self.streams = streams
        self.group = group
        self.name = name
        self.dead_letter_stream = dead_letter_stream
        self.reclaim_idle_ms = reclaim_idle_ms
        self.max_deliveries = max_deliveries
        self.held: set[tuple[str, bytes]] = set()  # entries this consumer is working on
        self._last_reclaim = 0.0
        self._batch: list[Delivery] = []

    async def setup(self) -> None:
        for stream in self.streams:
            try:
                await self.redis.xgroup_create(stream, self.group, id="0", mkstream=True)
            except ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    async def read(self, count: int, block_ms: int | None) -> list[Delivery]:
        """Up to ``count`` entries: first those reclaimed from dead consumers, then new ones
        (waiting up to ``block_ms`` for one; None: not at all)."""
        if count <= 0:
            return []
        out = await self._reclaim(count)
        if len(out) < count:
            reply = await self.redis.xreadgroup(
                self.group,
                self.name,
                {s: ">" for s in self.streams},
                count=count - len(out),
                block=None if out else block_ms,
            )
            for stream, entries in reply or []:
                for entry_id, fields in entries:
                    out.append(Delivery(stream.decode(), entry_id, fields, 1))
        accepted = []
        for delivery in out:
            if delivery.deliveries > self.max_deliveries:
                await self.dead_letter(delivery, f"delivered {delivery.deliveries} times without success")
                continue
            self.held.add((delivery.stream, delivery.entry_id))
            accepted.append(delivery)
        return accepted

    async def next_batch(
        self,
        count: int,
        block_ms: int,
        linger_s: float = 0.0,
        urgent: Callable[[list[Delivery]], bool] | None = None,
    ) -> list[Delivery]:
        """The batch to work on: the unfinished one again if a Redis outage interrupted it (its
        leases are still ours), else a fresh ``read``. Call ``batch_done`` when it is handled.

        ``linger_s``: a short fresh batch waits this long once for more entries (bigger batches
        for batched work), unless ``urgent`` says it must go at once."""
        if not self._batch:
            batch = await self.read(count, block_ms)
            if batch and linger_s > 0 and len(batch) < count and not (urgent and urgent(batch)):
                await asyncio.sleep(linger_s)
                batch += await self.read(count - len(batch), None)
            self._batch = batch
        return self._batch

    def batch_done(self) -> None:
        self._batch = []

    async def _reclaim(self, count: int) -> list[Delivery]:
        loop_time = asyncio.get_running_loop().time()
        # look for idle entries often enough to pick up handed-back work quickly (XAUTOCLAIM is cheap)
        if loop_time - self._last_reclaim < min(self.reclaim_idle_ms / 2000, 5.0):
            return []
        self._last_reclaim = loop_time
        out: list[Delivery] = []
        for stream in self.streams:
            _, entries, _deleted = await self.redis.xautoclaim(
                stream, self.group, self.name, min_idle_time=self.reclaim_idle_ms, start_id="0-0", count=count
            )
            for entry_id, fields in entries:
                if fields is None:  # deleted while pending
                    await self.ack(Delivery(stream, entry_id, {}, 0))
                    continue
                pending = await self.redis.xpending_range(
                    stream, self.group, min=entry_id, max=entry_id, count=1
                )
                times = int(pending[0]["times_delivered"]) if pending else 2
                log.warning("reclaimed %s %s (delivery %d)", stream, entry_id.decode(), times)
                out.append(Delivery(stream, entry_id, fields, times))
        return out

    async def ack(self, *deliveries: Delivery) -> None:
        if not deliveries:
            return
        pipe = self.redis.pipeline(transaction=False)
        for d in deliveries:
            pipe.xack(d.stream, self.group, d.entry_id)
            pipe.xdel(d.stream, d.entry_id)
            self.held.discard((d.stream, d.entry_id))
        await pipe.execute()

    async def hand_back(self) -> int:
        """Give up every held entry at once (graceful shutdown): re-claim each to ourselves with an
        idle time already past ``reclaim_idle_ms`` (XCLAIM ... IDLE), so the next XAUTOCLAIM of any
        live consumer takes it without waiting for the lease to run out."""
        by_stream: dict[str, list[bytes]] = {}
        for stream, entry_id in self.held:
            by_stream.setdefault(stream, []).append(entry_id)
        for stream, ids in by_stream.items():
            await self.redis.xclaim(
                stream,
                self.group,
                self.name,
                min_idle_time=0,
                message_ids=ids,
                idle=self.reclaim_idle_ms + 1,
                justid=True,
            )
        self.held.clear()
        return sum(map(len, by_stream.values()))

    def release(self, *deliveries: Delivery) -> None:
        """Stop renewing these entries' leases: they go idle and are redelivered (to anyone) later."""
        for d in deliveries:
            self.held.discard((d.stream, d.entry_id))

    async def dead_letter(self, delivery: Delivery, error: str) -> str | None:
        """Move an entry to the dead-letter stream; returns its job id (if readable) so it can be failed."""
        job_id = job_id_of(delivery.fields)
        letter = DeadLetter(
            stream=delivery.stream,
            entry_id=delivery.entry_id.decode(),
            job_id=job_id,
            error=error,
            deliveries=delivery.deliveries,
            original=delivery.fields.get(b"h", b""),
        )
        await self.redis.xadd(self.dead_letter_stream, letter.encode(), maxlen=100_000, approximate=True)
        await self.ack(delivery)
        log.error("dead-lettered %s %s: %s", delivery.stream, delivery.entry_id.decode(), error)
        return job_id

    async def renew_leases(self) -> None:
        """Reset the idle time of every held entry, so no one reclaims work that is still going on."""
        by_stream: dict[str, list[bytes]] = {}
        for stream, entry_id in list(self.held):
            by_stream.setdefault(stream, []).append(entry_id)
        for stream, ids in by_stream.items():
            await self.redis.xclaim(
                stream, self.group, self.name, min_idle_time=0, message_ids=ids, justid=True
            )

    async def lease_loop(self, stop: asyncio.Event) -> None:
        interval = max(self.reclaim_idle_ms / 3000, 0.05)
        while not stop.is_set():
            try:
                await self.renew_leases()
            except Exception:  # noqa: BLE001 - a missed renewal only risks a duplicate, never a loss
                log.exception("lease renewal failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval)
