"""The finalize worker: a plain RQ worker on the fleet's finalize queue (retries, timeouts, failures)."""

from __future__ import annotations

from fleet.redis import sync_client
from fleet.settings import Settings


def run_finalize_worker(settings: Settings, burst: bool = False) -> int:
    from rq import Queue, Worker

    connection = sync_client(settings)  # RQ pickles payloads: a client without decode_responses
    queue = Queue(settings.finalize_queue, connection=connection)
    worker = Worker([queue], connection=connection, name=None)
    worker.work(burst=burst, with_scheduler=True, logging_level="INFO")
    return 0
