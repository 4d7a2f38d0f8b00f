"""The stage base: the loop every worker kind runs, so that a new kind is one subclass.

A stage reads deliveries from its transport and turns each into work; what it computes is its own
(``handle``, or ``process`` for a batch). Everything else is here, once:

1. chores: lease renewal, the readiness heartbeat (if the stage serves models), and its own;
2. room: how many entries it may take now (engine slots, back-pressure on the streams it feeds);
3. accept: entries delivered too often are given up; unreadable ones are permanent; entries of jobs
   that ended or vanished are dropped unworked;
4. settle: one decision per delivery (workers/errors.py ``decide``): ack, retry after a backoff,
   dead-letter and fail the job, or stop the process (fatal: hand back, leave readiness, exit);
5. surviving Redis: connection errors back off (0.25 s doubling to 5 s) and the batch in hand is
   redone; a consumer group a non-persistent Redis lost is recreated;
6. graceful stop: on ``ctx.stop`` the loop ends after the step in hand and every held entry is
   handed back at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeVar

from redis.exceptions import ResponseError

from fleet import readiness
from fleet.messages import MessageError, header_of
from fleet.redis import TRANSIENT_ERRORS
from workers import metrics
from workers.errors import Action, FatalError, PermanentError, Redelivered, RetryPolicy, decide
from workers.runtime import WorkerContext, heartbeat
from workers.transport import Delivery, Transport, consumer_name

log = logging.getLogger(__name__)

M = TypeVar("M")


@dataclass(frozen=True, slots=True)
class Work(Generic[M]):
    """A delivery and the message read from it (None: it could not be read)."""

    delivery: Delivery
    message: M | None

    @property
    def job_id(self) -> str | None:
        return self._field("job_id", str)

    @property
    def segment(self) -> int | None:
        return self._field("segment", int)

    def _field(self, name: str, kind: type):
        """From the message, else best-effort from the entry's header (to fail the right job)."""
        value = getattr(self.message, name, None) if self.message is not None else None
        if value is None:
            value = (header_of(self.delivery.fields) or {}).get(name)
        return value if isinstance(value, kind) and not isinstance(value, bool) else None


