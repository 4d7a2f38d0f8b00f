"""Who a request acts as (``Authorization: Bearer <key>``, or a signed link's token), and the
tenant's request rate. Settings ``auth``: "auto" asks for keys once one has been made, even if
all are revoked since (before that, requests act as the tenant "default", and ``narrate api``
listens only on loopback); "required" always; "off" never."""

from __future__ import annotations

from fastapi import Depends, Request

from api.errors import Unauthorized
from api.state import AppState, app_state
from jobs.tenants import DEFAULT_TENANT, Principal

#: Who everyone is when no key is needed (auth off, or no key made yet in "auto").
ANONYMOUS = Principal(DEFAULT_TENANT, admin=True)


async def identify(request: Request, st: AppState, link: str | None = None) -> Principal:
    """The request's principal; ``link``: the resource a signed link may open on this route."""
    if st.settings.auth == "off":
        return ANONYMOUS
    header = request.headers.get("authorization")
    if header is not None:
        scheme, _, key = header.strip().partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise Unauthorized("send the API key as: Authorization: Bearer <key>")
        principal = await st.tenants.principal(key.strip())
        if principal is None:
            raise Unauthorized("the API key is not valid (unknown or revoked)")
        return principal
    token = request.query_params.get("token")
    if token is not None and link is not None:
        job_id = request.path_params["job_id"]
        st.signer.check(job_id, link, token)
        return Principal("", link_job=job_id)
    if st.settings.auth == "auto" and not await st.tenants.keys_made():
        return ANONYMOUS
    raise Unauthorized("this API needs a key: Authorization: Bearer <key> (made with `narrate keys create`)")


async def caller(request: Request, st: AppState = Depends(app_state)) -> Principal:
    """A FastAPI dependency: the principal of a request with a key (counted against its tenant's
    requests a minute)."""
    principal = await identify(request, st)
    limits = await st.limits(principal.tenant)
    await st.quotas.request(principal.tenant, limits.requests_per_minute)
    return principal


def caller_or_link(kind: str):
    """A dependency for routes a signed link opens (``kind``: events, audio): a key, or the token."""

    async def dependency(request: Request, st: AppState = Depends(app_state)) -> Principal:
        principal = await identify(request, st, link=kind)
        if not principal.link_job:
            limits = await st.limits(principal.tenant)
            await st.quotas.request(principal.tenant, limits.requests_per_minute)
        return principal

    return dependency
