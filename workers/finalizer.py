"""The finalize worker: an RQ worker on the fleet's finalize queue (retries, timeouts, failures),
measuring each finalize for its metrics endpoint (workers/metrics.py).

RQ's own scheduler (which queues retries whose wait is over) would run in a forked process that
outlives a killed worker; here it runs as a thread of the worker (RQ's ``RQScheduler``, driven as
its own process would drive it), so it goes when the worker goes.
"""

from __future__ import annotations

import logging
import threading
import time

from fleet.names import Names
from fleet.redis import rq_client, sync_client
from fleet.settings import Settings
from workers import metrics

log = logging.getLogger(__name__)


def measured_worker_class(names: Names, fleet_redis=None):
    """RQ's worker, measuring each finalize in this process (the work horse RQ forks for it exits with
    whatever it counted): how long it took, and the narration job's state after it (one read, from
    ``fleet_redis``: on a Redis Cluster RQ's own connection is another server; None: RQ's)."""
    from rq import Worker

    class MeasuredWorker(Worker):
        def execute_job(self, job, queue):
            started = time.perf_counter()
            try:
                return super().execute_job(job, queue)
            finally:
                self._measure(job, time.perf_counter() - started)

        def _measure(self, job, seconds: float) -> None:
            try:
                job_id = job.args[0]
                raw = (fleet_redis or self.connection).hget(names.job(job_id), "status")
            except Exception:  # noqa: BLE001 - metrics never fail a finalize
                log.debug("could not read the state after finalize %s", job.id, exc_info=True)
                return
            status = raw.decode() if raw else ""
            outcome = {"done": "done", "failed": "failed", "finalizing": "retry"}.get(status, "other")
            metrics.FINALIZES.labels(outcome).inc()
            if outcome == "done":
                metrics.STAGE_WORK.labels("finalize").observe(seconds)
            elif outcome == "retry":  # RQ runs it again after its interval (or gave up: the sweep sees)
                metrics.RETRIES.labels("finalize").inc()

    return MeasuredWorker


def run_finalize_worker(settings: Settings, burst: bool = False) -> int:
    from rq import Queue

    metrics.serve(settings, "finalize worker")
    connection = rq_client(settings)  # RQ pickles payloads: a client without decode_responses
    fleet_redis = sync_client(settings)
    queue = Queue(settings.finalize_queue, connection=connection)
    # Registry maintenance (which retries or fails the job of a worker that was killed mid-finalize,
    # once its timeout has passed) every minute instead of RQ's default ten.
    worker_class = measured_worker_class(Names(settings.key_prefix), fleet_redis)
    worker = worker_class([queue], connection=connection, maintenance_interval=60)
    stop = threading.Event()
    scheduler = threading.Thread(
        target=schedule, args=(settings, queue.name, stop), name="rq-scheduler", daemon=True
    )
    scheduler.start()
    try:
        worker.work(burst=burst, with_scheduler=False, logging_level="INFO")
    finally:
        stop.set()
        scheduler.join(5)
        fleet_redis.close()
    return 0


def schedule(settings: Settings, queue_name: str, stop: threading.Event) -> None:
    """RQ's scheduler loop (``RQScheduler.work`` without its process and signal handlers): hold the
    queue's scheduler lock if no one else does, and queue scheduled jobs (retries) whose time came."""
    from rq.scheduler import RQScheduler

    scheduler = RQScheduler([queue_name], connection=rq_client(settings))
    scheduler.register_birth()
    try:
        while not stop.wait(scheduler.interval):
            try:
                if scheduler.should_reacquire_locks:
                    scheduler.acquire_locks()
                scheduler.heartbeat()
                scheduler.enqueue_scheduled_jobs()
            except Exception:  # noqa: BLE001 - a missed round only delays a retry
                log.exception("RQ scheduler round failed")
    finally:
        try:
            scheduler.release_locks()
            scheduler.register_death()
        except Exception:  # noqa: BLE001 - the locks expire by themselves
            log.debug("releasing the scheduler's locks failed", exc_info=True)
