"""A job's events as server-sent events: the events stream's entry ids are the SSE ids, so a client
that reconnects with Last-Event-ID gets exactly what it missed."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator

from jobs.errors import InvalidEventId
from jobs.store import JobStore

_EVENT_ID = re.compile(r"^\d+-\d+$")


def resume_point(last_event_id: str | None, after: str | None) -> str:
    """Where a stream starts: after the client's last event (header or query), else the beginning."""
    resume = last_event_id or after or "0-0"
    if not _EVENT_ID.match(resume):
        raise InvalidEventId(f"Last-Event-ID {resume[:100]!r} is not an event id of this API")
    return resume


async def event_stream(store: JobStore, job_id: str, after: str) -> AsyncIterator[dict]:
    """Events after ``after`` until a terminal one; ends at once if the job is over and nothing
    newer exists; a failure ends the stream with an ``error`` event, never a hang."""
    while True:
        try:
            events = await store.read_events(job_id, after, block_ms=5000)
        except Exception as exc:  # noqa: BLE001 - end the stream with an error event, never hang
            yield {"event": "error", "data": json.dumps({"error": f"event stream failed: {exc}"})}
            return
        for event in events:
            yield {"id": event.id, "event": event.type.value, "data": json.dumps(event.data)}
            after = event.id
            if event.type.terminal:
                return
        if not events:
            status = await store.status(job_id)
            if status is None or status.terminal:  # nothing more will come
                return
