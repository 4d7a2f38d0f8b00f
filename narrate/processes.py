"""Child processes that never outlive the command that started them.

``spawn`` starts a child in a process group of its own (the terminal's Ctrl-C reaches only the
command, which stops its children in order; ``kill_group`` reaches the child's own children too, e.g.
vLLM's engine core) with the default dispositions of the stop signals (a command started with
SIGINT ignored does not hand that on) and, on Linux, a parent-death signal: if the command dies,
even by SIGKILL, the kernel kills the child too (elsewhere there is none: a SIGKILLed command leaves
its children running there). Workers get SIGKILL: with their supervisor gone (and, embedded, their
Redis), a graceful stop would wait on Redis retries; their leases run out and others redo the work.
The embedded Valkey gets SIGTERM, on which it flushes its append-only file.

The kernel sends the signal when the *thread* that started the child ends: spawn from a thread that
lives as long as the children (the supervisor's main thread).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
from collections.abc import Callable

#: prctl(2) option: the signal the kernel sends this process when its parent exits (Linux).
PR_SET_PDEATHSIG = 1
#: Resolved here, in the parent: the child only calls it (no dynamic loading between fork and exec).
_prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None


def _child_setup(parent: int, death_signal: int) -> Callable[[], None]:
    def setup() -> None:  # runs in the child between fork and exec: no locks, no logging
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        if _prctl is not None:
            _prctl(PR_SET_PDEATHSIG, death_signal)
            if os.getppid() != parent:  # the parent died before prctl: nobody will signal us
                os.kill(os.getpid(), death_signal)

    return setup


def spawn(argv: list[str], *, death_signal: int = signal.SIGKILL, **popen) -> subprocess.Popen:
    """``subprocess.Popen`` in a new process group, with the parent-death signal set."""
    return subprocess.Popen(
        argv, process_group=0, preexec_fn=_child_setup(os.getpid(), death_signal), **popen
    )


def kill_group(proc: subprocess.Popen, sig: int) -> None:
    """Signal the child's whole process group (it and its own children); gone already is fine."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def stop_all(procs: list[subprocess.Popen], timeout: float) -> None:
    """SIGTERM every group, wait up to ``timeout`` for them all, then SIGKILL what is left."""
    import time

    for proc in procs:
        kill_group(proc, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
    for proc in procs:  # the stragglers, and any grandchild left in a group
        kill_group(proc, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
