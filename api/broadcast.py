"""Live streams shared by their listeners: one encode per (job, chapter, format) in an API process.

The first listener of a job's stream starts a broadcast: a task that reads the job's audio as it
renders (jobs/live.py), encodes it (jobs/progressive.py) and keeps the bytes. Every listener of the
same stream reads those bytes from the beginning at its own pace, so a second listener costs a copy,
not an encode. Bounds: the broadcast runs at most ``ahead_bytes`` ahead of its fastest listener
(a finished book is not encoded faster than anyone hears it), and keeps at most ``buffer_bytes``:
past that it lets go of what every listener has read, and a newcomer starts a broadcast of its own
(it could not hear the beginning from this one). The last listener to leave stops it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)


@dataclass
class Broadcast:
    produce: Callable[[], AsyncIterator[bytes]]
    buffer_bytes: int
    ahead_bytes: int
    #: Bytes let go of (every listener had read them): ``chunks[0]`` starts there.
    base: int = 0
    chunks: list[bytes] = field(default_factory=list)
    size: int = 0  # bytes produced
    ended: bool = False
    error: BaseException | None = None
    positions: dict[int, int] = field(default_factory=dict)  # listener -> bytes read
    _changed: asyncio.Condition = field(default_factory=asyncio.Condition)
    _task: asyncio.Task | None = None
    _next_listener: int = 0
    on_idle: Callable[[Broadcast], None] | None = None

    @property
    def joinable(self) -> bool:
        """A newcomer hears it from the beginning: nothing was let go of yet."""
        return self.base == 0 and self.error is None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        try:
            async for data in self.produce():
                if not data:
                    continue
                async with self._changed:
                    self.chunks.append(data)
                    self.size += len(data)
                    self._trim()
                    self._changed.notify_all()
                    # pace: no further than ahead_bytes beyond the fastest listener
                    await self._changed.wait_for(
                        lambda: not self.positions or self.size - max(self.positions.values()) <= self.ahead_bytes
                    )
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - every listener hears of it
            log.warning("live stream failed: %s", exc)
            self.error = exc
        finally:
            async with self._changed:
                self.ended = True
                self._changed.notify_all()

    def _trim(self) -> None:
        """Let go of the oldest chunks every listener has read, while over the buffer's bound."""
        slowest = min(self.positions.values(), default=self.size)
        while self.chunks and self.size - self.base > self.buffer_bytes and self.base + len(self.chunks[0]) <= slowest:
            self.base += len(self.chunks.pop(0))

    async def listen(self) -> AsyncIterator[bytes]:
        """The stream's bytes from its beginning, as they are made; raises the broadcast's error."""
        me, self._next_listener = self._next_listener, self._next_listener + 1
        self.positions[me] = self.base
        index = 0  # into chunks, at positions[me]
        try:
            while True:
                async with self._changed:
                    await self._changed.wait_for(lambda: self._readable(me) or self.ended)
                    if not self._readable(me):
                        if self.error is not None:
                            raise self.error
                        return
                    index = self._index_of(self.positions[me])
                    data = b"".join(self.chunks[index:])
                    self.positions[me] += len(data)
                    self._trim()
                    self._changed.notify_all()
                yield data
        finally:
            self.positions.pop(me, None)
            if not self.positions:
                await self.stop()

    def _readable(self, listener: int) -> bool:
        return self.positions[listener] < self.size

    def _index_of(self, position: int) -> int:
        offset, i = self.base, 0
        while i < len(self.chunks) and offset + len(self.chunks[i]) <= position:
            offset += len(self.chunks[i])
            i += 1
        return i

    async def stop(self) -> None:
        if self.on_idle is not None:
            self.on_idle(self)
        if self._task is not None and not self._task.done():
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


class BroadcastHub:
    """This process's broadcasts, by stream key; a newcomer joins a joinable one or starts one."""

    def __init__(self, buffer_bytes: int, ahead_bytes: int) -> None:
        self.buffer_bytes, self.ahead_bytes = buffer_bytes, ahead_bytes
        self._live: dict[tuple, Broadcast] = {}
        self.encodes_started = 0

    def listen(self, key: tuple, produce: Callable[[], AsyncIterator[bytes]]) -> AsyncIterator[bytes]:
        broadcast = self._live.get(key)
        if broadcast is None or not broadcast.joinable or (broadcast.ended and broadcast.error is not None):
            broadcast = Broadcast(produce, self.buffer_bytes, self.ahead_bytes)
            broadcast.on_idle = lambda b, key=key: self._forget(key, b)
            self._live[key] = broadcast
            self.encodes_started += 1
            broadcast.start()
        return broadcast.listen()

    def _forget(self, key: tuple, broadcast: Broadcast) -> None:
        if self._live.get(key) is broadcast:
            del self._live[key]

    def listeners(self, key: tuple) -> int:
        broadcast = self._live.get(key)
        return len(broadcast.positions) if broadcast is not None else 0
