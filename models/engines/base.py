"""The AR engine interface: what an AR worker needs from vLLM or the PyTorch reference engine.

An engine runs many requests at once (continuous batching) and streams each one's new tokens.
``generate`` is an async iterator of ``TokenDelta``; leaving it early (break, cancellation, an
exception) aborts the request in the engine. Per-request state is keyed by the request id (I5).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from models.family import TokenLayout


@dataclass(frozen=True, slots=True)
class FrameConstraint:
    """Only the codes of the current frame position may be sampled (and a stop token at a boundary).

    Position = number of tokens generated so far modulo ``layout.codes_per_frame``.
    """

    layout: TokenLayout

    def allowed(self, generated: int) -> tuple[int, int, tuple[int, ...]]:
        """(lo, hi, extra): token ids [lo, hi) plus ``extra`` are allowed after ``generated`` tokens."""
        position = generated % self.layout.codes_per_frame
        lo, hi = self.layout.allowed_range(position)
        return lo, hi, (self.layout.stop_token_ids if position == 0 else ())


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    constraint: FrameConstraint | None = field(default=None)


@dataclass(frozen=True, slots=True)
class TokenDelta:
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort"


class EngineError(RuntimeError):
    """The engine failed a request (or all of them); the segment may be retried."""


class EngineRequestError(EngineError):
    """The engine refuses this request (a prompt that cannot fit, parameters it rejects): retrying it
    can never succeed (workers/errors.py: permanent)."""


class EngineDeadError(EngineError):
    """The engine cannot serve any request any more (its core process died): the worker must stop
    and be restarted (workers/errors.py: fatal)."""


class Engine(Protocol):
    max_num_seqs: int

    async def start(self) -> None:
        """Start serving (once per process, inside the event loop)."""

    def generate(
        self, request_id: str, prompt: list[int], params: SamplingParams
    ) -> AsyncIterator[TokenDelta]: ...

    async def abort(self, request_id: str) -> None: ...

    async def shutdown(self) -> None: ...
