"""Fair scheduling with real processes on a real Redis (eSpeak NG speech workers, keys required):
tenants in the ratio of their weights, an interactive job past a batch book, a cancelled 50,000-segment
job leaving no work behind, a job's place while it waits."""

from __future__ import annotations

import time

import httpx
import pytest
import redis

from fleet.names import Names
from models.espeak import unavailable_reason
from testing.fleetkit import delete_prefix, espeak_settings, make_keys, start_fleet, wait_done, wait_until
from tests.conftest import require
from workers.speech import SpeechWorker

pytestmark = pytest.mark.integration


def sentences(n: int, tag: str) -> str:
    return " ".join(f"{tag} sentence {i} is here." for i in range(n))


@pytest.fixture(scope="module")
def fair(redis_url, data_dir, tmp_path_factory):
    """One speech worker (so admission order is narration order); tenants heavy (weight 3), light
    (weight 1), and user."""
    require(unavailable_reason() is None, f"eSpeak NG: {unavailable_reason()}")
    prefix = f"fair-{int(time.time() * 1000) % 10**9}"
    settings = espeak_settings(
        redis_url, prefix, data_dir, block_ms=200, max_text_chars=3_000_000, tenant_chars_per_day=10**9
    )
    made = make_keys(redis_url, prefix, {"heavy": {"weight": 3}, "light": {}, "user": {}})
    fleet = start_fleet(settings, tmp_path_factory.mktemp("fair-logs"), speech_workers=1)
    try:
        yield fleet, made
    finally:
        fleet.stop()
        delete_prefix(redis_url, prefix)


def client(fleet, key: str) -> httpx.Client:
    return httpx.Client(base_url=fleet.base_url, headers={"Authorization": f"Bearer {key}"}, timeout=120)


def finished_order(r: redis.Redis, names: Names, job_ids: list[str]) -> list[tuple[bytes, str]]:
    """(event id, job) of every segment finished so far, in the order they finished."""
    out = []
    for job_id in job_ids:
        for entry_id, fields in r.xrange(names.events(job_id)):
            if fields[b"type"] == b"segment":
                out.append((entry_id, job_id))
    return sorted(out, key=lambda e: tuple(int(x) for x in e[0].split(b"-")))


def test_two_tenants_share_the_engine_in_the_ratio_of_their_weights(fair, redis_url):
    fleet, keys = fair
    names = Names(fleet.settings.key_prefix)
    r = redis.Redis.from_url(redis_url)
    with client(fleet, keys["heavy"]) as heavy, client(fleet, keys["light"]) as light:
        h = heavy.post("/v1/jobs", json={"text": sentences(80, "Heavy"), "priority": "batch"}).json()["id"]
        l_ = light.post("/v1/jobs", json={"text": sentences(80, "Light"), "priority": "batch"}).json()["id"]
        wait_until(lambda: len(finished_order(r, names, [h, l_])) >= 48, 240, "48 segments")
        order = [job for _, job in finished_order(r, names, [h, l_])]
        heavy.delete(f"/v1/jobs/{h}")
        light.delete(f"/v1/jobs/{l_}")
    start = order.index(l_)  # from the light job's first segment on, both are queued
    window = order[start : start + 40]
    share = window.count(h)
    print(f"heavy:light in 40 segments while both were queued: {share}:{40 - share}")
    assert 28 <= share <= 32  # 3:1 is 30:10


def started_at(r: redis.Redis, names: Names, job_id: str) -> list[float]:
    """When the speech worker started each segment of a job so far (Redis time, s): an attempt's
    number is its start in ms since the job's creation (jobs/scripts.py START_SEGMENT)."""
    created = float(r.hget(names.job(job_id), "created_at"))
    return [created + int(attempt) / 1000 for attempt in r.hvals(names.attempts(job_id))]


