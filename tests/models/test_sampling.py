"""models.sampling: the constrained sampler both engines use (penalty, temperature, top-k/p, seeded draw)."""

from __future__ import annotations

import math

import pytest
import torch

from models.sampling import SamplingRows, sample_candidates, uniform_noise


def rows(n: int, *, temperature=1.0, top_p=1.0, top_k=0, penalty=1.0, seeds=None, step=0) -> SamplingRows:
    seeds = seeds if seeds is not None else list(range(n))
    return SamplingRows.build([(temperature, top_p, top_k, penalty, s, step) for s in seeds], "cpu")


def ids_for(n: int, k: int, base: int = 1000) -> torch.Tensor:
    return (base + torch.arange(k)).expand(n, -1)


def test_noise_is_uniform_deterministic_and_keyed_by_seed_step_and_token():
    seeds = torch.arange(64)
    steps = torch.full((64,), 7)
    token_ids = torch.arange(4096).expand(64, -1)
    u = uniform_noise(seeds, steps, token_ids)
    assert u.dtype == torch.float64 and u.shape == (64, 4096)
    assert float(u.min()) > 0 and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 0.005
    assert abs(float(u.var()) - 1 / 12) < 0.002
    # deciles of 262k draws are within 1 % of each other
    counts = torch.histc(u.float(), bins=10, min=0, max=1)
    assert float(counts.max() / counts.min()) < 1.03
    assert torch.equal(u, uniform_noise(seeds, steps, token_ids))
    assert not torch.equal(u[0], u[1])  # another seed
    assert not torch.equal(u, uniform_noise(seeds, steps + 1, token_ids))  # another step
    assert not torch.equal(u[:, :100], uniform_noise(seeds, steps, token_ids[:, 1:101]))  # another token


def test_greedy_is_argmax_after_the_repetition_penalty():
    logits = torch.tensor([[1.0, 3.0, 2.9, -1.0], [0.5, -0.2, 0.1, 0.4]])
    seen = torch.tensor([[False, True, False, False], [True, False, False, False]])
    picked = sample_candidates(logits, ids_for(2, 4), seen, rows(2, temperature=0.0, penalty=1.3))
    assert picked.tolist() == [2, 3]  # 3.0 / 1.3 < 2.9 ; 0.5 / 1.3 < 0.4
    unpenalised = sample_candidates(logits, ids_for(2, 4), seen, rows(2, temperature=0.0))
    assert unpenalised.tolist() == [1, 0]


def test_negative_logits_are_pushed_down_by_the_penalty():
    logits = torch.tensor([[-1.0, -1.2]])
    picked = sample_candidates(
        logits, ids_for(1, 2), torch.tensor([[True, False]]), rows(1, temperature=0.0, penalty=1.3)
    )
    assert picked.tolist() == [1]  # -1.0 * 1.3 < -1.2


def test_draws_follow_the_softmax_of_the_allowed_candidates():
    n = 20_000
    logits = torch.tensor([2.0, 1.0, 0.0, float("-inf"), 1.5]).expand(n, -1)
    picked = sample_candidates(
        logits, ids_for(n, 5), torch.zeros(n, 5, dtype=torch.bool), rows(n, temperature=0.7)
    )
    expected = torch.softmax(logits[0] / 0.7, dim=-1)
    observed = torch.bincount(picked, minlength=5).double() / n
    assert observed[3] == 0  # a masked candidate is never drawn
    for o, e in zip(observed.tolist(), expected.tolist(), strict=True):
        assert abs(o - e) < 4 * math.sqrt(e * (1 - e) / n) + 1e-9


def test_top_k_and_top_p_cut_the_tail():
    n = 5_000
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0]).expand(n, -1)
    no_seen = torch.zeros(n, 4, dtype=torch.bool)
    top2 = sample_candidates(logits, ids_for(n, 4), no_seen, rows(n, top_k=2))
    assert set(top2.tolist()) == {0, 1}
    p = torch.softmax(logits[0], dim=-1)  # ~[0.64, 0.24, 0.09, 0.03]
    # top-p 0.7 keeps the two tokens whose cumulative mass first crosses 0.7
    nucleus = sample_candidates(logits, ids_for(n, 4), no_seen, rows(n, top_p=0.7))
    assert set(nucleus.tolist()) == {0, 1}
    share = (nucleus == 0).double().mean().item()
    assert abs(share - float(p[0] / p[:2].sum())) < 0.03
    assert set(sample_candidates(logits, ids_for(n, 4), no_seen, rows(n, top_p=0.1)).tolist()) == {0}


def test_a_row_does_not_depend_on_its_batch_neighbours():
    torch.manual_seed(0)
    logits = torch.randn(8, 4096) * 3
    seen = torch.rand(8, 4096) < 0.01
    seeds = [11, 22, 33, 44, 55, 66, 77, 88]
    batch = SamplingRows.build([(0.6, 0.8, 0, 1.3, s, 40 + i) for i, s in enumerate(seeds)], "cpu")
    together = sample_candidates(logits, ids_for(8, 4096), seen, batch)
    for i, s in enumerate(seeds):
        alone = SamplingRows.build([(0.6, 0.8, 0, 1.3, s, 40 + i)], "cpu")
        assert (
            sample_candidates(logits[i : i + 1], ids_for(1, 4096), seen[i : i + 1], alone).item()
            == together[i]
        )
    reversed_rows = SamplingRows.build(
        [(0.6, 0.8, 0, 1.3, s, 40 + i) for i, s in reversed(list(enumerate(seeds)))], "cpu"
    )
    flipped = sample_candidates(logits.flip(0), ids_for(8, 4096), seen.flip(0), reversed_rows)
    assert torch.equal(flipped.flip(0), together)


@pytest.mark.parametrize("seed", [1, 2])
def test_same_seed_same_tokens_other_seed_other_tokens(seed):
    torch.manual_seed(seed)
    logits = torch.randn(1, 4096)
    no_seen = torch.zeros(1, 4096, dtype=torch.bool)
    draws = [
        sample_candidates(logits, ids_for(1, 4096), no_seen, rows(1, seeds=[s], step=step)).item()
        for s in (seed, seed + 100)
        for step in range(20)
    ]
    again = [
        sample_candidates(logits, ids_for(1, 4096), no_seen, rows(1, seeds=[seed], step=step)).item()
        for step in range(20)
    ]
    assert draws[:20] == again
    assert draws[:20] != draws[20:]
