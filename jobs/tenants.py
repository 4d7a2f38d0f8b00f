"""Tenants and their API keys: who may use the fleet, as whom, within which limits.

A key is shown once, when it is made (``nk_`` + 43 random URL-safe characters); Redis holds only its
SHA-256, so a copy of the database gives nobody a usable key. Its record names its tenant and whether
it is an admin key (admins see every tenant's jobs). Revoking deletes the record: the next request
with that key is refused. A tenant's limits default to the settings' and can be set per tenant.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import time
from dataclasses import asdict, dataclass, field

import redis.asyncio as aioredis

from fleet.names import Names
from fleet.settings import Settings
from jobs.errors import InvalidRequest, quoted

#: The tenant of requests without keys (a fleet with auth off, or on loopback before any key exists)
#: and of ``narrate file``.
DEFAULT_TENANT = "default"
TENANT_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")
KEY_PREFIX = "nk_"


def key_id(key: str) -> str:
    """What Redis stores of a key: its SHA-256 (hex)."""
    return hashlib.sha256(key.encode()).hexdigest()


def check_tenant_name(name: str) -> str:
    if not TENANT_NAME.match(name):
        raise InvalidRequest(
            f"tenant {quoted(name)} is not a tenant name: 1-63 of a-z, 0-9, '-', '_', starting with a letter or digit"
        )
    return name


@dataclass(frozen=True)
class Principal:
    """Who a request acts as."""

    tenant: str
    admin: bool = False
    #: The key's id (its hash's first 12 hex digits); "" for requests without a key.
    key: str = ""
    #: A signed link's job: the request may see that job only (and ``tenant`` is "").
    link_job: str = ""

    def may_see(self, tenant: str, job_id: str) -> bool:
        if self.link_job:
            return job_id == self.link_job
        return self.admin or tenant == self.tenant


@dataclass(frozen=True)
class KeyRecord:
    tenant: str
    admin: bool
    label: str
    created_at: float


@dataclass
class Limits:
    """What one tenant may do; 0 means the fleet's default (settings)."""

    concurrent_jobs: int = 0
    chars_per_day: int = 0
    requests_per_minute: int = 0
    max_text_chars: int = 0
    #: Its share of the fleet's engines against other tenants (fair scheduling).
    weight: int = 0

    def resolved(self, settings: Settings) -> Limits:
        return Limits(
            concurrent_jobs=self.concurrent_jobs or settings.tenant_concurrent_jobs,
            chars_per_day=self.chars_per_day or settings.tenant_chars_per_day,
            requests_per_minute=self.requests_per_minute or settings.tenant_requests_per_minute,
            max_text_chars=min(self.max_text_chars or settings.max_text_chars, settings.max_text_chars),
            weight=self.weight or 1,
        )


@dataclass
class Tenant:
    name: str
    limits: Limits = field(default_factory=Limits)
    created_at: float = 0.0


class TenantStore:
    """Tenants and keys in Redis (``Names.api_keys``, ``Names.tenants``, ``Names.tenant``)."""

    def __init__(self, redis: aioredis.Redis, names: Names) -> None:
        self.redis = redis
        self.names = names

    # --- keys ------------------------------------------------------------------------------------

    async def create_key(self, tenant: str, admin: bool = False, label: str = "") -> str:
        """A new key for ``tenant`` (made if new); returns the key itself, which is stored nowhere."""
        await self.ensure_tenant(check_tenant_name(tenant))
        key = KEY_PREFIX + secrets.token_urlsafe(32)
        record = KeyRecord(tenant, admin, label[:200], time.time())
        pipe = self.redis.pipeline(transaction=False)  # two slots on a cluster: the marker may come first
        pipe.set(self.names.api_keys_made(), "1")
        pipe.hset(self.names.api_keys(), key_id(key), json.dumps(asdict(record)))
        await pipe.execute()
        return key

    async def principal(self, key: str) -> Principal | None:
        """Who ``key`` is (None: no such key, or revoked)."""
        if not key.startswith(KEY_PREFIX) or len(key) > 200:
            return None
        digest = key_id(key)
        raw = await self.redis.hget(self.names.api_keys(), digest)
        if raw is None:
            return None
        record = KeyRecord(**json.loads(raw))
        return Principal(record.tenant, record.admin, digest[:12])

    async def keys(self) -> dict[str, KeyRecord]:
        """Key id (the first 12 hex digits of its hash) -> its record."""
        raw = await self.redis.hgetall(self.names.api_keys())
        return {k.decode()[:12]: KeyRecord(**json.loads(v)) for k, v in raw.items()}

    async def revoke(self, prefix: str) -> int:
        """Delete the keys whose id starts with ``prefix`` (at least 8 hex digits); how many."""
        if len(prefix) < 8:
            raise InvalidRequest("name a key by at least 8 characters of its id (narrate keys list)")
        ids = [k for k in await self.redis.hkeys(self.names.api_keys()) if k.decode().startswith(prefix)]
        if len(ids) > 1:
            raise InvalidRequest(f"{len(ids)} keys start with {quoted(prefix)}: give more of the id")
        if ids:
            await self.redis.hdel(self.names.api_keys(), *ids)
        return len(ids)

    async def keys_made(self) -> bool:
        """Whether a key was ever made (revoked or not): from then on "auto" asks for one."""
        return bool(await self.redis.exists(self.names.api_keys(), self.names.api_keys_made()))

    # --- tenants ---------------------------------------------------------------------------------

    async def ensure_tenant(self, name: str) -> None:
        pipe = self.redis.pipeline(transaction=False)
        pipe.sadd(self.names.tenants(), name)
        pipe.hsetnx(self.names.tenant(name), "created_at", repr(time.time()))
        await pipe.execute()

    async def tenant(self, name: str) -> Tenant:
        raw = {k.decode(): v.decode() for k, v in (await self.redis.hgetall(self.names.tenant(name))).items()}
        limits = Limits(**{f: int(raw[f]) for f in Limits.__dataclass_fields__ if f in raw})
        return Tenant(name, limits, float(raw.get("created_at", 0)))

    async def set_limits(self, name: str, **limits: int) -> Tenant:
        unknown = set(limits) - set(Limits.__dataclass_fields__)
        if unknown:
            raise InvalidRequest(f"unknown limit(s): {', '.join(sorted(unknown))}")
        if any(v < 0 for v in limits.values()):
            raise InvalidRequest("limits are whole numbers >= 0 (0: the fleet's default)")
        await self.ensure_tenant(check_tenant_name(name))
        if limits:
            await self.redis.hset(self.names.tenant(name), mapping={k: str(v) for k, v in limits.items()})
        return await self.tenant(name)

    async def tenants(self) -> list[str]:
        return sorted(m.decode() for m in await self.redis.smembers(self.names.tenants()))