def test_an_interactive_job_does_not_wait_for_a_book_and_its_place_is_shown(fair, redis_url):
    fleet, keys = fair
    names = Names(fleet.settings.key_prefix)
    r = redis.Redis.from_url(redis_url)
    with client(fleet, keys["heavy"]) as author, client(fleet, keys["user"]) as user:
        book = author.post("/v1/jobs", json={"text": sentences(300, "Book")}).json()
        assert book["links"] and author.get(f"/v1/jobs/{book['id']}").json()["priority"] == "batch"
        # as long as the book: served in turn with it, it still waits when the book has done a few
        second = author.post("/v1/jobs", json={"text": sentences(300, "Second"), "priority": "batch"}).json()
        wait_until(lambda: author.get(f"/v1/jobs/{book['id']}").json()["segments_done"] >= 3, 120, "the book")
        place = author.get(f"/v1/jobs/{second['id']}").json()["place"]
        assert place is not None and 0 < place["queued"] < 300 and place["segments_ahead"] >= 0
        started = time.monotonic()
        short = user.post("/v1/jobs", json={"text": "A short question. And its answer."}).json()
        # from its answer: the job is queued (on a loaded machine the POST itself may take a while,
        # and what the worker starts meanwhile was admitted before the short job existed)
        seconds, micros = r.time()
        submitted = seconds + micros / 1e6
        assert user.get(f"/v1/jobs/{short['id']}").json()["priority"] == "interactive"
        assert wait_done(user, short["id"], timeout=120)["status"] == "done"
        took = time.monotonic() - started
        last_short = max(started_at(r, names, short["id"]))
        batch = started_at(r, names, book["id"]) + started_at(r, names, second["id"])
        for job in (book, second):
            author.delete(f"/v1/jobs/{job['id']}")
    # by when the speech worker started them, not when the assembler published them (its lag would
    # count segments spoken before the short job existed)
    batch_first = sum(submitted <= t < last_short for t in batch)
    print(
        f"the short job took {took:.2f} s while the book went on; batch segments started before its last: {batch_first}"
    )
    # what the speech worker had read (a batch: the segment it speaks and the one after) and the
    # one admitted for its next read; never the book's queue
    assert batch_first <= SpeechWorker.batch_size + 1


def test_a_cancelled_50000_segment_job_leaves_no_work_behind(fair, redis_url):
    fleet, keys = fair
    names = Names(fleet.settings.key_prefix)
    r = redis.Redis.from_url(redis_url)

    def queued() -> int:  # the scheduler's count of queued tasks (jobs.scheduler.Scheduler.queued)
        return sum(int(r.get(f"{names.queues('espeak')}:queued:{k}") or 0) for k in ("interactive", "batch"))

    with client(fleet, keys["user"]) as c:
        started = time.monotonic()
        idle = wait_done(c, c.post("/v1/jobs", json={"text": "Two sentences. Here."}).json()["id"])
        idle_s = time.monotonic() - started
        big = c.post("/v1/jobs", json={"text": sentences(50_000, "Big"), "priority": "batch"}).json()
        assert big["segments_total"] == 50_000
        wait_until(lambda: c.get(f"/v1/jobs/{big['id']}").json()["segments_done"] >= 2, 120, "the big job")
        assert queued() > 49_000
        deleted = time.monotonic()
        assert c.delete(f"/v1/jobs/{big['id']}").status_code == 202
        delete_s = time.monotonic() - deleted
        assert queued() == 0  # at once, not as workers reach them
        assert r.keys(f"{names.queues('espeak')}:job:{big['id']}") == []
        # at most what the one engine's worker had read (it speaks a read's tasks one after another
        # and deletes each when done: a DELETE during the first leaves both in the stream)
        assert r.xlen(names.tasks("espeak")) <= SpeechWorker.batch_size
        started = time.monotonic()
        after = wait_done(c, c.post("/v1/jobs", json={"text": "Two sentences. Here."}).json()["id"])
        after_s = time.monotonic() - started
        # and those few were dropped (START_SEGMENT refuses an ended job), not left behind
        wait_until(lambda: r.xlen(names.tasks("espeak")) == 0, 30, "the task stream to drain")
    print(
        f"2-sentence job: {idle_s:.2f} s idle, {after_s:.2f} s after the cancel; the DELETE took {delete_s:.2f} s"
    )
    assert idle["status"] == after["status"] == "done"
    assert after_s < 3 * idle_s + 2  # no backlog of dead tasks to skip
