"""The lexicon routes in-process: create, replace, read, list, delete; a job naming a lexicon says
its replacements; refusals write nothing."""

from __future__ import annotations

import asyncio

from jobs.store import JobStore

JSON = {"content-type": "application/json"}


def test_lexicons_are_created_replaced_listed_used_and_deleted(api):
    async def scenario(a):
        c = a.client
        created = await c.put("/v1/lexicons/names", json={"entries": [{"match": "Nguyen", "say": "Win"}]})
        replaced = await c.put(
            "/v1/lexicons/names", json={"entries": [{"match": "Nguyen", "say": "Win"}, {"regex": r"\bSQL\b", "say": "sequel"}]}
        )
        read = await c.get("/v1/lexicons/names")
        listed = await c.get("/v1/lexicons")
        heads = [(await c.head(path)).status_code for path in ("/v1/lexicons/names", "/v1/lexicons")]
        job = await c.post(
            "/v1/jobs",
            json={"text": "Nguyen likes SQL.", "lexicon": [{"match": "likes", "say": "loves"}], "lexicons": ["names"]},
        )
        plan = await JobStore.for_settings(a.redis, a.settings).plan(job.json()["id"])
        missing = await c.post("/v1/jobs", json={"text": "Hi.", "lexicons": ["nope"]})
        deleted = await c.delete("/v1/lexicons/names")
        again = await c.delete("/v1/lexicons/names")
        gone = await c.get("/v1/lexicons/names")
        return created, replaced, read, listed, heads, job, plan, missing, deleted, again, gone

    created, replaced, read, listed, heads, job, plan, missing, deleted, again, gone = api(scenario)
    assert (created.status_code, replaced.status_code, read.status_code) == (201, 200, 200)
    assert heads == [200, 200]  # HEAD as every GET route
    assert read.json() == {
        "name": "names",
        "entries": [
            {"say": "Win", "match": "Nguyen", "case_sensitive": False},
            {"say": "sequel", "regex": r"\bSQL\b", "case_sensitive": False},
        ],
    }
    assert listed.json() == {"lexicons": [{"name": "names", "entries": 2}]}
    assert job.status_code == 202, job.text
    (segment,) = plan.segments
    assert (segment.text, segment.say) == ("Nguyen likes SQL.", "Win loves sequel.")  # the job's own entries first
    assert [e["applied"] for e in plan.lexicon] == [1, 1, 1]
    assert missing.status_code == 422 and "no lexicon 'nope'" in missing.json()["detail"]
    assert (deleted.status_code, again.status_code, gone.status_code) == (204, 404, 404)


def test_bad_lexicons_are_refused_and_nothing_is_stored(api):
    async def scenario(a):
        c = a.client
        out = [
            await c.put("/v1/lexicons/Bad Name", json={"entries": []}),
            await c.put("/v1/lexicons/ok", json={"entries": [{"regex": "(a+", "say": "x"}]}),
            await c.put("/v1/lexicons/ok", json={"entries": [{"match": "a", "say": "b"}] * 1001}),
            await c.post("/v1/jobs", json={"text": "Hi.", "lexicon": [{"regex": "a*", "say": "x"}]}),
            # a group named as the job's pattern names its entries' (e0, e1...) hung the submit
            await asyncio.wait_for(
                c.post("/v1/jobs", json={"text": "Hi x.", "lexicon": [{"regex": "(?P<e1>x)", "say": "y"}, {"match": "Hi", "say": "Hello"}]}),
                10,
            ),
            # a lone surrogate (valid JSON) was stored, then a 500 on every read and job
            await c.put("/v1/lexicons/ok", content='{"entries":[{"match":"Bob","say":"B\\ud800b"}]}', headers=JSON),
            await c.post("/v1/jobs", content='{"text":"Hi.","lexicon":[{"match":"\\udc00","say":"x"}]}', headers=JSON),
        ]
        return out, await a.keys()

    out, keys = api(scenario)
    assert [r.status_code for r in out] == [422] * 7
    assert "lexicon name 'Bad Name'" in out[0].json()["detail"]
    assert "is not valid RE2" in out[1].json()["detail"]
    assert "at most 1,000" in out[2].json()["detail"]
    assert "matches empty text" in out[3].json()["detail"]
    assert "names a group; use (...) or (?:...)" in out[4].json()["detail"]
    assert "say is not valid Unicode (a lone surrogate)" in out[5].json()["detail"]
    assert "match/regex is not valid Unicode" in out[6].json()["detail"]
    assert keys == []
