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
