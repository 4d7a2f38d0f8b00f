"""Sampling of constrained codec tokens, batched, on any device, the same in every engine.

A codec LM under the frame constraint may only emit the codes of the current frame position (and a
stop token at a frame boundary): a few thousand candidates out of a ~157k-token vocabulary. This
module samples among those candidates only — repetition penalty, temperature, top-k, top-p, then a
draw — so nothing touches the full vocabulary (vLLM's own sampler sorts all of it for top-p and
builds its penalty tensors from Python lists every step).

The draw is the Gumbel-max trick with counter-based noise: the noise of candidate token ``t`` at
generation step ``s`` of a request with seed ``k`` is a hash of ``(k, s, t)``. So a request's
tokens depend only on its own logits and seed — not on its batch neighbours, not on the order of
requests, not on a random generator's state — and a retry with the same seed reproduces them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# splitmix64 constants, as signed 64-bit integers (torch has no uint64 arithmetic)
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
_MIX1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX2 = 0x94D049BB133111EB - (1 << 64)


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def uniform_noise(seeds: torch.Tensor, steps: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """U(0, 1) float64 for each (seed, step, token id): [n] x [n] x [n, k] -> [n, k].

    A splitmix64 hash of the three; integer arithmetic wraps around identically on CPU and GPU.
    """
    x = seeds[:, None] * _GOLDEN + steps[:, None] * _MIX1 + token_ids * _MIX2
    x = x ^ _shift_right(x, 30)
    x = x * _MIX1
    x = x ^ _shift_right(x, 27)
    x = x * _MIX2
    x = x ^ _shift_right(x, 31)
    return (_shift_right(x, 11).double() + 0.5) / float(1 << 53)


@dataclass(frozen=True)
class SamplingRows:
    """Per-row sampling settings of a batch, as device tensors of shape [n]."""

    temperature: torch.Tensor  # float; <= 0 means greedy
    top_p: torch.Tensor  # float; 1 = off
    top_k: torch.Tensor  # int64; 0 = off
    repetition_penalty: torch.Tensor  # float; 1 = off
    seed: torch.Tensor  # int64
    step: torch.Tensor  # int64: tokens generated so far

    @classmethod
    def build(cls, rows: list[tuple[float, float, int, float, int, int]], device, pin: bool = False):
        """From (temperature, top_p, top_k, repetition_penalty, seed, step) tuples; one host->device
        copy per field, non-blocking (no device->host read)."""
        cols = list(zip(*rows, strict=True))

        def put(values, dtype):
            return torch.tensor(values, dtype=dtype, pin_memory=pin).to(device, non_blocking=True)

        return cls(
            temperature=put(cols[0], torch.float64),
            top_p=put(cols[1], torch.float64),
            top_k=put(cols[2], torch.int64),
            repetition_penalty=put(cols[3], torch.float64),
            seed=put(cols[4], torch.int64),
            step=put(cols[5], torch.int64),
        )


def sample_candidates(
    logits: torch.Tensor, token_ids: torch.Tensor, seen: torch.Tensor, rows: SamplingRows
) -> torch.Tensor:
    """Pick one candidate per row; returns the chosen column index, int64 [n] (stays on the device).

    logits: [n, k] raw logits of each row's candidates (-inf for a candidate not allowed now);
    token_ids: [n, k] int64, the candidates' token ids (the noise is tied to them);
    seen: [n, k] bool, candidates already in the request's prompt or output (repetition penalty).
    Order: repetition penalty -> temperature -> top-k -> top-p -> Gumbel-max draw. Every shape
    follows from the inputs' (no data-dependent sizes, no device->host read), so a CUDA graph can
    capture it (the vLLM engine's frame-constraint processor does).
    """
    x = logits.double()
    penalty = rows.repetition_penalty[:, None]
    x = torch.where(seen, torch.where(x > 0, x / penalty, x * penalty), x)
    greedy = rows.temperature <= 0
    x = x / torch.where(greedy, 1.0, rows.temperature)[:, None]
    ordered, order = torch.sort(x, dim=-1, descending=True, stable=True)  # ties: lowest id first
    rank = torch.arange(x.shape[1], device=x.device)[None, :]
    drop = (rows.top_k[:, None] > 0) & (rank >= rows.top_k[:, None])
    probs = torch.softmax(ordered.masked_fill(drop, float("-inf")), dim=-1)
    drop |= (probs.cumsum(-1) - probs) > rows.top_p[:, None]  # keeps the token that crosses top_p
    drop[:, 0] = False  # the most likely candidate always stays
    noise = uniform_noise(rows.seed, rows.step, token_ids.gather(1, order))
    gumbel = -torch.log(-torch.log(noise))
    score = ordered.masked_fill(drop, float("-inf")) + torch.where(greedy[:, None], 0.0, gumbel)
    return order.gather(1, score.argmax(dim=-1, keepdim=True)).squeeze(1)
