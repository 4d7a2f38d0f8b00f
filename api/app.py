"""The HTTP API: submit jobs, follow them over server-sent events, download the result.

Thin by design: the routes (api/routes.py) validate, enqueue through jobs.service, read job state
and stream events; api/errors.py maps domain errors to statuses. The app never runs a model. Its
connections are owned by the lifespan.
"""

from __future__ import annotations

from contextlib import asynccontextmanager

import redis
import redis.asyncio as aioredis
from fastapi import FastAPI

from api import errors, web
from api.broadcast import BroadcastHub
from api.limits import BodyLimit, max_body_bytes
from api.links import LinkSigner, link_secret
from api.metrics import router as metrics_router
from api.routes import router
from api.speech import router as speech_router
from api.sse import EventHub
from api.state import AppState
from fleet.redis import async_client
from fleet.redis import rq_client as make_rq_client
from fleet.settings import Settings
from fleet.storage import storage_from_settings
from jobs.lexicon import LexiconStore
from jobs.quotas import RateQuotas
from jobs.segcache import SegmentCache
from jobs.store import JobStore
from jobs.tenants import TenantStore


def create_app(
    settings: Settings | None = None,
    redis_client: aioredis.Redis | None = None,
    rq_client: redis.Redis | None = None,
) -> FastAPI:
    """The app; the clients (e.g. fakeredis in tests) instead of new ones for ``settings.redis_url``."""
    settings = settings or Settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        client = redis_client if redis_client is not None else async_client(settings)
        rq = rq_client if rq_client is not None else make_rq_client(settings)
        store = JobStore.for_settings(client, settings)
        signer = LinkSigner(await link_secret(client, store.names, settings.link_secret), settings.link_ttl_s)
        tenants, quotas = TenantStore(client, store.names), RateQuotas(client, store.names)
        storage = storage_from_settings(settings)
        lexicons, cache = LexiconStore(client, store.names), SegmentCache(client, store.names, settings)
        app.state.fleet = AppState(
            settings, store, storage, rq, tenants, quotas, signer, EventHub(store), lexicons, cache,
            BroadcastHub(settings.live_buffer_bytes, settings.live_ahead_bytes),
        )
        try:
            yield
        finally:
            if redis_client is None:
                await client.aclose()
            if rq_client is None:
                rq.close()

    app = FastAPI(
        title="Narration fleet",
        version="0.1.0",
        description="Long texts in, audiobooks out. Submit a job, follow it over SSE, download the file.",
        lifespan=lifespan,
        docs_url=None,  # /docs and /redoc come from api/web.py, their assets served here (offline)
        redoc_url=None,
    )
    errors.install(app)
    app.include_router(router)
    app.include_router(speech_router)  # POST /v1/audio/speech, OpenAI's shape (api/speech.py)
    app.include_router(metrics_router)  # GET /metrics for Prometheus (api/metrics.py, docs/metrics.md)
    web.install(app)  # the web page at / and the docs
    app.add_middleware(
        BodyLimit,
        max_bytes=settings.max_body_bytes
        or max_body_bytes(settings.max_text_chars, settings.max_cover_bytes, settings.max_upload_bytes),
    )
    return app
