"""Fair admission: which queued segment an engine takes next.

A job's tasks wait in a queue of their own (a Redis list, in book order), not in the stage stream.
When an AR or speech worker has free slots it asks for that many (``admit``): one script moves tasks
from the queues into the stage stream, which the worker then reads through its consumer group as
before (leases, reclaims, dead letters are unchanged). The stream so holds only what engines are
about to take, and the choice of what comes next is made then, by policy, not at submission:

- **classes**: a job is ``interactive`` (short jobs, by default at most ``interactive_max_segments``
  segments, or said so) or ``batch``; an interactive task always goes before a batch one;
- **tenants** (within a class): stride scheduling. Each ready tenant has a pass; the lowest goes next
  and its pass grows by 1/weight, so tenants are served in the ratio of their weights; a tenant that
  comes back from idle starts at the current virtual time (the pass last served);
- **jobs** (within a tenant and class): round robin by a pass of their own; a new job joins at the
  tenant's current turn;
- **segments** (within a job): book order; a runaway retry goes to the front.

Stride scheduling rather than deficit round robin: every task costs one engine slot, so the quantum
is the task and the pass is all the state a tenant needs (one sorted set per class gives the next).

``fifo`` (the ``scheduling`` setting) is the policy before this one, kept as bench/'s baseline: tasks
go straight into the stage stream at submission, in arrival order; nothing is queued or admitted.

Cancelling a job drops its queue in O(1) (``drop``). Every key of a shard carries the shard's hash tag,
so each script touches one Redis Cluster slot; a job's shard is a hash of its id over ``task_shards``.
"""

from __future__ import annotations

import redis.asyncio as aioredis

from fleet.messages import SCHEMA_VERSION, SegmentTask
from fleet.names import Names
from jobs import scripts

INTERACTIVE = "interactive"
BATCH = "batch"
CLASSES = (INTERACTIVE, BATCH)


def shard_of(job_id: str, shards: int) -> int:
    """The shard of a job: its id is hex (a uuid), so its first digits are already uniform."""
    return int(job_id[:8], 16) % max(shards, 1)


class Scheduler:
    def __init__(self, redis: aioredis.Redis, names: Names, shards: int = 1, fifo: bool = False) -> None:
        self.redis = redis
        self.names = names
        self.shards = max(shards, 1)
        self.fifo = fifo
        self._enqueue = redis.register_script(scripts.ENQUEUE)
        self._admit = redis.register_script(scripts.ADMIT)
        self._drop = redis.register_script(scripts.DROP)
        self._place = redis.register_script(scripts.PLACE)

    async def enqueue(
        self, model: str, shard: int, job_id: str, tenant: str, klass: str, weight: int,
        tasks: list[SegmentTask] | list[bytes], front: bool = False,
    ) -> int:  # fmt: skip
        """Queue tasks of a job (at its end, or its ``front``: a retry); returns its queue's length.
        Then one task (the policy's pick) is admitted if the stream has none waiting: a worker idle in
        its blocking read wakes at once instead of at its next read."""
        headers = [t if isinstance(t, bytes) else t.header() for t in tasks]
        if self.fifo:
            return await self._append(model, shard, headers)
        args = [job_id, tenant, klass, max(weight, 1), int(front), *headers]
        length = int(await self._enqueue([self.names.queues(model, shard)], args))
        await self._admit_shard(model, shard, 1)
        return length

    async def _append(self, model: str, shard: int, headers: list[bytes]) -> int:
        pipe = self.redis.pipeline(transaction=True)
        version = str(SCHEMA_VERSION).encode()
        for header in headers:
            pipe.xadd(self.names.tasks(model, shard), {b"v": version, b"h": header})
        await pipe.execute()
        return 0

    async def _admit_shard(self, model: str, shard: int, wanted: int, interactive_extra: int = 0) -> int:
        keys = [self.names.tasks(model, shard), self.names.queues(model, shard)]
        return int(await self._admit(keys, [max(wanted, 0), SCHEMA_VERSION, max(interactive_extra, 0)]))

    async def admit(self, model: str, wanted: int, interactive_extra: int = 0) -> int:
        """Fill each shard's stage stream of ``model`` up to ``wanted`` undelivered tasks (every
        consumer group's pending entries count as delivered), and up to ``interactive_extra`` more
        of interactive jobs (a worker's reserved slots); how many moved."""
        if self.fifo:
            return 0
        moved = 0
        for shard in range(self.shards):
            moved += await self._admit_shard(model, shard, wanted, interactive_extra)
        return moved

    async def drop(self, model: str, shard: int, job_id: str, tenant: str, klass: str) -> int:
        """Drop a job's queued tasks (it ended or was deleted); how many there were."""
        return int(await self._drop([self.names.queues(model, shard)], [job_id, tenant, klass]))

    async def place(self, model: str, shard: int, job_id: str, tenant: str, klass: str):
        """(the job's queued tasks, an estimate of the tasks that go before its next one)."""
        keys = [self.names.tasks(model, shard), self.names.queues(model, shard)]
        queued, ahead = await self._place(keys, [job_id, tenant, klass])
        return int(queued), int(ahead)

    async def queued(self, model: str) -> int:
        """Tasks queued (not yet admitted) for ``model``, every class and shard."""
        pipe = self.redis.pipeline(transaction=False)
        for shard in range(self.shards):
            for klass in CLASSES:
                pipe.get(f"{self.names.queues(model, shard)}:queued:{klass}")
        return sum(int(v or 0) for v in await pipe.execute())

    async def queued_tasks(self, model: str, shard: int, job_id: str) -> list[SegmentTask]:
        """A job's tasks still queued, in the order they will go."""
        raw = await self.redis.lrange(f"{self.names.queues(model, shard)}:job:{job_id}", 0, -1)
        return [SegmentTask.from_header(h) for h in raw]
