"""The API's event fan-out (api/sse.py): one reader per followed job, every subscriber gets every
event after its resume point, in order, once; a failing feed ends every stream with an error."""

from __future__ import annotations

import asyncio

import fakeredis

from api import sse
from api.sse import FAILED, EventHub, event_stream
from fleet.names import Names
from jobs.model import EventType
from jobs.store import JobStore


def store() -> JobStore:
    return JobStore(fakeredis.FakeAsyncRedis(), Names("t"), events_maxlen=10_000, result_ttl_s=60)


async def add(st: JobStore, job_id: str, kind: EventType, n: int) -> list[str]:
    await st.redis.hset(st.names.job(job_id), mapping={"status": "running"})
    ids = []
    for i in range(n):
        pipe = st.redis.pipeline()
        st._event(pipe, job_id, kind, {"i": i})
        ids.append((await pipe.execute())[0].decode())
    return ids


async def collect(hub: EventHub, job_id: str, after: str = "0-0") -> list[str]:
    return [e.id for e in [x async for x in hub.events(job_id, after)] if e is not FAILED]


async def done(st: JobStore, job_id: str) -> str:
    pipe = st.redis.pipeline()
    st._event(pipe, job_id, EventType.DONE, {})
    return (await pipe.execute())[0].decode()


async def until(condition) -> None:
    """Waits for what the feed's task does in the background (a busy machine takes its time)."""
    for _ in range(1000):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the feed never got there")


def test_many_subscribers_share_one_reader_and_get_every_event_once_in_order():
    async def main():
        st = store()
        hub = EventHub(st)
        early = await add(st, "j", EventType.SEGMENT, 5)
        reads = 0
        original = st.read_events

        async def counting(*a, **kw):
            nonlocal reads
            if kw.get("block_ms"):
                reads += 1
            return await original(*a, **kw)

        st.read_events = counting
        followers = [asyncio.create_task(collect(hub, "j")) for _ in range(50)]
        late = asyncio.create_task(collect(hub, "j", early[2]))  # resumes after the third event
        for _ in range(500):  # the followers have subscribed (a busy machine takes its time)
            await asyncio.sleep(0.01)
            if hub.feeds:
                break
        await asyncio.sleep(0.05)
        assert len(hub.feeds) == 1
        more = await add(st, "j", EventType.SEGMENT, 5)
        pipe = st.redis.pipeline()
        st._event(pipe, "j", EventType.DONE, {})
        done = (await pipe.execute())[0].decode()
        results = await asyncio.gather(*followers)
        return early, more, done, results, await late, reads, hub

    early, more, done, results, late, reads, hub = asyncio.run(main())
    assert all(r == early + more + [done] for r in results)
    assert late == early[3:] + more + [done]
    assert reads <= 12  # blocking reads of the one feed, not one per subscriber
    assert hub.feeds == {}  # the job ended: its feed stopped


def test_a_failing_feed_ends_every_stream_with_an_error_event():
    async def main():
        st = store()
        await add(st, "j", EventType.SEGMENT, 1)
        hub = EventHub(st)
        original = st.read_events

        async def broken(*a, **kw):
            if kw.get("block_ms"):
                raise ConnectionError("Redis went away")
            return await original(*a, **kw)

        st.read_events = broken

        async def follow():
            return [x async for x in event_stream(hub, "j", "0-0")]

        return await asyncio.gather(*(follow() for _ in range(3)))

    for stream in asyncio.run(main()):
        assert [e.get("event") for e in stream] == ["segment", "error"]
        assert "reconnect with Last-Event-ID" in stream[-1]["data"]


def test_the_last_subscriber_leaving_stops_the_feed():
    async def main():
        st = store()
        await add(st, "j", EventType.SEGMENT, 1)
        hub = EventHub(st)
        stream = hub.events("j", "0-0")
        first = await stream.__anext__()
        assert len(hub.feeds) == 1
        await stream.aclose()  # the client went away
        await asyncio.sleep(0)
        return first, hub

    first, hub = asyncio.run(main())
    assert first.type == EventType.SEGMENT and hub.feeds == {}


def test_a_subscriber_cut_off_for_falling_behind_resumes_without_a_gap(monkeypatch):
    monkeypatch.setattr(sse, "SUBSCRIBER_BACKLOG", 3)

    async def main():
        st = store()
        hub = EventHub(st)
        first = await add(st, "j", EventType.SEGMENT, 1)
        stream = hub.events("j", "0-0")
        got = [(await stream.__anext__()).id]  # replayed; it has joined the feed
        feed = hub.feeds["j"]
        more = await add(st, "j", EventType.SEGMENT, 5)  # more than its backlog while it reads nothing
        await until(lambda: not feed.subscribers)  # the feed cut it off
        async for item in stream:
            if item is FAILED:
                break
            got.append(item.id)
        else:
            raise AssertionError("the stream ended without FAILED")
        end = await done(st, "j")
        resumed = await collect(hub, "j", got[-1])  # the client reconnects with Last-Event-ID
        return first + more + [end], got, resumed

    every, got, resumed = asyncio.run(main())
    assert got + resumed == every  # nothing skipped, nothing twice


def test_a_subscriber_gets_what_the_feed_hands_out_while_it_joins():
    async def main():
        st = store()
        hub = EventHub(st)
        first = await add(st, "j", EventType.SEGMENT, 1)
        follower = hub.events("j", "0-0")
        await follower.__anext__()  # a first subscriber: the feed runs
        feed = hub.feeds["j"]
        original = st.last_event_id
        meanwhile: list[str] = []

        async def then_the_feed_hands_out_an_event(job_id):  # a busy loop resumes the reader late
            newest = await original(job_id)
            if not meanwhile:
                meanwhile.extend(await add(st, "j", EventType.SEGMENT, 1))
                await until(lambda: feed.after == meanwhile[0])
            return newest

        st.last_event_id = then_the_feed_hands_out_an_event
        late = asyncio.create_task(collect(hub, "j", first[0]))  # resumes after the newest event
        await until(lambda: len(feed.subscribers) == 2)
        end = await done(st, "j")
        got = await asyncio.wait_for(late, 10)
        await follower.aclose()
        return meanwhile + [end], got

    expected, got = asyncio.run(main())
    assert got == expected
