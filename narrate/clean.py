"""``narrate clean``: free what the embedded data directory holds, and say how much.

Every job of the data directory's Valkey goes (``--keep`` ones and any a killed run left), with its
files; so do the workers' logs and parts no job owns. ``--all`` also removes the Valkey data and the
built test models (rebuilt on their next use). Works only on the embedded data directory: a shared
Redis's jobs are deleted through the API (DELETE /v1/jobs/{id}).
"""

from __future__ import annotations

import asyncio
import shutil
import sys
from contextlib import ExitStack
from pathlib import Path

from fleet.settings import Settings


def size_of(path: Path) -> int:
    if not path.exists():
        return 0
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def human(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


async def delete_every_job(settings: Settings) -> int:
    """Delete every job in this Redis (cancelling unfinished ones); compact the append-only file."""
    from fleet.names import Names
    from fleet.redis import async_client
    from fleet.storage import storage_from_settings
    from jobs import service
    from jobs.store import JobStore

    redis = async_client(settings)
    try:
        store = JobStore.for_settings(redis, settings)
        storage = storage_from_settings(settings)
        deleted = 0
        for raw in await redis.zrange(Names(settings.key_prefix).jobs_index(), 0, -1):
            if (job := await store.get(raw.decode())) is not None:
                await service.delete(store, storage, settings, job)
                deleted += 1
        # the kept sentences (jobs/segcache.py): their index here, their objects below
        cache = [k async for k in redis.scan_iter(match=f"{Names(settings.key_prefix).segment_cache('*')}*")]
        if cache:
            await redis.delete(*cache)
        await compact(redis)
        return deleted
    finally:
        await redis.aclose()


async def compact(redis) -> None:
    """Rewrite the embedded Valkey's append-only file, which otherwise keeps every command of past
    jobs (their audio went through Redis) until Valkey's own rewrite threshold (64 MB by default)."""
    await redis.bgrewriteaof()
    while (await redis.info("persistence")).get("aof_rewrite_in_progress"):
        await asyncio.sleep(0.05)


def run(settings: Settings, everything: bool) -> int:
    from narrate.embedded import DataDirBusy, fleet_redis

    if settings.redis_url:
        print(
            "narrate: clean works on the embedded data directory; with REDIS_URL set, delete jobs through "
            "the API (DELETE /v1/jobs/{id})",
            file=sys.stderr,
        )
        return 2
    data = settings.data_dir
    before = size_of(data)
    with ExitStack() as stack:
        try:
            settings, _ = fleet_redis(settings, stack)
        except DataDirBusy as exc:
            print(f"narrate: {exc}", file=sys.stderr)
            return 2
        jobs = asyncio.run(delete_every_job(settings))
    removed = ["logs", "storage/parts", "storage/segments"] + (["valkey", "models"] if everything else [])
    for name in removed:
        shutil.rmtree(data / name, ignore_errors=True)
    what = f"{jobs} job(s) and their files, the kept sentences, the logs" + (
        ", the Valkey data and the built models" if everything else ""
    )
    print(f"freed {human(max(before - size_of(data), 0))} in {data}: {what}")
    return 0
