"""The segment cache on a real Redis and real storage: what is kept, found, touched and released."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

from fleet.names import Names
from fleet.settings import Settings
from fleet.storage import LocalStorage
from jobs.segcache import SegmentCache, keys_of, object_key, scope_of
from jobs.service import JobRequest, validate


def test_keys_follow_what_is_said_and_how_and_scopes_follow_the_setting(tmp_path):
    s = Settings(models="espeak", default_model="espeak", data_dir=tmp_path)
    job, plan = validate(JobRequest(text="One sentence. Another one."), s)
    again, same = validate(JobRequest(text="Another one. One sentence."), s)
    slower, by_rate = validate(JobRequest(text="One sentence. Another one.", rate=120), s)
    keys = keys_of(job, plan, s)
    assert keys_of(again, same, s) == keys[::-1]  # the same sentence anywhere: the same key
    assert not set(keys) & set(keys_of(slower, by_rate, s))  # another rate: other audio
    assert plan.cache_keys == keys and plan.cache_scope == "t-default"
    assert scope_of(s.model_copy(update={"segment_cache": "shared"}), "a") == "shared"
    assert scope_of(s.model_copy(update={"segment_cache": "off"}), "a") is None


def test_promote_lookup_and_release(redis_url, key_prefix, tmp_path):
    async def main():
        r = aioredis.from_url(redis_url)
        storage = LocalStorage(tmp_path / "s")
        cache = SegmentCache(r, Names(key_prefix), Settings())
        storage.put_bytes("parts/a", b"\x01\x00" * 10)
        storage.put_bytes("parts/b", b"\x02\x00" * 20)
        kept = await cache.promote(storage, "t-x", [("parts/a", "ka", 10), ("parts/b", "kb", 20)])
        again = await cache.promote(storage, "t-x", [("parts/a", "ka", 10)])  # already kept: not copied
        hits = await cache.lookup("t-x", ["kb", "nope", "ka"])
        other = await cache.lookup("t-y", ["ka"])
        scopes = await cache.scopes()
        released_fresh = await cache.release_old(storage, "t-x", 3600)
        released = await cache.release_old(storage, "t-x", 0)
        after = await cache.lookup("t-x", ["ka"])
        await r.aclose()
        return kept, again, hits, other, scopes, released_fresh, released, after

    kept, again, hits, other, scopes, released_fresh, released, after = asyncio.run(main())
    assert (kept, again) == (2, 0)
    assert hits == {0: (object_key("t-x", "kb"), 20), 2: (object_key("t-x", "ka"), 10)}
    assert other == {} and scopes == ["t-x"]
    assert (released_fresh, released, after) == (0, 2, {})
    assert not (tmp_path / "s" / "segments").exists() or not any((tmp_path / "s" / "segments").rglob("*.pcm"))
