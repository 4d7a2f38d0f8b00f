"""What every worker process shares: settings, connections, the job store, signals, a periodic task."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import redis.asyncio as aioredis

from fleet.names import Names
from fleet.redis import async_client
from fleet.settings import Settings
from fleet.storage import Storage, storage_from_settings
from jobs.scheduler import shard_of
from jobs.store import JobStore
from workers.errors import FATAL_EXIT_CODE, FatalError
from workers.transport import RedisStreams, consumer_name

log = logging.getLogger(__name__)


@dataclass
class WorkerContext:
    settings: Settings
    redis: aioredis.Redis
    names: Names
    store: JobStore
    storage: Storage
    stop: asyncio.Event

    @classmethod
    def create(cls, settings: Settings) -> WorkerContext:
        redis = async_client(settings)
        names = Names(settings.key_prefix)
        store = JobStore.for_settings(redis, settings)
        return cls(settings, redis, names, store, storage_from_settings(settings), asyncio.Event())

    def redis_streams(
        self,
        streams: list[str],
        group: str,
        kind: str,
        admit_models: list[str] | None = None,
        reserved: Callable[[], int] | None = None,
    ) -> RedisStreams:
        """Redis Streams as a stage's transport, with the fleet's lease and dead-letter settings;
        ``admit_models``: the models whose queued tasks it admits before each read (jobs/scheduler.py);
        ``reserved``: how many of the slots it reads for only interactive tasks may take."""

        async def admit(wanted: int) -> int:
            extra = min(reserved(), wanted) if reserved else 0
            scheduler = self.store.scheduler
            return sum([await scheduler.admit(m, wanted - extra, extra) for m in admit_models or ()])

        return RedisStreams(
            self.redis,
            streams,
            group,
            consumer_name(kind),
            dead_letter_stream=self.names.dead_letters(),
            reclaim_idle_ms=self.settings.reclaim_idle_ms,
            admit=admit if admit_models else None,
        )

    @property
    def shards(self) -> range:
        """The shards of every stage stream (``task_shards``): a reader reads them all."""
        return range(self.settings.task_shards)

    def shard(self, job_id: str) -> int:
        """The shard of a job's entries in every stage stream: its task stream's."""
        return shard_of(job_id, self.settings.task_shards)

    async def close(self) -> None:
        await self.redis.aclose()


class StopRequested(Exception):
    """The worker was told to stop while it waited for a machine lock."""


@contextlib.asynccontextmanager
async def machine_lock(
    path: Path, poll_s: float = 0.2, stop: asyncio.Event | None = None
) -> AsyncIterator[None]:
    """Held by one process of this machine at a time (an flock on ``path``): the kernel releases it
    when the holder exits, killed or not. Polls; raises ``StopRequested`` if ``stop`` is set meanwhile."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    locked = False
    try:
        waiting = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                locked = True
                break
            except BlockingIOError:
                if stop is not None and stop.is_set():
                    raise StopRequested(f"stopped while waiting for {path.name}") from None
                if not waiting:
                    log.info("waiting for %s (held by another process of this machine)", path.name)
                    waiting = True
                await asyncio.sleep(poll_s)
        yield
    finally:
        if locked:
            # explicitly: a child forked meanwhile (vLLM's engine core, on CUDA) shares this open
            # file, and closing our descriptor alone would leave the lock held for the child's life
            fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def engine_start_lock(settings: Settings, stop: asyncio.Event | None = None):
    """One AR engine starts at a time per GPU of a machine: vLLM sizes its KV cache by measuring the
    GPU's free memory while it profiles, which another engine starting beside it (allocating and
    freeing its own profiling memory) would falsify, or fail (free memory that grew)."""
    return machine_lock(engine_start_lock_path(settings), stop=stop)


def engine_start_lock_path(settings: Settings) -> Path:
    """Keyed by the GPU vLLM will take, the first of ``CUDA_VISIBLE_DEVICES`` (the settings' device
    index does not reach vLLM); on the CPU, one per machine."""
    if settings.device.startswith("cuda"):
        first = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0].strip() or "0"
        key = "gpu-" + "".join(c if c.isalnum() or c == "-" else "_" for c in first)
    else:
        key = settings.device.split(":")[0]
    return settings.data_dir / "locks" / f"engine-start-{key}.lock"


