"""Live streams shared by their listeners (api/broadcast.py): one encode per stream, every listener
from the beginning, paced by the fastest listener, bounded, stopped by the last one to leave."""

from __future__ import annotations

import asyncio

import pytest

from api.broadcast import BroadcastHub


class Producer:
    """An encode: ``n`` pieces of ``size`` bytes, as fast as it is let; counts its runs."""

    def __init__(self, n: int, size: int = 100) -> None:
        self.n, self.size, self.runs, self.made, self.stopped = n, size, 0, 0, 0

    async def __call__(self):
        self.runs += 1
        try:
            for i in range(self.n):
                self.made += 1
                yield bytes([i % 256]) * self.size
                await asyncio.sleep(0)
        finally:
            self.stopped += 1


async def drain(stream, limit: int | None = None) -> bytes:
    out = bytearray()
    async for data in stream:
        out += data
        if limit is not None and len(out) >= limit:
            break
    return bytes(out)


def test_listeners_of_one_stream_share_one_encode_and_hear_it_from_the_start():
    async def main():
        hub, produce = BroadcastHub(buffer_bytes=1 << 20, ahead_bytes=1 << 20), Producer(50)
        first = hub.listen(("job", 1, "mp3"), produce)
        head = await first.__anext__()  # the first listener is under way
        second = hub.listen(("job", 1, "mp3"), produce)
        a, b = await asyncio.gather(drain(first), drain(second))
        other = await drain(hub.listen(("job", 2, "mp3"), produce))  # another chapter: its own encode
        return produce, head + a, b, other, hub

    produce, a, b, other, hub = asyncio.run(main())
    expected = b"".join(bytes([i]) * 100 for i in range(50))
    assert a == b == other == expected
    assert produce.runs == 2 and hub.encodes_started == 2


def test_the_encode_runs_no_further_ahead_than_the_fastest_listener():
    async def main():
        hub, produce = BroadcastHub(buffer_bytes=1 << 20, ahead_bytes=1000), Producer(1000)
        stream = hub.listen(("job", 1, "mp3"), produce)
        await drain(stream, limit=500)  # the listener reads 500 bytes, then stops reading
        for _ in range(50):
            await asyncio.sleep(0)
        made = produce.made
        await stream.aclose()  # the last listener leaves: the encode stops
        await asyncio.sleep(0)
        return made, produce

    made, produce = asyncio.run(main())
    assert made * 100 <= 500 + 1000 + 2 * 100  # read + ahead (+ a piece being made)
    assert produce.stopped == 1


def test_past_its_buffer_a_stream_is_not_joined_and_a_newcomer_starts_its_own():
    async def main():
        hub, produce = BroadcastHub(buffer_bytes=1000, ahead_bytes=500), Producer(100)
        early = hub.listen(("job", 1, "mp3"), produce)
        await drain(early, limit=3000)  # it has let go of the first bytes: nobody needs them
        late = await drain(hub.listen(("job", 1, "mp3"), produce))
        rest = await drain(early)
        return late, rest, produce, hub

    late, rest, produce, hub = asyncio.run(main())
    expected = b"".join(bytes([i]) * 100 for i in range(100))
    assert late == expected  # from the beginning, from an encode of its own
    assert produce.runs == 2 and hub.encodes_started == 2
    assert len(rest) >= len(expected) - 3000 - 100


def test_a_failed_encode_reaches_every_listener():
    async def broken():
        yield b"x" * 10
        raise RuntimeError("the encoder broke")

    async def main():
        hub = BroadcastHub(buffer_bytes=1 << 20, ahead_bytes=1 << 20)
        return await drain(hub.listen(("job", 1, "mp3"), broken))

    with pytest.raises(RuntimeError, match="the encoder broke"):
        asyncio.run(main())
