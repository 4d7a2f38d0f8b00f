"""A job's events as server-sent events: the events stream's entry ids are the SSE ids, so a client
that reconnects with Last-Event-ID gets exactly what it missed."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import AsyncIterator

from jobs.errors import InvalidEventId, quoted
from jobs.store import JobStore

log = logging.getLogger(__name__)

_EVENT_ID = re.compile(r"^\d+-\d+$")


def resume_point(last_event_id: str | None, after: str | None) -> str:
    """Where a stream starts: after the client's last event (header or query), else the beginning."""
    resume = last_event_id or after or "0-0"
    if not _EVENT_ID.match(resume) or any(int(part) >= 2**64 for part in resume.split("-")):
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


async def event_stream(store: JobStore, job_id: str, after: str) -> AsyncIterator[dict]:
    """Events after ``after`` until a terminal one; ends at once if the job is over and nothing
    newer exists (never waiting on a stream that cannot grow); a failure ends the stream with an
    ``error`` event, never a hang."""
    status = await store.status(job_id)
    block: int | None = None if status is None or status.terminal else 5000
    while True:
        try:
            events = await store.read_events(job_id, after, block_ms=block)
        except Exception:  # noqa: BLE001 - end the stream with an error event, never hang
            log.exception("event stream of job %s failed", job_id)
            error = "the event stream failed; reconnect with Last-Event-ID to resume"
            yield {"event": "error", "data": json.dumps({"error": error})}
            return
        for event in events:
            yield {"id": event.id, "event": event.type.value, "data": json.dumps(event.data)}
            after = event.id
            if event.type.terminal:
                return
        if not events:
            if block is None:  # the job was over before we read: nothing more will come
                return
            status = await store.status(job_id)
            if status is None or status.terminal:
                block = None  # one more read without waiting: its last events, then the end
