"""The finalize worker: a plain RQ worker on the fleet's finalize queue (retries, timeouts, failures)."""

from __future__ import annotations

from fleet.redis import sync_client
from fleet.settings import Settings


def run_finalize_worker(settings: Settings, burst: bool = False) -> int:
    from rq import Queue, Worker

    connection = sync_client(settings)  # RQ pickles payloads: a client without decode_responses
    queue = Queue(settings.finalize_queue, connection=connection)
    # Registry maintenance (which retries or fails the job of a worker that was killed mid-finalize,
    # once its timeout has passed) every minute instead of RQ's default ten.
    worker = Worker([queue], connection=connection, maintenance_interval=60)
    worker.work(burst=burst, with_scheduler=True, logging_level="INFO")
    return 0
