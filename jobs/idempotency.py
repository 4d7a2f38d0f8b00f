"""Idempotent submission: a client that retries a POST with the same ``Idempotency-Key`` gets the job
its first try created, never a second one; the same key with another body is refused.

The key (per tenant, hashed) claims a slot with SET NX before the job exists ("pending:<body
hash>"), and names the job once it is stored ("job:<id>:<body hash>"), for 24 hours. A retry that
arrives while the first try is still storing its job waits for it.
"""

from __future__ import annotations

import asyncio
import hashlib
import time

import redis.asyncio as aioredis

from fleet.names import Names
from jobs.errors import InvalidRequest

#: How long a key remembers its job, seconds.
KEY_TTL_S = 24 * 3600
#: How long a retry waits for the first try to store its job, seconds.
WAIT_S = 30.0


def digest(value: str | bytes) -> str:
    return hashlib.sha256(value.encode() if isinstance(value, str) else value).hexdigest()


class IdempotencyConflict(InvalidRequest):
    """The key was used with another request body."""


class Idempotency:
    def __init__(self, redis: aioredis.Redis, names: Names, tenant: str, key: str, body: bytes) -> None:
        if not key or len(key) > 255:
            raise InvalidRequest("Idempotency-Key must be 1 to 255 characters")
        self.redis = redis
        self.slot = names.idempotency(tenant, digest(key))
        self.body = digest(body)

    async def claim(self) -> str | None:
        """None: this request is the first with the key (create the job, then ``bind``); else the id
        of the job an earlier request with the key created."""
        if await self.redis.set(self.slot, f"pending:{self.body}", nx=True, ex=KEY_TTL_S):
            return None
        deadline = time.monotonic() + WAIT_S
        while True:
            value = (await self.redis.get(self.slot) or b"").decode()
            kind, _, rest = value.partition(":")
            job_id, _, body = rest.rpartition(":") if kind == "job" else ("", "", rest)
            if value and body != self.body:
                raise IdempotencyConflict("this Idempotency-Key was used with a different request body")
            if kind == "job":
                return job_id
            # the first try failed and let go of the key: this one is first now
            if not value and await self.redis.set(self.slot, f"pending:{self.body}", nx=True, ex=KEY_TTL_S):
                return None
            if time.monotonic() > deadline:
                raise InvalidRequest(
                    "a request with this Idempotency-Key is still being processed; retry later"
                )
            await asyncio.sleep(0.05)

    async def bind(self, job_id: str) -> None:
        await self.redis.set(self.slot, f"job:{job_id}:{self.body}", ex=KEY_TTL_S)

    async def release(self) -> None:
        """The request failed before creating a job: a retry may try again."""
        await self.redis.delete(self.slot)
