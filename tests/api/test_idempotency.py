"""Idempotency-Key retries are the same request when they say the same thing: a form upload (whose
boundary is new on every try), JSON with its keys in another order; another file is another body."""

from __future__ import annotations

import json

KEY = {"Idempotency-Key": "k1"}


def test_a_retried_upload_or_reordered_json_is_the_same_request(api):
    async def scenario(a):
        c = a.client
        upload = {"file": ("a.txt", b"Hello there.", "text/plain")}
        first = await c.post("/v1/jobs", files=upload, data={"title": "T"}, headers=KEY)
        retry = await c.post("/v1/jobs", files=upload, data={"title": "T"}, headers=KEY)
        other_file = await c.post("/v1/jobs", files={"file": ("a.txt", b"Other text.", "text/plain")}, headers=KEY)
        body = {"text": "Once.", "title": "A", "format": "wav"}
        headers = {**KEY, "Idempotency-Key": "k2", "content-type": "application/json"}
        as_sent = await c.post("/v1/jobs", content=json.dumps(body), headers=headers)
        reordered = await c.post("/v1/jobs", content=json.dumps(dict(reversed(body.items())), indent=2), headers=headers)
        return first, retry, other_file, as_sent, reordered

    first, retry, other_file, as_sent, reordered = api(scenario)
    assert first.status_code == retry.status_code == 202 and retry.json()["id"] == first.json()["id"]
    assert other_file.status_code == 422 and "different request body" in other_file.json()["detail"]
    assert as_sent.status_code == reordered.status_code == 202 and reordered.json()["id"] == as_sent.json()["id"]
