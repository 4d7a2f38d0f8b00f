"""How a stage gets its work and hands on its output: the transport, apart from any compute.

``RedisStreams`` reads a stage's streams through a consumer group. At-least-once delivery: an entry
stays pending until ``ack``; while this worker holds it, a lease task keeps its idle time low (XCLAIM
JUSTID to ourselves); when a worker dies its entries go idle and any live consumer takes them over
with XAUTOCLAIM. ``ack`` also deletes the entry (each stream has one group), so streams hold only
unfinished work. ``retry_later`` and ``hand_back`` set an entry's idle time (XCLAIM ... IDLE) so
that it is taken over after the backoff, or at once.

``MemoryTransport`` is the same contract over a ``MemoryBroker`` (dramatiq's stub broker): unit tests
run a stage's real loop, with its deliveries, retries, dead letters and outputs, without a Redis server.

What to do with an entry (ack, retry, dead-letter) is decided by workers/errors.py, never here.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import socket
import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from fleet.messages import DeadLetter, Fields, job_id_of
from fleet.redis import is_cluster

log = logging.getLogger(__name__)

#: Entries kept in the dead-letter stream (capped: it is for operators, not a store of record).
DEAD_LETTERS_MAXLEN = 100_000
#: A lingering batch looks for more entries this often (an urgent one then ends the wait).
LINGER_SLICE_S = 0.025
#: On a Redis Cluster a consumer of streams in several slots blocks on one slot at a time: this long
#: for all its slots in turn (what work arriving in another slot may wait), milliseconds.
CLUSTER_BLOCK_SLICE_MS = 100


@dataclass(frozen=True, slots=True)
class Delivery:
    stream: str
    entry_id: bytes
    fields: Fields
    deliveries: int  # 1 for a first delivery


def consumer_name(kind: str) -> str:
    return f"{kind}-{socket.gethostname()}-{os.getpid()}"


class Transport(ABC):
    """What a stage needs from the streams it reads and writes. The batch in hand survives a Redis
    outage: ``next_batch`` returns it again until ``batch_done`` (its leases are still ours; every
    handler is idempotent)."""

    name: str
    streams: list[str]
    _batch: list[Delivery]

    @abstractmethod
    async def setup(self) -> None: ...

    @abstractmethod
    async def read(self, count: int, block_ms: int | None) -> list[Delivery]:
        """Up to ``count`` entries (waiting up to ``block_ms`` for one; None: not at all)."""

    @abstractmethod
    async def ack(self, *deliveries: Delivery) -> None: ...

    @abstractmethod
    async def retry_later(self, delivery: Delivery, delay_s: float) -> None:
        """Stop holding the entry; it is redelivered (to any consumer) about ``delay_s`` from now."""

    @abstractmethod
    async def dead_letter(self, delivery: Delivery, error: str) -> None:
        """Move the entry to the dead-letter stream (failing its job is the stage's part)."""

    @abstractmethod
    async def hand_back(self) -> int:
        """Give up every held entry at once (stopping): any live consumer takes it over now."""

    @abstractmethod
    async def publish(self, stream: str, entries: list[Fields]) -> None: ...

    @abstractmethod
    async def backlog(self, groups: list[list[str]]) -> int:
        """The most entries any group of streams holds, its streams summed (a stage's shards)."""

    @abstractmethod
    async def lease_loop(self, stop: asyncio.Event) -> None: ...

    async def next_batch(
        self,
        count: int,
        block_ms: int | None,
        linger_s: float = 0.0,
        urgent: Callable[[list[Delivery]], bool] | None = None,
    ) -> list[Delivery]:
        """The batch to work on: the unfinished one again if an outage interrupted it, else a fresh
        read of up to ``count`` entries.

        ``linger_s``: a short fresh batch waits this long once for more entries (bigger batches for
        batched work), unless ``urgent`` says it must go at once."""
        if not self._batch:
            batch = await self.read(count, block_ms)
            if batch and linger_s > 0:
                # in slices, so that an urgent entry arriving meanwhile ends the wait at once
                loop = asyncio.get_running_loop()
                until = loop.time() + linger_s
                while len(batch) < count and not (urgent and urgent(batch)) and (left := until - loop.time()) > 0:
                    await asyncio.sleep(min(left, LINGER_SLICE_S))
                    batch += await self.read(count - len(batch), None)
            self._batch = batch
        return self._batch

    def batch_done(self) -> None:
        self._batch = []


def _dead_letter_fields(delivery: Delivery, error: str) -> Fields:
    return DeadLetter(
        stream=delivery.stream,
        entry_id=delivery.entry_id.decode(),
        job_id=job_id_of(delivery.fields),
        error=error,
        deliveries=delivery.deliveries,
        original=delivery.fields.get(b"h", b""),
    ).encode()


class RedisStreams(Transport):
    def __init__(
        self,
        redis: aioredis.Redis,
        streams: list[str],
        group: str,
        name: str,
        *,
        dead_letter_stream: str,
        reclaim_idle_ms: int,
        admit: Callable[[int], Awaitable[int]] | None = None,
    ) -> None:
        self.redis = redis
        #: Before reading new entries: have the scheduler fill the streams (jobs/scheduler.py).
        self.admit = admit
        self.streams = streams
        self.group = group
        self.name = name
        self.dead_letter_stream = dead_letter_stream
        self.reclaim_idle_ms = reclaim_idle_ms
        self.held: set[tuple[str, bytes]] = set()  # entries this consumer is working on
        self._last_reclaim = 0.0
        self._batch = []
        self._by_slot: list[list[str]] | None = None
        self._turn = 0

    async def setup(self) -> None:
        for stream in self.streams:
            try:
                await self.redis.xgroup_create(stream, self.group, id="0", mkstream=True)
            except ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    async def read(self, count: int, block_ms: int | None) -> list[Delivery]:
        """Up to ``count`` entries: first those reclaimed from dead consumers (or released for a
        retry), then new ones (waiting up to ``block_ms`` for one; None: not at all)."""
        if count <= 0:
            return []
        out = await self._reclaim(count)
        if len(out) < count:
            if self.admit is not None:
                await self.admit(count - len(out))
            out += await self._read_new(count - len(out), None if out else block_ms)
        self.held.update((d.stream, d.entry_id) for d in out)
        return out

    async def _xreadgroup(self, streams: list[str], count: int, block_ms: int | None) -> list[Delivery]:
        reply = await self.redis.xreadgroup(
            self.group, self.name, {s: ">" for s in streams}, count=count, block=block_ms
        )
        return [
            Delivery(stream.decode(), entry_id, fields, 1)
            for stream, entries in reply or []
            for entry_id, fields in entries
        ]

    async def _read_new(self, count: int, block_ms: int | None) -> list[Delivery]:
        """New entries: one XREADGROUP over every stream on one server. On a cluster a read names one
        slot's streams only: each slot in turn, starting one further at every read (no shard is
        favoured); when all are empty, a short blocking read on each in turn until ``block_ms``."""
        slots = self._slots()
        if len(slots) == 1:
            return await self._xreadgroup(slots[0], count, block_ms)
        self._turn = (self._turn + 1) % len(slots)
        order = slots[self._turn :] + slots[: self._turn]
        out: list[Delivery] = []
        for streams in order:
            out += await self._xreadgroup(streams, count - len(out), None)
            if len(out) >= count:
                return out
        if out or block_ms is None:
            return out
        loop = asyncio.get_running_loop()
        until = loop.time() + (block_ms / 1000 if block_ms else float("inf"))  # 0: for ever, as BLOCK 0
        slice_ms = max(CLUSTER_BLOCK_SLICE_MS // len(order), 5)
        while (left := until - loop.time()) > 0:
            for streams in order:
                if out := await self._xreadgroup(streams, count, max(int(min(slice_ms, left * 1000)), 1)):
                    return out
        return out

    def _slots(self) -> list[list[str]]:
        """The streams grouped by Redis Cluster slot (one group on one server)."""
        if self._by_slot is None:
            if is_cluster(self.redis):
                groups: dict[int, list[str]] = {}
                for stream in self.streams:
                    groups.setdefault(self.redis.keyslot(stream), []).append(stream)
                self._by_slot = list(groups.values())
            else:
                self._by_slot = [self.streams]
        return self._by_slot

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

    async def _set_idle(self, deliveries: list[tuple[str, bytes]], idle_ms: int) -> None:
        """Claim entries to ourselves with this idle time (XCLAIM ... IDLE JUSTID: the delivery count
        stays): the next XAUTOCLAIM of any consumer takes them once they are ``reclaim_idle_ms`` idle."""
        by_stream: dict[str, list[bytes]] = {}
        for stream, entry_id in deliveries:
            by_stream.setdefault(stream, []).append(entry_id)
            self.held.discard((stream, entry_id))
        for stream, ids in by_stream.items():
            await self.redis.xclaim(
                stream, self.group, self.name, min_idle_time=0, message_ids=ids, idle=idle_ms, justid=True
            )

    async def retry_later(self, delivery: Delivery, delay_s: float) -> None:
        idle = max(self.reclaim_idle_ms - int(delay_s * 1000), 0)
        await self._set_idle([(delivery.stream, delivery.entry_id)], idle)

    async def hand_back(self) -> int:
        """Give up every held entry at once (stopping): its idle time is set past ``reclaim_idle_ms``,
        so any live consumer takes it over without waiting for the lease to run out."""
        held = list(self.held)
        await self._set_idle(held, self.reclaim_idle_ms + 1)
        return len(held)

    async def dead_letter(self, delivery: Delivery, error: str) -> None:
        """Move an entry to the dead-letter stream (failing its job is the stage's part)."""
        fields = _dead_letter_fields(delivery, error)
        await self.redis.xadd(self.dead_letter_stream, fields, maxlen=DEAD_LETTERS_MAXLEN, approximate=True)
        await self.ack(delivery)
        log.error("dead-lettered %s %s: %s", delivery.stream, delivery.entry_id.decode(), error)

    async def publish(self, stream: str, entries: list[Fields]) -> None:
        pipe = self.redis.pipeline(transaction=False)
        for fields in entries:
            pipe.xadd(stream, fields)
        await pipe.execute()

    async def backlog(self, groups: list[list[str]]) -> int:
        pipe = self.redis.pipeline(transaction=False)
        for stream in (s for group in groups for s in group):
            pipe.xlen(stream)
        lengths = iter(await pipe.execute())
        return max((sum(next(lengths) for _ in group) for group in groups), default=0)

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


@dataclass
class _Entry:
    entry_id: bytes
    fields: Fields
    deliveries: int = 0
    due: float = 0.0  # monotonic time from which it may be delivered (again)
    held: bool = False


@dataclass
class MemoryBroker:
    """Streams in memory, for unit tests: ``put`` entries, run stages over ``transport(streams)``
    views of it (one stage's output is the next one's input), then read ``published``, ``dead`` and
    ``pending``. One process, no leases: nothing can die here."""

    entries: dict[str, list[_Entry]] = field(default_factory=dict)
    #: Everything published per stream, acknowledged or not.
    published: dict[str, list[Fields]] = field(default_factory=dict)
    dead: list[DeadLetter] = field(default_factory=list)
    _ids: itertools.count = field(default_factory=lambda: itertools.count(1))

    def put(self, stream: str, fields: Fields) -> bytes:
        entry_id = f"{next(self._ids)}-0".encode()
        self.entries.setdefault(stream, []).append(_Entry(entry_id, fields))
        return entry_id

    def pending(self, stream: str | None = None) -> int:
        """Entries not yet acknowledged (waiting, held or due for a retry)."""
        streams = [stream] if stream else list(self.entries)
        return sum(len(self.entries.get(s, [])) for s in streams)

    def transport(self, streams: list[str], name: str = "memory") -> MemoryTransport:
        return MemoryTransport(self, streams, name)


class MemoryTransport(Transport):
    """The transport contract over a ``MemoryBroker``: retries come back after their delay,
    ``hand_back`` makes held entries due at once."""

    def __init__(self, broker: MemoryBroker, streams: list[str], name: str = "memory") -> None:
        self.broker = broker
        self.streams = streams
        self.name = name
        self._batch = []

    async def setup(self) -> None:
        for stream in self.streams:
            self.broker.entries.setdefault(stream, [])

    async def read(self, count: int, block_ms: int | None) -> list[Delivery]:
        deadline = time.monotonic() + (block_ms or 0) / 1000
        while True:
            now = time.monotonic()
            out: list[Delivery] = []
            for stream in self.streams:
                for entry in self.broker.entries.get(stream, []):
                    if len(out) < count and not entry.held and entry.due <= now:
                        entry.held, entry.deliveries = True, entry.deliveries + 1
                        out.append(Delivery(stream, entry.entry_id, entry.fields, entry.deliveries))
            if out or count <= 0 or now >= deadline:
                return out
            await asyncio.sleep(0.005)

    def _find(self, delivery: Delivery) -> _Entry | None:
        for entry in self.broker.entries.get(delivery.stream, []):
            if entry.entry_id == delivery.entry_id:
                return entry
        return None

    async def ack(self, *deliveries: Delivery) -> None:
        for d in deliveries:
            if (entry := self._find(d)) is not None:
                self.broker.entries[d.stream].remove(entry)

    async def retry_later(self, delivery: Delivery, delay_s: float) -> None:
        if (entry := self._find(delivery)) is not None:
            entry.held, entry.due = False, time.monotonic() + delay_s

    async def dead_letter(self, delivery: Delivery, error: str) -> None:
        self.broker.dead.append(DeadLetter.decode(_dead_letter_fields(delivery, error)))
        await self.ack(delivery)

    async def hand_back(self) -> int:
        handed = 0
        for stream in self.streams:
            for entry in self.broker.entries.get(stream, []):
                if entry.held:
                    entry.held, entry.due = False, 0.0
                    handed += 1
        return handed

    async def publish(self, stream: str, entries: list[Fields]) -> None:
        self.broker.published.setdefault(stream, []).extend(entries)
        for fields in entries:
            self.broker.put(stream, fields)

    async def backlog(self, groups: list[list[str]]) -> int:
        return max((sum(len(self.broker.entries.get(s, [])) for s in group) for group in groups), default=0)

    async def lease_loop(self, stop: asyncio.Event) -> None:
        await stop.wait()
