"""One error taxonomy for every stage, and the one function that decides what happens to a delivery.

- **retryable**: anything not known to be permanent or fatal (a decode that failed, a storage hiccup,
  an engine error on one request). The entry is released with a backoff (doubling, with jitter) and
  redelivered to any worker; once it has been delivered ``max_deliveries`` times it is
  dead-lettered and its job failed.
- **permanent**: retrying cannot help (an unreadable message, a prompt that cannot fit the engine, a
  request the engine refuses, text the voice cannot read, invalid codes). Dead-lettered at once; the
  job fails with a reason the user can read.
- **fatal**: this process cannot serve any more (its engine died, or its GPU context is lost: a CUDA
  error). It stops taking work, hands back every entry it holds, leaves readiness and exits with
  ``FATAL_EXIT_CODE``; the supervisor restarts it.

Redis being away is none of these: the stage loop waits it out and redoes the batch in hand
(workers/stage.py), since nothing about the entry itself went wrong.

Engines map their own errors into this (models/engines: ``EngineRequestError`` is a refused request,
``EngineDeadError`` a dead engine); ``decide`` is the only place that turns an error into an action.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from enum import StrEnum

from fleet.messages import MessageError
from models.engines.base import EngineDeadError, EngineRequestError
from models.family import InvalidCodeError
from models.single_stage import UnsupportedTextError, VoiceError

#: Exit code of a worker that stopped on a fatal error (EX_SOFTWARE): the supervisor restarts it.
FATAL_EXIT_CODE = 70


class PermanentError(Exception):
    """A delivery that can never succeed, raised by a stage (e.g. a message for a model it does not serve)."""


class FatalError(Exception):
    """This process can no longer do its work (raised by a stage, or carrying an engine's error)."""


class Verdict(StrEnum):
    RETRYABLE = "retryable"
    PERMANENT = "permanent"
    FATAL = "fatal"


#: Errors retrying cannot fix: bad messages, refused requests, unreadable text, invalid model output.
PERMANENT: tuple[type[BaseException], ...] = (
    PermanentError,
    MessageError,
    EngineRequestError,
    InvalidCodeError,
    UnsupportedTextError,
    VoiceError,
)
#: Errors after which the process cannot serve.
FATAL: tuple[type[BaseException], ...] = (FatalError, EngineDeadError)


def gpu_context_lost(error: BaseException) -> bool:
    """A CUDA error (torch's ``AcceleratorError``; a ``RuntimeError`` saying "CUDA error:" from
    older torch): an illegal access, a device-side assert, or a fault in another client of the same
    MPS server leave this process's GPU context unusable, so a retry here would fail again on every
    entry, and dead-letter good work. Only a new process recovers. (Running out of GPU memory is
    torch's ``OutOfMemoryError``, which stays retryable.) Told by name: no torch import here."""
    if type(error).__name__ == "AcceleratorError":
        return True
    return isinstance(error, RuntimeError) and str(error).startswith("CUDA error:")


def classify(error: BaseException) -> Verdict:
    if isinstance(error, FATAL) or gpu_context_lost(error):
        return Verdict.FATAL
    if isinstance(error, PERMANENT):
        return Verdict.PERMANENT
    return Verdict.RETRYABLE


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how soon a failed delivery is tried again (one policy for every stage)."""

    #: Deliveries of one entry before it is dead-lettered (the first delivery counts).
    max_deliveries: int
    #: Backoff before the second delivery; doubles with each further one, up to ``backoff_cap_s``.
    backoff_base_s: float = 1.0
    backoff_cap_s: float = 30.0

    def exhausted(self, deliveries: int) -> bool:
        """Whether an entry delivered ``deliveries`` times has had all the tries it gets."""
        return deliveries >= self.max_deliveries

    def backoff_s(self, deliveries: int, rng: random.Random | None = None) -> float:
        """Wait before the next delivery: base * 2^(deliveries - 1), capped, with "equal jitter"
        (half fixed, half random) so that entries failing together do not come back together."""
        wait = min(self.backoff_cap_s, self.backoff_base_s * 2 ** max(deliveries - 1, 0))
        return wait / 2 + (rng or random).uniform(0, wait / 2)


class Action(StrEnum):
    ACK = "ack"  # done (or nothing to do): acknowledge and delete the entry
    RETRY = "retry"  # release it; it comes back to any worker after ``delay_s``
    DEAD_LETTER = "dead-letter"  # out of circulation, and its job fails with ``reason``
    FATAL = "fatal"  # this process stops: hand back everything, exit non-zero


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: str = ""
    delay_s: float = 0.0


class Redelivered(PermanentError):
    """An entry read again after it already had every delivery it gets: its worker died (or was
    killed) on it each time, so it never reached the except ladder."""


def describe(error: BaseException) -> str:
    """An error as a user reads it: its message (its type when it has none), at most 500 characters."""
    text = str(error).strip() or type(error).__name__
    return text if len(text) <= 500 else text[:497] + "..."


def decide(error: BaseException | None, deliveries: int, policy: RetryPolicy) -> Decision:
    """What happens to a delivery that was handled with ``error`` (None: it succeeded), on its
    ``deliveries``-th delivery."""
    if error is None:
        return Decision(Action.ACK)
    verdict = classify(error)
    if verdict is Verdict.FATAL:
        return Decision(Action.FATAL, describe(error))
    if verdict is Verdict.PERMANENT:
        return Decision(Action.DEAD_LETTER, describe(error))
    if policy.exhausted(deliveries):
        return Decision(Action.DEAD_LETTER, f"failed {deliveries} times; last error: {describe(error)}")
    return Decision(Action.RETRY, describe(error), policy.backoff_s(deliveries))
