"""The error taxonomy and the one decision per delivery (workers/errors.py)."""

from __future__ import annotations

import random

import pytest
import torch

from fleet.messages import MessageError
from models.engines.base import EngineDeadError, EngineError, EngineRequestError
from models.espeak import UnsupportedTextError, VoiceError
from models.family import InvalidCodeError
from workers.errors import (
    Action,
    FatalError,
    PermanentError,
    Redelivered,
    RetryPolicy,
    Verdict,
    classify,
    decide,
)

POLICY = RetryPolicy(max_deliveries=5, backoff_base_s=1.0, backoff_cap_s=30.0)


@pytest.mark.parametrize(
    ("error", "verdict"),
    [
        (EngineRequestError("prompt too long"), Verdict.PERMANENT),
        (MessageError("bad header"), Verdict.PERMANENT),
        (InvalidCodeError("token 5"), Verdict.PERMANENT),
        (UnsupportedTextError("script"), Verdict.PERMANENT),
        (VoiceError("no such voice"), Verdict.PERMANENT),
        (Redelivered("died on it"), Verdict.PERMANENT),
        (PermanentError("other model"), Verdict.PERMANENT),
        (EngineDeadError("core died"), Verdict.FATAL),
        (FatalError("gone"), Verdict.FATAL),
        (torch.AcceleratorError("CUDA error: an illegal memory access was encountered"), Verdict.FATAL),
        (RuntimeError("CUDA error: device-side assert triggered"), Verdict.FATAL),  # torch before 2.8
        (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), Verdict.RETRYABLE),
        (RuntimeError("the size of tensor a (3) must match the size of tensor b (4)"), Verdict.RETRYABLE),
        (EngineError("a step failed"), Verdict.RETRYABLE),
        (IndexError("index out of range in self"), Verdict.RETRYABLE),
        (OSError("disk full"), Verdict.RETRYABLE),
    ],
)
def test_every_error_has_one_verdict(error, verdict):
    assert classify(error) is verdict


def test_success_is_acked_and_permanent_errors_are_dead_lettered_at_the_first_delivery():
    assert decide(None, 1, POLICY).action is Action.ACK
    d = decide(EngineRequestError("the prompt of 412 tokens does not fit"), 1, POLICY)
    assert d.action is Action.DEAD_LETTER and d.reason == "the prompt of 412 tokens does not fit"


def test_retryable_errors_back_off_with_jitter_then_are_dead_lettered_at_the_limit():
    rng = random.Random(7)
    delays = []
    for deliveries in range(1, 5):
        d = decide(IndexError("boom"), deliveries, POLICY)
        assert d.action is Action.RETRY and d.reason == "boom"
        delays.append(d.delay_s)
        full = min(30.0, 2 ** (deliveries - 1))
        assert full / 2 <= POLICY.backoff_s(deliveries, rng) <= full
    assert all(2 ** (i - 1) / 2 <= delay <= 2 ** (i - 1) for i, delay in enumerate(delays, start=1))
    last = decide(IndexError("boom"), 5, POLICY)
    assert last.action is Action.DEAD_LETTER and last.reason == "failed 5 times; last error: boom"
    assert POLICY.backoff_s(50) <= 30.0  # capped


def test_fatal_errors_stop_the_process_whatever_the_delivery():
    for deliveries in (1, 5, 9):
        assert decide(EngineDeadError("core died"), deliveries, POLICY).action is Action.FATAL


def test_the_delivery_limit_is_one_comparison():
    # after a failure on delivery k the entry is exhausted iff k >= max; read again on delivery k + 1
    # (its worker died on delivery k), it is given up iff the same holds for k
    for k in range(1, 8):
        failed_out = decide(IndexError("x"), k, POLICY).action is Action.DEAD_LETTER
        assert failed_out == POLICY.exhausted(k) == (k >= 5)


def test_messages_are_kept_readable_and_short():
    d = decide(ValueError("x" * 2000), 5, POLICY)
    assert len(d.reason) < 600 and d.reason.endswith("...")
    assert decide(KeyError(), 5, POLICY).reason.endswith("KeyError")
