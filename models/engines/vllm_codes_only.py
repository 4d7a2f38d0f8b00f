"""The LM head over the codec's tokens only: a Llama for vLLM whose logits cover one id range.

A constrained request (the frame constraint of ``vllm_engine``) can only ever be given a code of
its frame position or a stop id, all inside one range of ~28.7k ids of Orpheus' 156,940 (Llasa:
65,539 of 193,800). vLLM's own head multiplies every step's hidden states by the whole embedding
matrix; this one multiplies by the rows of that range (a view: no copy of the weights) and leaves
every other logit at -inf. The candidates' logits are the same products, so sampling is unchanged
(up to the rounding of a differently shaped matrix product). On a GPU the head is ~15 % of a 3B
model's matrix work per token; on the CPU check's tiny model it is most of it.

The logits are float32 (vLLM's sampler converts them to float32 first: given float32, it makes no
full-width copy) in a buffer kept from step to step, whose ids outside the range are -inf once and
stay so: every step writes the range only. Nothing in vLLM's sampling path (penalties, temperature,
bias, masks) nor the frame-constraint processor turns a -inf finite; on an H100 the fill and the
conversion of the full width took ~0.3 ms of a 512-row step's ~14 ms of GPU time
(bench/results/2026-12-05-h100-s18-heads/head1-kernel_profile.txt).

Selected per engine with ``hf_overrides`` (``VllmEngine``'s ``codes_only_range``): the architecture
name ``vllm_engine.CODES_ONLY_ARCHITECTURE`` and the range as a config attribute. Registered with
vLLM's model registry by that name (``vllm_engine`` on import), so only the processes that build
such a model import this module. Stands in for a checkpoint of architecture ``LlamaForCausalLM``
(every model this project serves); ``models.registry.load_engine`` checks that.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from vllm.model_executor.models.llama import LlamaForCausalLM

from models.engines.vllm_engine import CODES_ONLY_RANGE_KEY as RANGE_KEY


class CodesOnlyLlamaForCausalLM(LlamaForCausalLM):
    """``LlamaForCausalLM`` with logits for ``[first, end)`` only (every other id: -inf)."""

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        if vllm_config.parallel_config.tensor_parallel_size != 1:
            raise ValueError("codes-only logits need the whole LM head in one process (tensor_parallel_size 1)")
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        first, end = getattr(vllm_config.model_config.hf_config, RANGE_KEY)
        self._range = (int(first), int(end))
        self._vocab = vllm_config.model_config.get_vocab_size()
        if not 0 <= first < end <= self._vocab:
            raise ValueError(f"{RANGE_KEY} {self._range} is not inside the vocabulary of {self._vocab}")
        self._logits: torch.Tensor | None = None  # float32 [rows, vocab], -inf outside the range

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        first, end = self._range
        # one tensor-parallel rank: row i of the (tied) head is token i
        part = F.linear(hidden_states, self.lm_head.weight[first:end])
        scale = self.logits_processor.scale
        if scale != 1.0:
            part = part * scale
        logits = self._buffer(hidden_states.shape[0], hidden_states.device)
        logits[:, first:end] = part  # converted to float32 as it is written
        return logits

    def _buffer(self, rows: int, device: torch.device) -> torch.Tensor:
        """The first ``rows`` rows of the logits buffer (made, or made larger, at -inf)."""
        if self._logits is None or self._logits.shape[0] < rows or self._logits.device != device:
            self._logits = torch.full((rows, self._vocab), float("-inf"), dtype=torch.float32, device=device)
        return self._logits[:rows]
