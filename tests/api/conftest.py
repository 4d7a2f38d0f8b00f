"""The API in-process: ASGI transport (no sockets) over fakeredis with Lua (the same scripts as
production). Milliseconds per test; the real-fleet tests in tests/integration cover real HTTP."""

from __future__ import annotations

import asyncio

import fakeredis
import httpx
import pytest

from api.app import create_app
from fleet.settings import Settings


class Api:
    def __init__(
        self, settings: Settings, redis: fakeredis.FakeAsyncRedis, client: httpx.AsyncClient, app=None
    ) -> None:
        self.settings = settings
        self.redis = redis
        self.client = client
        #: The app's own objects (``app.state.fleet``: its tenant store, segment cache...).
        self.app = app

    async def keys(self) -> list[bytes]:
        """Keys a job could have written (not the API's own: its link secret, rate counters)."""
        own = (b"t:link-secret", b"t:limits")
        return sorted(k for k in await self.redis.keys("*") if not k.startswith(own))


@pytest.fixture
def api(tmp_path):
    """Runs ``scenario(api)`` inside the app's lifespan: ``api.client`` talks to the app."""

    def run(scenario, **overrides):
        settings = Settings(redis_url="redis://unused", key_prefix="t", data_dir=tmp_path, **overrides)
        server = fakeredis.FakeServer()
        redis = fakeredis.FakeAsyncRedis(server=server)
        rq = fakeredis.FakeRedis(server=server)
        app = create_app(settings, redis_client=redis, rq_client=rq)

        async def main():
            async with app.router.lifespan_context(app):
                transport = httpx.ASGITransport(app=app)
                async with httpx.AsyncClient(transport=transport, base_url="http://api") as client:
                    return await scenario(Api(settings, redis, client, app))

        return asyncio.run(main())

    return run


@pytest.fixture
def real_api(tmp_path, redis_url, key_prefix):
    """As ``api``, on the real Redis (what fakeredis cannot do: WAIT, the rate limiter's scripts)."""
    import redis as sync_redis
    import redis.asyncio as aioredis

    def run(scenario, **overrides):
        settings = Settings(redis_url=redis_url, key_prefix=key_prefix, data_dir=tmp_path, **overrides)

        async def main():
            redis = aioredis.from_url(redis_url)
            app = create_app(settings, redis_client=redis, rq_client=sync_redis.Redis.from_url(redis_url))
            try:
                async with app.router.lifespan_context(app):
                    transport = httpx.ASGITransport(app=app)
                    async with httpx.AsyncClient(transport=transport, base_url="http://api") as client:
                        return await scenario(Api(settings, redis, client, app))
            finally:
                await redis.aclose()

        return asyncio.run(main())

    return run
