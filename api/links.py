"""Short-lived signed links: what a browser's EventSource and ``<audio>`` use, since they cannot send
an Authorization header.

A link's ``token`` is ``<expiry>.<signature>``: the signature is HMAC-SHA256 over the job id, what the
link is for (``events``, ``audio``) and the expiry, so a token opens one job's one resource until it
expires, and any change to it breaks the signature.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
import time

from api.errors import Unauthorized


class LinkSigner:
    def __init__(self, secret: bytes, ttl_s: int) -> None:
        self.secret = secret
        self.ttl_s = ttl_s

    def _signature(self, job_id: str, kind: str, expiry: int) -> str:
        mac = hmac.new(self.secret, f"{job_id}\x1f{kind}\x1f{expiry}".encode(), hashlib.sha256).digest()
        return base64.urlsafe_b64encode(mac).rstrip(b"=").decode()

    def token(self, job_id: str, kind: str, now: float | None = None) -> str:
        expiry = int((now or time.time()) + self.ttl_s)
        return f"{expiry}.{self._signature(job_id, kind, expiry)}"

    def check(self, job_id: str, kind: str, token: str) -> None:
        """``Unauthorized`` unless ``token`` opens ``kind`` of ``job_id`` now."""
        expiry, _, signature = token.partition(".")
        # ASCII digits only, and few (str.isdigit() takes "²", int() refuses 5,000 digits); the
        # signature compared as bytes (compare_digest refuses a str with non-ASCII in it)
        well_formed = 0 < len(expiry) <= 20 and expiry.isascii() and expiry.isdigit()
        if not well_formed or not hmac.compare_digest(
            signature.encode("utf-8", "surrogatepass"), self._signature(job_id, kind, int(expiry)).encode()
        ):
            raise Unauthorized("the link's token is not valid for this job")
        if int(expiry) < time.time():
            raise Unauthorized("the link has expired: get a new one from GET /v1/jobs/{id}")


async def link_secret(redis, names, configured: str | None) -> bytes:
    """The configured secret, or the fleet's own: made once, kept in Redis, shared by every API."""
    if configured:
        return configured.encode()
    await redis.set(names.link_secret(), secrets.token_hex(32), nx=True)
    return await redis.get(names.link_secret())
