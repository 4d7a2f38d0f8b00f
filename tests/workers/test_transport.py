"""The transport contract, on a real Redis (``RedisStreams``) and in memory (``MemoryTransport``, what
the stage unit tests run on): the same tests, so the memory transport cannot drift from Redis'."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis.asyncio as aioredis

from fleet.messages import DeadLetter
from workers.transport import MemoryBroker, RedisStreams

STREAM = "in"


@pytest.fixture(params=["redis", "memory"])
def transports(request, redis_url, key_prefix):
    """Two consumers of one stream (two workers), each with a reclaim time of 300 ms."""

    def run(scenario):
        async def main():
            if request.param == "memory":
                broker = MemoryBroker()
                a, b = broker.transport([STREAM], "a"), broker.transport([STREAM], "b")
                return await scenario(a, b, broker.put, broker)
            client = aioredis.from_url(redis_url)
            stream = f"{key_prefix}:{STREAM}"

            def make(name):
                return RedisStreams(
                    client, [stream], "g", name, dead_letter_stream=f"{key_prefix}:dead", reclaim_idle_ms=300
                )

            async def put(_stream, fields):
                return await client.xadd(stream, fields)

            a, b = make("a"), make("b")
            try:
                return await scenario(a, b, put, None)
            finally:
                await client.aclose()

        return asyncio.run(main())

    return run


async def maybe(value):
    return await value if asyncio.iscoroutine(value) else value


async def read_within(t, seconds: float, count: int = 10):
    """What ``t`` reads within ``seconds`` (a reclaim scan runs at most every reclaim/2 ms)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        got = await t.read(count, 20)
        if got:
            return got
        await asyncio.sleep(0.02)
    return []


def test_an_acked_entry_is_gone_and_a_batch_is_kept_until_done(transports):
    async def scenario(a, b, put, _broker):
        await a.setup()
        await maybe(put(STREAM, {b"n": b"1"}))
        first = await a.next_batch(5, 50)
        again = await a.next_batch(5, 50)  # an outage interrupted it: the same batch
        await a.ack(*first)
        a.batch_done()
        return first, again, await a.next_batch(5, 50), await read_within(b, 0.5)

    first, again, after, other = transports(scenario)
    assert len(first) == 1 and first == again and first[0].deliveries == 1
    assert after == [] and other == []


def test_retry_later_gives_the_entry_to_any_consumer_after_the_delay(transports):
    async def scenario(a, b, put, _broker):
        await a.setup()
        await maybe(put(STREAM, {b"n": b"1"}))
        (d,) = await a.read(1, 50)
        await a.retry_later(d, 0.25)
        released = time.monotonic()
        early = await read_within(b, 0.1)
        late = await read_within(b, 2.0)
        return early, late, time.monotonic() - released

    early, late, waited = transports(scenario)
    assert early == [] and len(late) == 1 and late[0].deliveries == 2 and waited >= 0.2


def test_hand_back_gives_every_held_entry_away_at_once(transports):
    async def scenario(a, b, put, _broker):
        await a.setup()
        for n in (b"1", b"2"):
            await maybe(put(STREAM, {b"n": n}))
        held = await a.read(5, 50)
        handed = await a.hand_back()
        return held, handed, await read_within(b, 0.5)

    held, handed, taken = transports(scenario)
    assert len(held) == 2 and handed == 2
    assert sorted(d.fields[b"n"] for d in taken) == [b"1", b"2"]


def test_a_dead_letter_records_where_it_came_from_and_leaves_the_stream(transports, key_prefix, redis_url):
    async def scenario(a, b, put, broker):
        await a.setup()
        await maybe(put(STREAM, {b"v": b"1", b"h": b'{"job_id":"j1","segment":3}'}))
        (d,) = await a.read(1, 50)
        await a.dead_letter(d, "it cannot be read")
        if broker is not None:
            letters = broker.dead
        else:
            raw = await a.redis.xrange(f"{key_prefix}:dead")
            letters = [DeadLetter.decode(f) for _, f in raw]
        return letters, await read_within(b, 0.5)

    letters, left = transports(scenario)
    (letter,) = letters
    assert letter.job_id == "j1" and letter.error == "it cannot be read" and letter.deliveries == 1
    assert letter.original == b'{"job_id":"j1","segment":3}' and left == []


def test_publish_and_backlog(transports):
    """A backlog is the most any group of streams (a stage's shards) holds, its streams summed."""

    async def scenario(a, b, put, broker):
        await a.setup()
        target, other = a.streams[0], f"{a.streams[0]}:2"
        await a.publish(target, [{b"x": b"1"}, {b"x": b"2"}])
        await a.publish(other, [{b"x": b"3"}, {b"x": b"4"}, {b"x": b"5"}])
        return await a.backlog([[target]]), await a.backlog([[target], [other]]), await a.backlog(
            [[target, other], [other]]
        ), await a.backlog([])

    assert transports(scenario) == (2, 3, 5, 0)
