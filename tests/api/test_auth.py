"""Who a request acts as: "auto" asks for keys from the first key made on, revoked or not (the last
key revoked must not open the API to everyone); the CLI refuses to listen beyond loopback only while
no key has been made (real Redis)."""

from __future__ import annotations

import time

import redis

from fleet.settings import Settings
from narrate.cli import open_without_keys
from testing.fleetkit import delete_prefix, make_keys


def test_revoking_the_last_key_does_not_open_an_auto_api(api):
    async def scenario(a):
        tenants = a.app.state.fleet.tenants
        assert (await a.client.post("/v1/jobs", json={"text": "Before any key."})).status_code == 202
        key = await tenants.create_key("alice")
        alices = await a.client.post("/v1/jobs", json={"text": "Hers."}, headers={"Authorization": f"Bearer {key}"})
        assert (await a.client.get("/v1/jobs")).status_code == 401
        (key_id,) = await tenants.keys()
        assert await tenants.revoke(key_id) == 1
        for method, path in [("GET", "/v1/jobs"), ("DELETE", f"/v1/jobs/{alices.json()['id']}")]:
            assert (await a.client.request(method, path)).status_code == 401, (method, path)

    api(scenario)


def test_the_cli_listens_beyond_loopback_only_once_a_key_was_made(redis_url):
    prefix = f"auth-{int(time.time() * 1000) % 10**9}"
    settings = Settings(redis_url=redis_url, key_prefix=prefix)
    try:
        assert "refusing to serve 0.0.0.0 without API keys" in open_without_keys("0.0.0.0", settings)
        assert open_without_keys("127.0.0.1", settings) is None
        make_keys(redis_url, prefix, {"alice": {}})
        assert open_without_keys("0.0.0.0", settings) is None
        redis.Redis.from_url(redis_url).delete(f"{prefix}:keys")  # every key revoked
        assert open_without_keys("0.0.0.0", settings) is None  # the API asks for keys: nobody is served
    finally:
        delete_prefix(redis_url, prefix)
