"""A job's events as server-sent events: the events stream's entry ids are the SSE ids, so a client
that reconnects with Last-Event-ID gets exactly what it missed.

However many clients follow one job, an API process reads its events once: ``EventHub`` keeps one
``Feed`` per followed job (one blocking XREAD, one Redis connection) that hands each new event to
every subscriber. A subscriber first joins the feed, then replays what came before from the stream
(non-blocking reads), and skips the feed's events it already has; so it misses nothing and sees
nothing twice. A feed that fails hands the failure to every subscriber, whose streams end with an
``error`` event, never a hang; a feed nobody follows any more stops.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import AsyncIterator

from jobs.errors import InvalidEventId, quoted
from jobs.store import Event, JobStore

log = logging.getLogger(__name__)

#: Two 64-bit unsigned integers: ASCII digits only (``\d`` takes any script's, ``$`` a trailing newline), and
#: at most 20 of them, so int() never meets a number too long to convert.
_EVENT_ID = re.compile(r"[0-9]{1,20}-[0-9]{1,20}")
#: Events a slow subscriber may have waiting before it is cut off (it reconnects with Last-Event-ID).
SUBSCRIBER_BACKLOG = 10_000


def resume_point(last_event_id: str | None, after: str | None) -> str:
    """Where a stream starts: after the client's last event (header or query), else the beginning."""
    resume = last_event_id or after or "0-0"
    if not _EVENT_ID.fullmatch(resume) or any(int(part) >= 2**64 for part in resume.split("-")):
        raise InvalidEventId(f"Last-Event-ID {quoted(resume)} is not an event id of this API")
    return resume


def _id(event_id: str) -> tuple[int, int]:
    ms, seq = event_id.split("-")
    return int(ms), int(seq)


async def check_resume(store: JobStore, job_id: str, after: str) -> None:
    """A resume point past the job's newest event names events this job never had."""
    if after == "0-0":
        return
    newest = await store.last_event_id(job_id)
    if newest is None or _id(after) > _id(newest):
        raise InvalidEventId(
            f"Last-Event-ID {quoted(after)} is past this job's last event ({newest or 'none yet'})"
        )


class _Failed:
    """What a feed hands its subscribers when it cannot go on."""


FAILED = _Failed()


class Feed:
    """One job's new events, read once, for every subscriber of this process."""

    def __init__(self, store: JobStore, job_id: str, after: str, on_idle) -> None:
        self.store = store
        self.job_id = job_id
        self.after = after
        self.subscribers: set[asyncio.Queue] = set()
        self._on_idle = on_idle
        self.task = asyncio.create_task(self._run(), name=f"events-{job_id}")

    async def _run(self) -> None:
        try:
            while self.subscribers:
                events = await self.store.read_events(self.job_id, self.after, block_ms=5000)
                for event in events:
                    self.after = event.id
                    self._publish(event)
                if any(e.type.terminal for e in events):
                    return
                if not events:
                    status = await self.store.status(self.job_id)
                    if status is None or status.terminal:
                        for event in await self.store.read_events(self.job_id, self.after, block_ms=None):
                            self.after = event.id
                            self._publish(event)
                        return
        except Exception:  # noqa: BLE001 - hand the failure to every subscriber (never a silent hang)
            log.exception("the event feed of job %s failed", self.job_id)
            self._publish(FAILED)
        finally:
            self._publish(None)  # the end
            self._on_idle(self)

    def _publish(self, item) -> None:
        for queue in list(self.subscribers):
            try:
                queue.put_nowait(item)
            except asyncio.QueueFull:  # far behind: cut it off; it resumes with Last-Event-ID
                self.subscribers.discard(queue)
                # drop all it has waiting, not just the oldest: its last id then comes before every
                # event it did not get, and the resume replays them all (no gap)
                while not queue.empty():
                    queue.get_nowait()
                queue.put_nowait(FAILED)


class EventHub:
    """The feeds of this API process, one per followed job."""

    def __init__(self, store: JobStore) -> None:
        self.store = store
        self.feeds: dict[str, Feed] = {}

    def _forget(self, feed: Feed) -> None:
        if self.feeds.get(feed.job_id) is feed:
            del self.feeds[feed.job_id]

    def _join(self, job_id: str, after: str) -> tuple[asyncio.Queue, str]:
        """A queue of the job's feed (a new feed starts after ``after``), and the last event the feed
        has handed out: every later one reaches the queue."""
        queue: asyncio.Queue = asyncio.Queue(maxsize=SUBSCRIBER_BACKLOG)
        feed = self.feeds.get(job_id)
        if feed is None or feed.task.done():
            feed = self.feeds[job_id] = Feed(self.store, job_id, after, self._forget)
        feed.subscribers.add(queue)
        return queue, feed.after

    def _leave(self, job_id: str, queue: asyncio.Queue) -> None:
        feed = self.feeds.get(job_id)
        if feed is not None:
            feed.subscribers.discard(queue)
            if not feed.subscribers:
                self._forget(feed)  # a subscriber that comes now starts a new feed
                feed.task.cancel()

    async def events(self, job_id: str, after: str) -> AsyncIterator[Event | _Failed]:
        """Every event after ``after``, then the job's end (or FAILED)."""
        status = await self.store.status(job_id)
        if status is None or status.terminal:  # the stream cannot grow: read it, no feed
            while events := await self.store.read_events(job_id, after, block_ms=None):
                for event in events:
                    after = event.id
                    yield event
            return
        # 1) join the feed (from now on nothing new is missed), 2) replay the past up to where the feed
        # was at the join, 3) follow. The join awaits nothing, so no event falls between the replay and
        # the feed; the newest id read before it only places a new feed (an event a running feed hands
        # out while this reads is in the replay).
        newest = await self.store.last_event_id(job_id) or "0-0"
        queue, joined = self._join(job_id, newest if _id(newest) > _id(after) else after)
        try:
            while _id(after) < _id(joined) and (events := await self.store.read_events(job_id, after, None)):
                for event in events:
                    after = event.id
                    yield event
                    if event.type.terminal:
                        return
            while (item := await queue.get()) is not None:
                if item is FAILED:
                    yield item
                    return
                if _id(item.id) <= _id(after):
                    continue  # replayed already
                after = item.id
                yield item
                if item.type.terminal:
                    return
        finally:
            self._leave(job_id, queue)


async def event_stream(hub: EventHub, job_id: str, after: str) -> AsyncIterator[dict]:
    """Server-sent events of a job from ``after`` until its end; a failure ends the stream with an
    ``error`` event."""
    try:
        async for event in hub.events(job_id, after):
            if event is FAILED:
                break
            yield {"id": event.id, "event": event.type.value, "data": json.dumps(event.data)}
        else:
            return
    except Exception:  # noqa: BLE001 - end the stream with an error event, never hang
        log.exception("event stream of job %s failed", job_id)
    error = "the event stream failed; reconnect with Last-Event-ID to resume"
    yield {"event": "error", "data": json.dumps({"error": error})}
