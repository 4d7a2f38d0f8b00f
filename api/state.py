"""What every request handler uses: the settings and the connections the app's lifespan opened."""

from __future__ import annotations

from dataclasses import dataclass

import redis
from fastapi import Request

from fleet.settings import Settings
from fleet.storage import Storage
from jobs.store import JobStore


@dataclass
class AppState:
    settings: Settings
    store: JobStore
    storage: Storage
    #: RQ's connection (synchronous, no decoded responses): forgetting a deleted job's finalize.
    rq: redis.Redis


def app_state(request: Request) -> AppState:
    """A FastAPI dependency: the state of the app serving this request."""
    return request.app.state.fleet
