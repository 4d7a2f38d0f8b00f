"""The finalize worker: a plain RQ worker on the fleet's finalize queue (retries, timeouts, failures).

RQ's own scheduler (which queues retries whose wait is over) would run in a forked process that
outlives a killed worker; here it runs as a thread of the worker (RQ's ``RQScheduler``, driven as
its own process would drive it), so it goes when the worker goes.
"""

from __future__ import annotations

import logging
import threading

from fleet.redis import sync_client
from fleet.settings import Settings

log = logging.getLogger(__name__)


def run_finalize_worker(settings: Settings, burst: bool = False) -> int:
    from rq import Queue, Worker

    connection = sync_client(settings)  # RQ pickles payloads: a client without decode_responses
    queue = Queue(settings.finalize_queue, connection=connection)
    # Registry maintenance (which retries or fails the job of a worker that was killed mid-finalize,
    # once its timeout has passed) every minute instead of RQ's default ten.
    worker = Worker([queue], connection=connection, maintenance_interval=60)
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
    return 0


def schedule(settings: Settings, queue_name: str, stop: threading.Event) -> None:
    """RQ's scheduler loop (``RQScheduler.work`` without its process and signal handlers): hold the
    queue's scheduler lock if no one else does, and queue scheduled jobs (retries) whose time came."""
    from rq.scheduler import RQScheduler

    scheduler = RQScheduler([queue_name], connection=sync_client(settings))
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
