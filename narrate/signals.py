"""How a supervising command (``narrate file``, ``narrate fleet``) answers SIGINT, SIGTERM and SIGHUP.

Handlers are installed explicitly, whatever the dispositions the command inherited: a command started
with SIGINT ignored (``cmd &`` in a script, ``nohup``) still stops on Ctrl-C or ``kill -INT``. The first
signal asks for a graceful stop (the command cancels its job and stops its children); a second one
kills the children at once. The exit code is 128 + the first signal's number (130, 143, 129).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable

#: The signals a supervising command stops on.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Interrupted(Exception):
    """The command was told to stop by a signal (``exit_code``: 128 + its number)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class StopSignals:
    """Records the first stop signal (``received``, ``event``) and calls ``on_second`` at the next.

    ``raise_in_main``: the first signal also raises ``Interrupted`` in the main thread (to break out
    of a blocking loop); otherwise the command polls ``received``."""

    def __init__(self, on_second: Callable[[], None], raise_in_main: bool = False) -> None:
        self.on_second = on_second
        self.raise_in_main = raise_in_main
        self.received: int | None = None
        self.event = threading.Event()
        self._previous: dict[int, object] = {}

    def _handle(self, signum: int, _frame) -> None:
        if self.received is not None:
            self.on_second()
            return
        self.received = signum
        self.event.set()
        if self.raise_in_main:
            raise Interrupted(signum)

    def __enter__(self) -> StopSignals:
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def check(self) -> None:
        """Raise ``Interrupted`` if a stop signal came."""
        if self.received is not None:
            raise Interrupted(self.received)
