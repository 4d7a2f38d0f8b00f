"""What every request handler uses: the settings and the connections the app's lifespan opened."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import redis
from fastapi import Request

from api.broadcast import BroadcastHub
from api.links import LinkSigner
from api.sse import EventHub
from fleet.settings import Settings
from fleet.storage import Storage
from jobs.lexicon import LexiconStore
from jobs.quotas import RateQuotas
from jobs.segcache import SegmentCache
from jobs.store import JobStore
from jobs.tenants import Limits, TenantStore

#: How long a tenant's limits are cached by one API process, seconds (a change takes this long).
LIMITS_CACHE_S = 5.0


@dataclass
class AppState:
    settings: Settings
    store: JobStore
    storage: Storage
    #: RQ's connection (synchronous, no decoded responses): forgetting a deleted job's finalize.
    rq: redis.Redis
    tenants: TenantStore
    quotas: RateQuotas
    signer: LinkSigner
    #: One event feed per followed job, for all of this process's SSE clients.
    hub: EventHub
    #: The tenants' pronunciation lexicons.
    lexicons: LexiconStore
    #: Rendered segments kept for reuse.
    cache: SegmentCache
    #: This process's live streams, shared by their listeners.
    broadcasts: BroadcastHub
    _limits: dict[str, tuple[float, Limits]] = field(default_factory=dict)

    async def limits(self, tenant: str) -> Limits:
        """The tenant's limits, resolved against the settings (cached briefly)."""
        now = time.monotonic()
        cached = self._limits.get(tenant)
        if cached is None or now - cached[0] > LIMITS_CACHE_S:
            limits = (await self.tenants.tenant(tenant)).limits.resolved(self.settings)
            self._limits[tenant] = cached = (now, limits)
        return cached[1]


def app_state(request: Request) -> AppState:
    """A FastAPI dependency: the state of the app serving this request."""
    return request.app.state.fleet
