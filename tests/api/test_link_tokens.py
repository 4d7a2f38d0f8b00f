"""Signed links' tokens: anything that is not ``<expiry digits>.<signature>`` as the API made it is the
plain 401, never a crash on the way to finding it wrong."""

from __future__ import annotations

import pytest

from api.errors import Unauthorized
from api.links import LinkSigner
from fleet.names import Names
from jobs.tenants import TenantStore

MALFORMED = [
    "².abc",  # a digit to str.isdigit(), not to int()
    "١٢٣.abc",  # Arabic-Indic digits: int() takes them
    "9999999999.é",  # a non-ASCII signature: compare_digest refuses str with it
    "9999999999.\U0001f600",
    "9" * 5000 + ".abc",  # past int()'s digit limit
    "9" * 21 + ".abc",
    "+123.abc",
    " 123.abc",
    "1_000.abc",
    ".abc",
    "123",
    "",
]
ROUTES = ["events", "audio", "stream", "captions", "marks"]


@pytest.mark.parametrize("token", [*MALFORMED, "9999999999.\ud800"])  # a lone surrogate: no URL carries it
def test_the_signer_refuses_a_malformed_token(token):
    signer = LinkSigner(b"secret", 600)
    with pytest.raises(Unauthorized, match="not valid for this job"):
        signer.check("job", "audio", token)


def test_the_signer_still_takes_its_own_token_and_refuses_another_jobs():
    signer = LinkSigner(b"secret", 600)
    token = signer.token("job", "audio")
    signer.check("job", "audio", token)
    with pytest.raises(Unauthorized):
        signer.check("other", "audio", token)
    with pytest.raises(Unauthorized):
        signer.check("job", "events", token)


def test_a_malformed_token_is_a_401_on_every_signed_route(api):
    async def scenario(a):
        key = await TenantStore(a.redis, Names("t")).create_key("alice")
        made = await a.client.post("/v1/jobs", json={"text": "Hi there."}, headers={"authorization": f"Bearer {key}"})
        assert made.status_code == 202, made.text
        job_id = made.json()["id"]
        return {
            (route, token): await a.client.get(f"/v1/jobs/{job_id}/{route}", params={"token": token})
            for route in ROUTES
            for token in MALFORMED
        }

    for (route, token), r in api(scenario).items():
        assert r.status_code == 401, (route, token[:20], r.status_code, r.text[:200])
        assert r.json() == {"detail": "the link's token is not valid for this job"}, (route, token[:20])
