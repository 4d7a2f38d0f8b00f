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
from collections.abc import Sequence
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


class PlacementError(ValueError):
    """The fleet cannot be placed on these GPUs as asked; the message says why, with the numbers."""


def gpu_name(gpu: str) -> str:
    """A GPU as child names show it: ``g1`` (``g`` and the id, a UUID's odd characters as ``_``)."""
    return "g" + "".join(c if c.isalnum() or c == "-" else "_" for c in gpu)


def decoder_gpus(gpus: Sequence[str], placement: str) -> list[str]:
    """The GPUs that get ``--decoders`` decoders each: every one ("each"), the first ("first"), or the
    one named."""
    if placement == "each":
        return list(gpus)
    if placement == "first":
        return list(gpus[:1])
    if placement not in gpus:
        raise PlacementError(
            f"decoder placement {placement!r}: 'each', 'first' or one of the GPUs ({','.join(gpus)})"
        )
    return [placement]


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
    gpus: Sequence[str] = (),
    decoder_placement: str = "each",
    gpu_memory_share: float | None = None,
) -> list[Child]:
    """The children of a fleet: AR workers (per model) and decoders for two-stage models, speech
    workers for single-stage ones (models/single_stage.py), and the stages every job goes through.
    ``metrics_port`` > 0: each worker child serves its metrics on its own port, this one and the next
    ones in order (the API serves /metrics on its own port).

    ``gpus`` (NARRATE_GPUS): ``ar_workers`` AR workers per model on each GPU, ``decoders`` decoders on
    each GPU of ``decoder_placement`` (``decoder_gpus``), each pinned by ``CUDA_VISIBLE_DEVICES`` and
    named after its GPU (``ar-orpheus-g1-0``, ``decoder-g0-0``); none: no pinning, today's names.
    ``gpu_memory_share`` (vLLM on a GPU: ``vllm_gpu_memory_utilization``): the AR engines of one GPU
    must take less than all of its memory together, else ``PlacementError``."""
    from models.registry import MODELS

    if len(set(gpus)) < len(gpus):
        raise PlacementError(f"a GPU listed twice: {','.join(gpus)}")
    single = [m for m in models if m in MODELS and MODELS[m].single_stage]
    two_stage = [m for m in models if m not in single]
    slots: list[str | None] = list(gpus) or [None]  # None: unpinned, whatever the fleet command sees

    def placed(kind: str, gpu: str | None, i: int, argv: list[str]) -> Child:
        if gpu is None:
            return Child(f"{kind}-{i}", argv)
        return Child(f"{kind}-{gpu_name(gpu)}-{i}", argv, env={"CUDA_VISIBLE_DEVICES": gpu})

    children: list[Child] = []
    if api:
        extra = ["--port", str(api_port)] if api_port else []
        children.append(Child("api", cli_argv("api", *extra)))
    for gpu in slots:
        for model in two_stage:
            for i in range(ar_workers):
                children.append(placed(f"ar-{model}", gpu, i, cli_argv("ar-worker", "--model", model)))
    if two_stage and gpu_memory_share is not None:
        check_gpu_memory(slots, ar_workers, two_stage, gpu_memory_share)
    decoder_slots: list[str | None] = decoder_gpus(list(gpus), decoder_placement) if gpus else [None]
    for gpu in decoder_slots if two_stage else []:
        for i in range(decoders):
            argv = cli_argv("decoder-worker", "--models", ",".join(two_stage))
            children.append(placed("decoder", gpu, i, argv))
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


def check_gpu_memory(slots: list[str | None], ar_workers: int, models: list[str], share: float) -> None:
    """Each GPU's AR engines (``ar_workers`` per model) take ``share`` of its memory each (vLLM's
    ``gpu_memory_utilization``): together less than all of it, or the last engine cannot start (vLLM
    refuses, or finds too little room for its KV cache). Unpinned, every engine takes the first GPU the
    fleet command sees (vLLM's), so they all count against that one."""
    engines = ar_workers * len(models)
    total = engines * share
    if engines and total >= 1.0:
        gpu = "each GPU" if slots != [None] else "the one GPU they all take (no NARRATE_GPUS)"
        workers = f"{ar_workers} AR worker{'s' * (ar_workers != 1)}"
        each = f"{workers} x {len(models)} model{'s' * (len(models) != 1)}: {', '.join(models)}"
        fit = int(0.95 / engines * 100) / 100
        raise PlacementError(
            f"{engines} AR engine{'s' * (engines != 1)} on {gpu} ({each}) x "
            f"NARRATE_VLLM_GPU_MEMORY_UTILIZATION={share:g} = {total:.2f} of its memory, which must stay "
            f"below 1: lower the share (e.g. {fit:g}) or the AR workers per GPU (--ar-workers)"
        )


def fleet_gpu_options(settings) -> dict:
    """``fleet_children``'s GPU arguments from the settings: the GPUs, where decoders go, and the
    memory share each AR engine takes of its GPU (only vLLM on a GPU takes one)."""
    device = settings.device
    if settings.gpu_ids and device.startswith("cuda:") and device != "cuda:0":
        raise PlacementError(
            f"NARRATE_DEVICE={device} with NARRATE_GPUS={settings.gpus}: a pinned child sees only its own "
            "GPU, as cuda (cuda:0); set NARRATE_DEVICE=cuda"
        )
    if settings.cuda_mps and not device.startswith("cuda"):
        raise PlacementError(
            f"NARRATE_CUDA_MPS=1 shares a GPU between the fleet's processes, but NARRATE_DEVICE={device}: "
            "set NARRATE_DEVICE=cuda or leave NARRATE_CUDA_MPS unset"
        )
    on_gpu = settings.engine == "vllm" and device.startswith("cuda")
    return {
        "gpus": settings.gpu_ids,
        "decoder_placement": settings.decoder_placement,
        "gpu_memory_share": settings.vllm_gpu_memory_utilization if on_gpu else None,
    }


def child_env(settings) -> dict[str, str]:
    """The parent's environment plus every setting, so children see exactly the parent's settings."""
    env = dict(os.environ)
    env.update(settings.to_env())
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env
