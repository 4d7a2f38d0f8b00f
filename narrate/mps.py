"""A private CUDA MPS daemon for the fleet's GPU children (the ``cuda_mps`` setting).

Two AR engines and a decoder on one GPU are three processes, and without MPS a GPU runs one
process's kernels at a time, switching between them (time-slicing): on a fast host two engines made
less than one engine alone (docs/benchmarks.md, session 14). NVIDIA's Multi-Process Service funnels
every client's kernels through one server, so they run side by side.

The fleet starts a control daemon of its own: its pipe and log directories are private to this
fleet (a short temporary directory: the pipes are UNIX sockets, whose paths are short), so it
neither finds nor stops anyone else's MPS. Every child gets the pipe directory in its environment,
and the daemon quits when the fleet stops (``quit`` on its control pipe). The GPU's compute mode is
left as it is; under the default mode a process without the variable still runs beside MPS.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import tempfile
from contextlib import ExitStack
from pathlib import Path

log = logging.getLogger(__name__)

#: NVIDIA's control program (part of the driver's utilities).
CONTROL = "nvidia-cuda-mps-control"


class MpsError(RuntimeError):
    """The daemon could not be started (the message says why and what to do)."""


class MpsDaemon:
    def __init__(self) -> None:
        self.program = CONTROL  # its full path once started
        self.directory: Path | None = None  # the private temporary directory while it runs

    @property
    def env(self) -> dict[str, str]:
        """What a child needs to be a client of this daemon (empty until started)."""
        if self.directory is None:
            return {}
        return {
            "CUDA_MPS_PIPE_DIRECTORY": str(self.directory / "pipe"),
            "CUDA_MPS_LOG_DIRECTORY": str(self.directory / "log"),
        }

    def _run(self, args: list[str], stdin: bytes | None = None) -> tuple[int, str]:
        """(exit code, what it printed). Its output goes to a file, not a pipe: ``-d`` forks the
        daemon, which may keep the descriptors it was given, and a pipe would then never close.

        The daemon is not given the command's CUDA_VISIBLE_DEVICES: under one, an MPS server
        renumbers the GPUs it lets its clients see, and a child pinned to GPU 2 would then name
        another GPU than it does without MPS. Seeing them all, it renumbers none."""
        out = self.directory / "log" / "control-command.out"
        env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
        with out.open("wb") as sink:
            done = subprocess.run(
                [self.program, *args], input=stdin, stdout=sink, stderr=subprocess.STDOUT, timeout=30,
                env={**env, **self.env},
            )  # fmt: skip
        return done.returncode, out.read_text(errors="replace").strip()

    def start(self) -> MpsDaemon:
        program = shutil.which(CONTROL)
        if program is None:
            raise MpsError(
                f"NARRATE_CUDA_MPS=1 needs {CONTROL} (NVIDIA's driver utilities) on PATH; "
                "install them or leave NARRATE_CUDA_MPS unset"
            )
        self.program = program
        self.directory = Path(tempfile.mkdtemp(prefix="narrate-mps-"))
        for sub in ("pipe", "log"):
            (self.directory / sub).mkdir()
        code, said = self._run(["-d"])
        if code != 0:
            control_log = self.directory / "log" / "control.log"
            if control_log.exists():
                said += "\n" + control_log.read_text(errors="replace")[-2000:]
            self._forget()
            raise MpsError(f"{CONTROL} -d failed (exit {code}): {said or 'no output'}")
        log.info("CUDA MPS daemon started (pipes in %s)", self.directory / "pipe")
        return self

    def stop(self) -> None:
        """Quit the daemon (its server goes with it once the last client has exited)."""
        if self.directory is None:
            return
        try:
            code, said = self._run([], stdin=b"quit\n")
            if code != 0:
                log.warning("%s quit: exit %d: %s", CONTROL, code, said)
        except (OSError, subprocess.TimeoutExpired) as exc:
            log.warning("%s quit failed: %s", CONTROL, exc)
        self._forget()

    def _forget(self) -> None:
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
        self.directory = None

    def __enter__(self) -> MpsDaemon:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def start_for(settings, stack: ExitStack) -> dict[str, str]:
    """With ``cuda_mps``: start the fleet's daemon, to be quit when ``stack`` closes (after the
    children it serves, when they were put on the stack later); the children's environment
    additions. Without it: nothing, {}."""
    if not settings.cuda_mps:
        return {}
    return stack.enter_context(MpsDaemon()).env
