"""A submit that fails part way: what it took is given back if the job was not stored (its slot,
the day's characters, its cover), and nothing is undone once it was (the job is accepted)."""

from __future__ import annotations

import api.routes
from jobs.store import JobStore

TEXT = "Hello there, friend."  # 20 characters


def test_a_job_refused_for_want_of_a_replica_spends_no_characters(real_api):
    async def scenario(a):
        # no replica acknowledges (the machine's Redis has none): a 503 "nothing kept, try again"
        return [(await a.client.post("/v1/jobs", json={"text": TEXT})).status_code for _ in range(4)]

    # 50 a day: the third try was refused as over the budget when refusals counted
    assert real_api(scenario, durable_replicas=1, durable_timeout_ms=20, tenant_chars_per_day=50) == [503] * 4


def test_a_job_stored_is_accepted_though_queueing_its_finalize_failed(real_api, monkeypatch):
    async def scenario(a):
        first = (await a.client.post("/v1/jobs", json={"text": TEXT})).json()["id"]
        store = JobStore.for_settings(a.redis, a.settings)
        plan = await store.plan(first)
        cache = a.app.state.fleet.cache
        await a.redis.hset(cache.names.segment_cache(plan.cache_scope), mapping=dict.fromkeys(plan.cache_keys, 24_000))
        assert (await a.client.delete(f"/v1/jobs/{first}")).status_code == 202

        def rq_down(*args, **kwargs):
            raise ConnectionError("RQ's Redis is unreachable")

        monkeypatch.setattr(api.routes, "enqueue_finalize", rq_down)  # every segment comes from the cache
        again = await a.client.post("/v1/jobs", json={"text": TEXT}, headers={"Idempotency-Key": "once"})
        retried = await a.client.post("/v1/jobs", json={"text": TEXT}, headers={"Idempotency-Key": "once"})
        job = await store.get(again.json()["id"])
        slot = await a.redis.sismember(store.names.tenant_active(job.tenant), job.id)
        return again, retried, job, slot

    again, retried, job, slot = real_api(scenario, segment_cache="tenant")
    assert again.status_code == retried.status_code == 202
    assert retried.json()["id"] == again.json()["id"]  # its key was kept: no second job
    assert job.status.value == "finalizing" and slot  # the sweep queues the finalize that did not land
