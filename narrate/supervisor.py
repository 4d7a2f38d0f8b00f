"""Runs fleet stages as child processes of one command (``narrate fleet``, ``narrate file``).

Each child is the same CLI command one would run alone against a shared Redis; the supervisor only
starts them (narrate/processes.py: a process group each, a parent-death signal), restarts one that
dies (with backoff), and stops them all (SIGTERM to each group, then SIGKILL).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from narrate.processes import kill_group, spawn, stop_all

log = logging.getLogger(__name__)


@dataclass
class Child:
    name: str
    argv: list[str]
    process: subprocess.Popen | None = None
    restarts: int = 0
    next_start: float = 0.0
    started_at: float = field(default=0.0)
    #: Exit codes of its earlier processes, oldest first (70: it stopped on a fatal error).
    exits: list[int] = field(default_factory=list)
    #: Its own environment variables, over the supervisor's (e.g. its metrics port).
    env: dict[str, str] = field(default_factory=dict)


def free_port() -> int:
    """A TCP port free right now on 127.0.0.1 (for an API child)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cli_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "narrate.cli", *args]


class Supervisor:
    def __init__(
        self,
        children: list[Child],
        env: dict[str, str],
        log_dir: Path | None = None,
        max_backoff_s: float = 30.0,
    ) -> None:
        self.children = children
        self.env = env
        self.log_dir = log_dir
        #: The longest wait before restarting a child that keeps dying (crash-loop protection).
        self.max_backoff_s = max_backoff_s
        self._logs: list[IO] = []

    def _spawn(self, child: Child) -> None:
        out: IO | None = None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            out = open(self.log_dir / f"{child.name}.log", "ab")  # noqa: SIM115 - closed in stop()
            self._logs.append(out)
        env = {**self.env, **child.env} if child.env else self.env
        child.process = spawn(child.argv, env=env, stdout=out, stderr=subprocess.STDOUT if out else None)
        child.started_at = time.monotonic()
        log.info("started %s (pid %d)", child.name, child.process.pid)

    def start(self) -> None:
        for child in self.children:
            self._spawn(child)

    def poll(self) -> None:
        """Restart children that exited, backing off 1, 2, 4 ... ``max_backoff_s`` if they keep dying."""
        now = time.monotonic()
        for child in self.children:
            proc = child.process
            if proc is None or proc.poll() is None:
                continue
            if child.next_start == 0.0:
                if now - child.started_at > 60:
                    child.restarts = 0  # it ran fine for a while: not a crash loop
                delay = min(2**child.restarts, self.max_backoff_s)
                child.next_start = now + delay
                child.exits.append(proc.returncode)
                kill_group(proc, signal.SIGKILL)  # what it started (e.g. vLLM's engine core) goes with it
                log.warning("%s exited with %s; restarting in %d s", child.name, proc.returncode, delay)
            elif now >= child.next_start:
                child.restarts += 1
                child.next_start = 0.0
                self._spawn(child)

    def crash_looping(self, restarts: int = 4) -> list[str]:
        """Children that keep dying (restarted ``restarts`` times without a minute of uptime)."""
        return [c.name for c in self.children if c.restarts >= restarts]

    def stop(self, timeout: float = 10.0) -> None:
        """Stop every child and its own children: SIGTERM, and SIGKILL after ``timeout``."""
        stop_all([c.process for c in self.children if c.process is not None], timeout)
        for f in self._logs:
            f.close()
        self._logs.clear()

    def kill(self) -> None:
        """Kill every child's group at once (a second Ctrl-C)."""
        for child in self.children:
            if child.process is not None:
                kill_group(child.process, signal.SIGKILL)


def fleet_children(
    *,
    api: bool,
    ar_workers: int,
    decoders: int,
    assemblers: int,
    finalizers: int,
    models: list[str],
    api_port: int | None = None,
    speech_workers: int = 1,
    metrics_port: int = 0,
) -> list[Child]:
    """The children of a fleet: AR workers (per model) and decoders for two-stage models, speech
    workers for single-stage ones (models/single_stage.py), and the stages every job goes through.
    ``metrics_port`` > 0: each worker child serves its metrics on its own port, this one and the next
    ones in order (the API serves /metrics on its own port)."""
    from models.registry import MODELS

    single = [m for m in models if m in MODELS and MODELS[m].single_stage]
    two_stage = [m for m in models if m not in single]
    children: list[Child] = []
    if api:
        extra = ["--port", str(api_port)] if api_port else []
        children.append(Child("api", cli_argv("api", *extra)))
    for model in two_stage:
        for i in range(ar_workers):
            children.append(Child(f"ar-{model}-{i}", cli_argv("ar-worker", "--model", model)))
    for i in range(decoders if two_stage else 0):
        children.append(Child(f"decoder-{i}", cli_argv("decoder-worker", "--models", ",".join(two_stage))))
    for i in range(speech_workers if single else 0):
        # each knows how many share the cores (a Piper engine's onnxruntime threads: models/piper.py)
        children.append(
            Child(
                f"speech-{i}",
                cli_argv("speech-worker", "--models", ",".join(single)),
                env={"NARRATE_SPEECH_WORKERS": str(speech_workers)},
            )
        )
    for i in range(assemblers):
        children.append(Child(f"assembler-{i}", cli_argv("assembler")))
    for i in range(finalizers):
        children.append(Child(f"finalizer-{i}", cli_argv("finalize-worker")))
    if metrics_port:
        workers = [c for c in children if c.name != "api"]
        for offset, child in enumerate(workers):
            port = metrics_port + offset
            child.env["NARRATE_METRICS_PORT"] = str(port if port <= 65535 else 0)  # past the last: none
    return children


def child_env(settings) -> dict[str, str]:
    """The parent's environment plus every setting, so children see exactly the parent's settings."""
    env = dict(os.environ)
    env.update(settings.to_env())
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env
