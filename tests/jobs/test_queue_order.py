"""The order a job's segments are queued in (settings.longest_first_window, jobs/service.py
``queue_order``): book order by default; with a window, the longest of each run after the first go
first. Through the real API on the real Redis, read back from the job's admission queue."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from api.app import create_app
from fleet.messages import SegmentTask
from jobs.service import queue_order
from jobs.store import JobStore


def test_queue_order_keeps_the_first_and_sorts_each_run_longest_first():
    lengths = [5, 1, 9, 3, 7, 2, 7]
    assert queue_order(lengths, 0) == queue_order(lengths, 1) == list(range(7))
    assert queue_order(lengths, 3) == [0, 2, 3, 1, 4, 6, 5]  # runs 1-3, 4-6, then 7 alone
    assert queue_order(lengths, 100) == [0, 2, 4, 6, 3, 5, 1]  # ties (4 and 6) in book order
    assert queue_order([4, 8], 5) == [0, 1] and queue_order([], 5) == []


SENTENCES = [
    "Short one.",
    "This sentence is a good deal longer than the first.",
    "Tiny.",
    "A middling sentence, here.",
    "The longest sentence of them all goes on and on for quite a while, and then some more.",
    "Mid length words.",
]


def queued_segments(make_settings, key_prefix: str, window: int) -> list[int]:
    settings = make_settings(key_prefix, longest_first_window=window, default_model="tiny")

    async def main() -> list[int]:
        app = create_app(settings)
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://api") as client:
                response = await client.post("/v1/jobs", json={"text": " ".join(SENTENCES), "model": "tiny"})
                assert response.status_code == 202, response.text
                job_id = response.json()["id"]
            store = JobStore.for_settings(app.state.fleet.store.redis, settings)
            job = await store.get(job_id)
            # the first was admitted at once (an idle worker wakes for it), the rest wait in the queue
            admitted = await store.redis.xrange(store.names.tasks("tiny", job.shard))
            queued = await store.scheduler.queued_tasks("tiny", job.shard, job_id)
            return [SegmentTask.decode(f).segment for _, f in admitted] + [t.segment for t in queued]

    return asyncio.run(main())


@pytest.mark.parametrize("window, expected", [(0, [0, 1, 2, 3, 4, 5]), (3, [0, 1, 3, 2, 4, 5]), (8, [0, 4, 1, 3, 5, 2])])
def test_the_api_queues_a_jobs_segments_in_that_order(make_settings, key_prefix, window, expected):
    """No workers run: the queue holds every segment, once, in the order engines will take them."""
    assert queued_segments(make_settings, key_prefix, window) == expected
