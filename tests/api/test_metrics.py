"""GET /metrics on the API: the fleet's state from Redis and the process's own metrics, parsed with
prometheus-client's parser; no key needed (a scraper has none); OpenMetrics when the scraper asks."""

from __future__ import annotations

from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics_families
from prometheus_client.parser import text_string_to_metric_families

from fleet.names import Names
from jobs.tenants import TenantStore


def samples(text: str) -> dict[tuple[str, tuple], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_metrics_are_served_without_a_key_and_move_with_the_fleet(api):
    async def scenario(a):
        first = await a.client.get("/metrics")
        refused = await a.client.post("/v1/jobs", json={"text": "One. Two."})  # keys are required
        key = await TenantStore(a.redis, Names("t")).create_key("reader")
        accepted = await a.client.post(
            "/v1/jobs", json={"text": "One. Two."}, headers={"authorization": f"Bearer {key}"}
        )
        second = await a.client.get("/metrics")
        head = await a.client.head("/metrics")
        return first, refused, accepted, second, head

    first, refused, accepted, second, head = api(scenario, auth="required")
    assert refused.status_code == 401 and accepted.status_code == 202
    assert first.status_code == 200 and first.headers["content-type"].startswith("text/plain; version=0.0.4")
    before, after = samples(first.text), samples(second.text)
    assert before[("narrate_redis_up", ())] == 1
    assert before[("narrate_jobs", (("state", "queued"),))] == 0
    assert after[("narrate_jobs", (("state", "queued"),))] == 1
    assert after[("narrate_tasks_queued", (("model", "tiny"), ("priority", "interactive")))] == 1
    assert ("process_cpu_seconds_total", ()) in after  # the API process's own
    families = {f.name: f.type for f in text_string_to_metric_families(second.text)}
    assert families["narrate_jobs"] == "gauge" and families["narrate_jobs_ended"] == "counter"
    assert head.status_code == 200 and head.content == b""


def test_openmetrics_when_the_scraper_asks_for_it(api):
    import workers.metrics  # noqa: F401 - the workers' names beside the fleet's: OpenMetrics refuses a clash

    async def scenario(a):
        return await a.client.get(
            "/metrics", headers={"accept": "application/openmetrics-text;version=1.0.0,text/plain;q=0.5"}
        )

    r = api(scenario)
    assert r.headers["content-type"].startswith("application/openmetrics-text; version=1.0.0")
    assert r.text.endswith("# EOF\n") and r.text.count("# EOF") == 1  # one exposition, both registries
    families = {f.name: f for f in openmetrics_families(r.text)}
    assert families["narrate_jobs_ended"].type == "counter" and "narrate_redis_up" in families
    assert families["narrate_dead_letters"].type == "counter"  # a worker's; the stream is a stream_length


def test_the_finalize_queue_is_read_from_rqs_own_redis(redis_url, key_prefix, tmp_path):
    """RQ's queue lives on ``NARRATE_RQ_REDIS_URL`` where that is set (always on a cluster): the gauge
    reads it there, not from the fleet's Redis. Two databases of one server stand in for the two."""
    import asyncio
    import contextlib
    from urllib.parse import urlparse

    import httpx

    from api.app import create_app
    from fleet.redis import rq_client
    from fleet.settings import Settings
    from jobs.finalize import enqueue_finalize
    from testing.fleetkit import delete_prefix

    parsed = urlparse(redis_url)
    other_db = (int(parsed.path.strip("/") or 0) + 1) % 16
    rq_url = parsed._replace(path=f"/{other_db}").geturl()
    settings = Settings(redis_url=redis_url, rq_redis_url=rq_url, key_prefix=key_prefix, data_dir=tmp_path)
    app = create_app(settings)

    async def scrape() -> str:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://api") as client:
                return (await client.get("/metrics")).text

    rq = rq_client(settings)
    try:
        before = samples(asyncio.run(scrape()))
        enqueue_finalize(settings, "0123abcd-job", rq)  # no finalize worker here: it stays queued
        after = samples(asyncio.run(scrape()))
    finally:
        delete_prefix(rq_url, key_prefix)
        with contextlib.suppress(Exception):
            rq.srem("rq:queues", f"rq:queue:{settings.finalize_queue}")
        rq.close()
    assert before[("narrate_finalize_queue_length", ())] == 0
    assert after[("narrate_finalize_queue_length", ())] == 1