def gpu_memory_peak() -> str:
    """", GPU memory ... at most": the CUDA memory this process's allocator held at its peak (a host
    read of the allocator's counters, no GPU wait), or "" off the GPU. What a worker beside the AR
    engines takes of their GPU."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return ""
    reserved, allocated = torch.cuda.max_memory_reserved(), torch.cuda.max_memory_allocated()
    # held against in tensors: what the allocator's cache of freed blocks adds to the real need
    return f", GPU memory {reserved / 2**20:.0f} MiB at most ({allocated / 2**20:.0f} MiB in tensors)"


#: PyTorch's allocator hands back old unused cached blocks once this share of its limit is in use
#: (before it would have to free its whole cache, with a device wait, to stay under the limit);
#: each reclaim frees blocks (cudaFree waits for the device), so a pass's peak should stay under it
GPU_MEMORY_RECLAIM_AT = 0.8


def limit_gpu_memory(gb: float | None, device: str) -> str | None:
    """Hold this process's PyTorch allocator to ``gb`` GiB of ``device`` (a worker beside the AR
    engines on one GPU). Call before the process's first CUDA allocation: the reclaim threshold is
    read when the allocator starts. Returns what was set, for the log; None where nothing was."""
    if gb is None or not device.startswith("cuda"):
        return None
    import torch

    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    if "garbage_collection_threshold" not in conf:
        threshold = f"garbage_collection_threshold:{GPU_MEMORY_RECLAIM_AT}"
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = f"{conf},{threshold}" if conf else threshold
    index = torch.device(device).index or 0
    total = torch.cuda.get_device_properties(index).total_memory
    fraction = min(1.0, gb * 2**30 / total)
    torch.cuda.set_per_process_memory_fraction(fraction, index)
    return f"{gb:g} GiB of {total / 2**30:.0f} ({fraction:.3f}), {os.environ['PYTORCH_CUDA_ALLOC_CONF']}"


def configure_torch(settings: Settings) -> None:
    import torch

    if settings.torch_threads > 0:
        torch.set_num_threads(settings.torch_threads)


def run_worker(settings: Settings, main: Callable[[WorkerContext], Awaitable[None]]) -> int:
    """Run ``main`` until it returns or SIGTERM/SIGINT asks it to stop (it should then wind down).
    Returns the exit code: 0, or ``FATAL_EXIT_CODE`` when the worker stopped because it cannot serve
    (its supervisor restarts it). With ``metrics_port`` set, the process serves its metrics there."""
    from workers import metrics

    metrics.serve(settings, "worker")

    async def runner() -> int:
        ctx = WorkerContext.create(settings)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, ctx.stop.set)
        try:
            await main(ctx)
        except FatalError as exc:
            log.error("stopping with exit code %d: %s", FATAL_EXIT_CODE, exc)
            return FATAL_EXIT_CODE
        finally:
            await ctx.close()
        return 0

    return asyncio.run(runner())


async def every(interval_s: float, stop: asyncio.Event, fn: Callable[[], Awaitable[None]], what: str) -> None:
    """Call ``fn`` every ``interval_s`` until ``stop``; log and survive its errors."""
    while not stop.is_set():
        try:
            await fn()
        except Exception:  # noqa: BLE001 - a periodic chore must not kill the worker
            log.exception("%s failed", what)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), interval_s)


async def heartbeat(ctx: WorkerContext, kind: str, models: list[str]) -> None:
    """Announce this worker as live for ``models`` until ``ctx.stop`` (fleet/readiness.py), then leave."""
    from fleet import readiness

    member = consumer_name(kind)
    interval = ctx.settings.heartbeat_s

    async def beat() -> None:
        await readiness.beat(ctx.redis, ctx.names, kind, models, member, interval)

    try:
        await every(interval, ctx.stop, beat, f"{kind} heartbeat")
    finally:
        with contextlib.suppress(Exception):  # a dead Redis forgets us anyway: the entry ages out
            await readiness.leave(ctx.redis, ctx.names, kind, models, member)
