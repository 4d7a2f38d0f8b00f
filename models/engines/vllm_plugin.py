"""A vLLM general plugin (entry point ``vllm.general_plugins``): vLLM's own processes die with the AR
worker that started them.

vLLM loads general plugins in every process it starts (engine core, model workers). An AR worker
killed outright (SIGKILL, or its supervisor's death: narrate/processes.py) would otherwise leave its
engine core and workers running, holding their memory (on a GPU: the memory the next engine needs).
Before it builds an engine, the AR worker names itself in ``NARRATE_ENGINE_OWNER``; every vLLM
process but the owner then asks the kernel (Linux) to kill it when its parent dies, so the chain goes
down with the worker. Without that variable (vLLM used by anything else) this does nothing.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

#: Environment variable: pid of the process that owns the vLLM engine (set by the AR worker).
OWNER_ENV = "NARRATE_ENGINE_OWNER"
PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    owner = os.environ.get(OWNER_ENV)
    if not owner or not sys.platform.startswith("linux") or str(os.getpid()) == owner:
        return
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:  # the parent died before the call: nobody would signal us
        os.kill(os.getpid(), signal.SIGKILL)