async def first_of(*aws) -> None:
    """Wait until the first of ``aws`` completes; cancel the others."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()


class Stage(Generic[M]):
    #: Readiness kind and consumer-name prefix ("ar", "decoder", "speech", "assembler").
    kind: ClassVar[str]
    #: Consumer group on the stage's streams (fleet/names.py).
    group: ClassVar[str]
    #: The message its streams carry (fleet/messages.py).
    message: ClassVar[type]
    #: What the stage does to a segment, for a failed job's reason ("segment 3 failed while decoding").
    activity: ClassVar[str]
    #: Entries taken per read.
    batch_size: int = 1
    #: Read the statuses of the batch's jobs and drop the entries of ended ones before any work (the
    #: decoder: saves decoding). Stages whose first write is a status-checked script (START_SEGMENT,
    #: ADD_DELTA) skip this round trip: the script drops them.
    drop_ended_first: ClassVar[bool] = True

    def __init__(
        self,
        ctx: WorkerContext,
        streams: list[str],
        *,
        transport: Transport | None = None,
        live_models: list[str] | None = None,
        backlog_streams: list[list[str]] | None = None,
        admit_models: list[str] | None = None,
    ) -> None:
        self.ctx = ctx
        #: Of the last room(), the slots only interactive tasks may take (AR workers' reserved slots).
        self.interactive_room = 0
        self.transport = transport or ctx.redis_streams(
            streams, self.group, self.kind, admit_models, reserved=lambda: self.interactive_room
        )
        s = ctx.settings
        self.policy = RetryPolicy(
            s.max_deliveries,
            backoff_base_s=s.retry_backoff_ms / 1000,
            backoff_cap_s=s.retry_backoff_max_ms / 1000,
        )
        #: Models this stage announces itself for in readiness (None: it is not counted).
        self.live_models = live_models
        #: Streams whose backlog holds this stage back (back-pressure on the stages it feeds): one
        #: list per stage fed, its shards, whose lengths are summed (the stage reads them all).
        self.backlog_streams = backlog_streams or []
        #: The error that stopped this process, once fatal.
        self.fatal: BaseException | None = None

    # --- hooks ---------------------------------------------------------------------------------

    def chores(self) -> list[Coroutine[Any, Any, None]]:
        """Background tasks for the stage's life (they end when ``ctx.stop`` is set)."""
        chores = [self.transport.lease_loop(self.ctx.stop)]
        if self.live_models:
            chores.append(heartbeat(self.ctx, self.kind, self.live_models))
        return chores

    def check(self, message: M) -> None:
        """Refuse a message this worker cannot serve (raise ``PermanentError``)."""

    async def room(self) -> int:
        """How many entries to take now; 0 after waiting a moment (back-pressure)."""
        if await self.backlogged():
            await first_of(asyncio.sleep(0.2), self.ctx.stop.wait())
            return 0
        return self.batch_size

    async def backlogged(self) -> bool:
        """Back-pressure: a stage this stage feeds holds more than ``max_stream_backlog`` entries in
        all its shards together."""
        if not self.backlog_streams:
            return False
        return await self.transport.backlog(self.backlog_streams) > self.ctx.settings.max_stream_backlog

    def linger_s(self) -> float:
        return 0.0

    def urgent(self, deliveries: list[Delivery]) -> bool:
        return False

    async def handle(self, work: Work[M]) -> None:
        """Do the work of one delivery; return when it is done (it is then acked), raise to fail it."""
        raise NotImplementedError

    async def process(self, work: list[Work[M]]) -> None:
        """Do a batch: by default one delivery after another, each settled on its own."""
        for item in work:
            if self.fatal is not None:
                return  # the rest is handed back
            await self.settle(item, await self.attempt(self.handle(item)))

    async def wind_down(self) -> None:
        """Stopping: give every held entry back at once (any live worker redoes it)."""
        with contextlib.suppress(*TRANSIENT_ERRORS):  # Redis away: the leases run out instead
            handed = await self.transport.hand_back()
            if handed:
                log.info("%s: handed back %d entr%s", self.kind, handed, "y" if handed == 1 else "ies")

    # --- the loop ------------------------------------------------------------------------------

    async def run(self) -> None:
        """Run until ``ctx.stop``; raises ``FatalError`` if the stage stopped because it cannot serve."""
        chores = [asyncio.create_task(c) for c in self.chores()]
        try:
            await self._resilient_loop()
        finally:
            self.ctx.stop.set()  # whatever ended the loop ends the chores
            await self.wind_down()
            await asyncio.gather(*chores, return_exceptions=True)
        if self.fatal is not None:
            raise FatalError(f"{self.kind} cannot serve: {self.fatal}") from self.fatal

    async def _resilient_loop(self) -> None:
        delay = 0.0
        ready = False
        while not self.ctx.stop.is_set():
            try:
                if not ready:
                    await self.transport.setup()
                    ready = True
                await self.step()
                if delay:
                    log.info("%s: Redis is back", self.kind)
                    delay = 0.0
            except TRANSIENT_ERRORS as exc:
                if not delay:
                    log.warning("%s: Redis unavailable (%s); retrying with backoff", self.kind, exc)
                delay = min(max(delay * 2, 0.25), 5.0)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.ctx.stop.wait(), delay)
            except ResponseError as exc:
                if "NOGROUP" not in str(exc):
                    raise
                log.warning("%s: consumer group gone (Redis lost its data?); recreating it", self.kind)
                ready = False

    async def step(self) -> None:
        # 1) room for work, 2) the batch (the one in hand again after an outage), 3) accept, 4) work
        count = await self.room()
        if count <= 0 or self.ctx.stop.is_set():
            return
        deliveries = await self.transport.next_batch(
            count, self.ctx.settings.block_ms, self.linger_s(), self.urgent
        )
        if deliveries:
            work = await self.accept(deliveries)
            if work:
                await self.process(work)
        self.transport.batch_done()

    async def accept(self, deliveries: list[Delivery]) -> list[Work[M]]:
        """The deliveries worth working on, read; settles the others."""
        readable: list[Work[M]] = []
        now = time.time()
        for d in deliveries:
            if d.deliveries == 1:
                metrics.observe_wait(self.kind, d.entry_id, now)
            if self.policy.exhausted(d.deliveries - 1):  # the worker died on it every time before
                error = Redelivered(
                    f"delivered {d.deliveries} times without finishing (a worker died on it each time)"
                )
                await self.settle(Work(d, None), error)
                continue
            try:
                message = self.message.decode(d.fields)
            except MessageError as exc:
                await self.settle(Work(d, None), PermanentError(f"its message could not be read: {exc}"))
                continue
            try:
                self.check(message)
            except PermanentError as exc:
                await self.settle(Work(d, message), exc)
                continue
            readable.append(Work(d, message))
        if not self.drop_ended_first:
            return readable
        # drop the work of jobs that ended (cancelled, failed) or vanished, unworked
        statuses = await self.ctx.store.statuses({w.message.job_id for w in readable})
        ended = [w for w in readable if (st := statuses[w.message.job_id]) is None or st.terminal]
        await self.transport.ack(*(w.delivery for w in ended))
        return [w for w in readable if w not in ended]

    # --- deciding ------------------------------------------------------------------------------

    async def attempt(self, work: Coroutine[Any, Any, None]) -> BaseException | None:
        """Run one piece of work; its error, if any, for ``settle``. Redis being away is not the
        work's fault: it propagates, and the loop waits and redoes the batch. The time of work that
        succeeded is observed (``narrate_stage_work_seconds``)."""
        started = time.perf_counter()
        try:
            await work
        except TRANSIENT_ERRORS:
            raise
        except Exception as exc:  # noqa: BLE001 - every error is settled by decide()
            return exc
        metrics.STAGE_WORK.labels(self.kind).observe(time.perf_counter() - started)
        return None

    async def settle(self, work: Work[M], error: BaseException | None) -> None:
        """Carry out what ``decide`` says for this delivery."""
        d = work.delivery
        decision = decide(error, d.deliveries, self.policy)
        if decision.action is Action.ACK:
            await self.transport.ack(d)
        elif decision.action is Action.RETRY:
            log.warning(
                "%s: %s failed (delivery %d): %s; retrying in %.1f s",
                self.kind, self._what(work), d.deliveries, decision.reason, decision.delay_s,
                exc_info=error,
            )  # fmt: skip
            await self.transport.retry_later(d, decision.delay_s)
            metrics.RETRIES.labels(self.kind).inc()
        elif decision.action is Action.DEAD_LETTER:
            await self.transport.dead_letter(d, decision.reason)
            metrics.DEAD_LETTERS.labels(self.kind).inc()
            if job_id := work.job_id:
                await self.ctx.store.fail(job_id, self._failure(work, decision.reason))
        else:
            await self._stop_fatally(error)

    async def _stop_fatally(self, error: BaseException | None) -> None:
        """Take no more work, leave readiness at once; ``run`` then hands back and raises."""
        if self.fatal is not None:
            return
        self.fatal = error
        log.error("%s: fatal error, stopping: %s", self.kind, error)
        if self.live_models:
            with contextlib.suppress(Exception):  # a dead Redis forgets us anyway: the entry ages out
                await readiness.leave(
                    self.ctx.redis, self.ctx.names, self.kind, self.live_models, consumer_name(self.kind)
                )
        self.ctx.stop.set()

    def _what(self, work: Work[M]) -> str:
        if work.segment is not None:
            return f"{work.job_id} segment {work.segment}"
        return f"entry {work.delivery.entry_id.decode()}"

    def _failure(self, work: Work[M], reason: str) -> str:
        """The job's error, as its user reads it."""
        if work.segment is not None:
            return f"segment {work.segment} failed while {self.activity}: {reason}"
        return f"failed while {self.activity}: {reason}"
