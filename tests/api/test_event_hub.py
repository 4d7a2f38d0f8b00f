"""The API's event fan-out (api/sse.py): one reader per followed job, every subscriber gets every
event after its resume point, in order, once; a failing feed ends every stream with an error."""

from __future__ import annotations

import asyncio

import fakeredis

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
