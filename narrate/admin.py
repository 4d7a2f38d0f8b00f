"""``narrate keys`` and ``narrate tenants``: API keys and tenants' limits, against REDIS_URL's Redis
or the data directory's embedded Valkey (the running one, if a fleet runs it now)."""

from __future__ import annotations

import asyncio
import sys
import time
from contextlib import ExitStack

from fleet.settings import Settings


def run(settings: Settings, action) -> int:
    """Run ``action(tenants)`` (an async function of a ``TenantStore``) against the fleet's Redis."""
    from fleet.names import Names
    from fleet.redis import async_client
    from jobs.errors import InvalidRequest
    from jobs.tenants import TenantStore
    from narrate.embedded import DataDirBusy, fleet_redis, ping

    async def main(settings: Settings) -> int:
        redis = async_client(settings)
        try:
            return await action(TenantStore(redis, Names(settings.key_prefix)))
        finally:
            await redis.aclose()

    with ExitStack() as stack:
        try:
            settings, _ = fleet_redis(settings, stack, share=True)
            ping(settings.redis_url)
            return asyncio.run(main(settings))
        except (DataDirBusy, InvalidRequest) as exc:
            print(f"narrate: {exc}", file=sys.stderr)
            return 2


def keys_create(tenant: str, admin: bool, label: str):
    async def action(tenants) -> int:
        key = await tenants.create_key(tenant, admin=admin, label=label)
        print(key)
        kind = "an admin key" if admin else "a key"
        print(
            f"{kind} of tenant {tenant}: shown once, keep it (send it as Authorization: Bearer <key>)",
            file=sys.stderr,
        )
        return 0

    return action


def keys_list():
    async def action(tenants) -> int:
        keys = await tenants.keys()
        print(f"{'id':<14}{'tenant':<24}{'admin':<7}{'created':<22}label")
        for kid, record in sorted(keys.items(), key=lambda kv: kv[1].created_at):
            created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record.created_at))
            print(
                f"{kid:<14}{record.tenant:<24}{'yes' if record.admin else 'no':<7}{created:<22}{record.label}"
            )
        return 0

    return action


def keys_revoke(key_id: str):
    async def action(tenants) -> int:
        if not await tenants.revoke(key_id):
            print(f"narrate: no key's id starts with {key_id!r} (narrate keys list)", file=sys.stderr)
            return 2
        print(f"revoked {key_id}: requests with it are refused from now on")
        return 0

    return action


def tenants_set(name: str, limits: dict[str, int]):
    async def action(tenants) -> int:
        tenant = await tenants.set_limits(name, **limits)
        shown = ", ".join(f"{k} {v or 'default'}" for k, v in vars(tenant.limits).items())
        print(f"{tenant.name}: {shown}")
        return 0

    return action


def tenants_list(settings: Settings):
    async def action(tenants) -> int:
        for name in await tenants.tenants():
            limits = (await tenants.tenant(name)).limits.resolved(settings)
            print(f"{name}: " + ", ".join(f"{k} {v:,}" for k, v in vars(limits).items()))
        return 0

    return action
