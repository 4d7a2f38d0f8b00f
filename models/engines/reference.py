"""The plain-PyTorch reference AR engine: a Llama forward with a slot KV cache and continuous batching.

It reads the same Hugging Face checkpoint directory vLLM reads (config.json + safetensors) and offers
the same streaming interface, so the AR worker runs unchanged on either. It is the engine of CPU
machines without vLLM and the yardstick of the vLLM parity tests; it is not built for speed.

Batching: every step admits waiting requests into free slots (one prefill each) and advances every
running request by one token in a single batched decode. Per-request state (slot, seed, seen tokens
for the repetition penalty) lives in the request (I5). Sampling is ``models.sampling``: seeded
counter-based noise, so a request's tokens depend on its own logits and seed alone.

Determinism: CPU matrix products are not batch-invariant in float32 (a row's result moves in the
last bits with the batch size), which can flip a sampled token and make a segment's audio depend on
what else was batched with it. On the CPU the engine therefore computes in float64 by default:
differences shrink to ~1e-14 and a request's tokens no longer depend on its neighbours.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from models.engines.base import EngineError, EngineRequestError, SamplingParams, TokenDelta
from models.sampling import SamplingRows, sample_candidates

# --- checkpoint -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class LlamaShape:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    tie_word_embeddings: bool

    @classmethod
    def from_config(cls, cfg: dict) -> LlamaShape:
        rope = cfg.get("rope_parameters") or {}
        scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        heads = cfg["num_attention_heads"]
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=cfg.get("rope_theta") or rope.get("rope_theta", 10000.0),
            rope_scaling=scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        )


def load_llama_weights(
    model_dir: Path, dtype: torch.dtype, device: str
) -> tuple[LlamaShape, dict[str, torch.Tensor]]:
    """Config and weights of a Hugging Face Llama checkpoint (safetensors, sharded or not)."""
    from safetensors.torch import load_file

    model_dir = Path(model_dir)
    shape = LlamaShape.from_config(json.loads((model_dir / "config.json").read_text()))
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    weights: dict[str, torch.Tensor] = {}
    for name in files:
        for key, tensor in load_file(str(model_dir / name), device="cpu").items():
            weights[key.removeprefix("model.")] = tensor.to(device=device, dtype=dtype)
    if "lm_head.weight" not in weights:
        weights["lm_head.weight"] = weights["embed_tokens.weight"]
    return shape, weights


def rope_inv_freq(shape: LlamaShape) -> torch.Tensor:
    dim = shape.head_dim
    inv_freq = 1.0 / (shape.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = shape.rope_scaling or {}
    kind = scaling.get("rope_type") or scaling.get("type")
    if kind == "llama3":  # Llama 3.1/3.2 frequency-dependent scaling
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_len = scaling.get("original_max_position_embeddings", 8192)
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        inv_freq = torch.where(medium, smoothed, scaled)
    elif kind not in (None, "default"):
        raise EngineError(f"rope scaling {kind!r} is not supported by the reference engine")
    return inv_freq


# --- the model ------------------------------------------------------------------------------------


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LlamaRunner:
    """Llama forward passes over a KV cache of ``slots`` sequences of up to ``max_len`` tokens."""

    def __init__(self, shape: LlamaShape, weights: dict[str, torch.Tensor], slots: int, max_len: int) -> None:
        self.shape, self.w, self.max_len = shape, weights, max_len
        embed = weights["embed_tokens.weight"]
        self.dtype, self.device = embed.dtype, embed.device
        cache = (slots, shape.num_kv_heads, max_len, shape.head_dim)
        self.k_cache = [
            torch.zeros(cache, dtype=self.dtype, device=self.device) for _ in range(shape.num_layers)
        ]
        self.v_cache = [
            torch.zeros(cache, dtype=self.dtype, device=self.device) for _ in range(shape.num_layers)
        ]
        freqs = torch.outer(torch.arange(max_len, dtype=torch.float64), rope_inv_freq(shape))
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(self.dtype).to(self.device)
        self.sin = emb.sin().to(self.dtype).to(self.device)

    def _proj(self, layer: int, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.linear(x, self.w[f"layers.{layer}.{name}.weight"], self.w.get(f"layers.{layer}.{name}.bias"))

    def _qkv(self, layer: int, x: torch.Tensor, positions: torch.Tensor):
        s, n = self.shape, x.shape[0]
        q = self._proj(layer, x, "self_attn.q_proj").view(n, s.num_heads, s.head_dim)
        k = self._proj(layer, x, "self_attn.k_proj").view(n, s.num_kv_heads, s.head_dim)
        v = self._proj(layer, x, "self_attn.v_proj").view(n, s.num_kv_heads, s.head_dim)
        cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin, v

    def _mlp_residual(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        h = _rms_norm(x, self.w[f"layers.{layer}.post_attention_layernorm.weight"], self.shape.rms_norm_eps)
        gate = self._proj(layer, h, "mlp.gate_proj")
        up = self._proj(layer, h, "mlp.up_proj")
        return x + self._proj(layer, F.silu(gate) * up, "mlp.down_proj")

    def prefill(self, slot: int, tokens: torch.Tensor) -> torch.Tensor:
        """Run a prompt into ``slot``'s cache; return the last position's final hidden state [H]."""
        s, n = self.shape, tokens.shape[0]
        positions = torch.arange(n, device=self.device)
        x = self.w["embed_tokens.weight"][tokens]
        for layer in range(s.num_layers):
            h = _rms_norm(x, self.w[f"layers.{layer}.input_layernorm.weight"], s.rms_norm_eps)
            q, k, v = self._qkv(layer, h, positions)
            self.k_cache[layer][slot, :, :n] = k.transpose(0, 1)
            self.v_cache[layer][slot, :, :n] = v.transpose(0, 1)
            attn = F.scaled_dot_product_attention(
                q.transpose(0, 1).unsqueeze(0),
                k.transpose(0, 1).unsqueeze(0),
                v.transpose(0, 1).unsqueeze(0),
                is_causal=True,
                enable_gqa=True,
            )[0]
            x = x + self._proj(layer, attn.transpose(0, 1).reshape(n, -1), "self_attn.o_proj")
            x = self._mlp_residual(layer, x)
        return _rms_norm(x[-1], self.w["norm.weight"], s.rms_norm_eps)

    def decode(self, slots: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One token for each of ``slots`` at ``positions``; returns final hidden states [B, H]."""
        s, b = self.shape, tokens.shape[0]
        length = int(positions.max()) + 1
        mask = (torch.arange(length, device=self.device)[None, :] <= positions[:, None])[:, None, None, :]
        x = self.w["embed_tokens.weight"][tokens]
        for layer in range(s.num_layers):
            h = _rms_norm(x, self.w[f"layers.{layer}.input_layernorm.weight"], s.rms_norm_eps)
            q, k, v = self._qkv(layer, h, positions)
            self.k_cache[layer][slots, :, positions] = k
            self.v_cache[layer][slots, :, positions] = v
            keys = self.k_cache[layer][slots, :, :length]
            values = self.v_cache[layer][slots, :, :length]
            attn = F.scaled_dot_product_attention(
                q.unsqueeze(2), keys, values, attn_mask=mask, enable_gqa=True
            )
            x = x + self._proj(layer, attn.reshape(b, -1), "self_attn.o_proj")
            x = self._mlp_residual(layer, x)
        return _rms_norm(x, self.w["norm.weight"], s.rms_norm_eps)

    def logits(self, hidden: torch.Tensor, token_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of ``hidden`` [B, H] over the vocabulary, or over ``token_ids`` only."""
        head = self.w["lm_head.weight"]
        return F.linear(hidden, head if token_ids is None else head[token_ids])


# --- the engine -----------------------------------------------------------------------------------


@dataclass(eq=False)
class _Request:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    queue: asyncio.Queue
    seed: int
    seen_mask: torch.Tensor | None = None  # bool [vocab]: prompt and generated tokens
    slot: int = -1
    generated: int = 0
    next_input: int = -1
    aborted: bool = False


class ReferenceEngine:
    def __init__(
        self,
        model_dir: str | Path,
        *,
        max_num_seqs: int = 32,
        max_model_len: int = 4096,
        device: str = "cpu",
        dtype: torch.dtype | None = None,
    ) -> None:
        if dtype is None:
            dtype = torch.float64 if device == "cpu" else torch.bfloat16
        shape, weights = load_llama_weights(Path(model_dir), dtype, device)
        self.shape = shape
        self.device = device
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.runner = LlamaRunner(shape, weights, max_num_seqs, max_model_len)
        self._free_slots = list(range(max_num_seqs - 1, -1, -1))
        self._waiting: deque[_Request] = deque()
        self._running: dict[str, _Request] = {}
        self._wakeup = asyncio.Event()
        self._loop_task: asyncio.Task | None = None

    # --- public interface -------------------------------------------------------------------------

    async def start(self) -> None:
        """Nothing to start: the step loop begins with the first request."""

    async def generate(
        self, request_id: str, prompt: list[int], params: SamplingParams
    ) -> AsyncIterator[TokenDelta]:
        if request_id in self._running or any(r.request_id == request_id for r in self._waiting):
            raise EngineError(f"request id {request_id!r} is already running")
        if not prompt or len(prompt) >= self.max_model_len:
            raise EngineRequestError(
                f"the prompt of {len(prompt)} tokens does not fit the engine (max_model_len {self.max_model_len})"
            )
        if max(prompt) >= self.shape.vocab_size or min(prompt) < 0:
            raise EngineRequestError("the prompt has token ids outside the vocabulary")
        seed = params.seed if params.seed is not None else random.getrandbits(62)
        seen = torch.zeros(self.shape.vocab_size, dtype=torch.bool, device=self.device)
        seen[torch.tensor(prompt, device=self.device)] = True
        req = _Request(request_id, list(prompt), params, asyncio.Queue(), seed, seen_mask=seen)
        self._waiting.append(req)
        self._ensure_loop()
        finished = False
        try:
            while True:
                item = await req.queue.get()
                if isinstance(item, BaseException):
                    raise EngineError(f"reference engine failed request {request_id}: {item!r}") from item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                await self.abort(request_id)

    async def abort(self, request_id: str) -> None:
        for req in list(self._waiting):
            if req.request_id == request_id:
                self._waiting.remove(req)
        req = self._running.get(request_id)
        if req is not None:
            req.aborted = True  # the slot is released after the step in flight

    async def shutdown(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
            self._loop_task = None

    # --- the step loop ----------------------------------------------------------------------------

    def _ensure_loop(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.create_task(self._loop(), name="reference-engine")
        self._wakeup.set()

    async def _loop(self) -> None:
        while True:
            self._release_aborted()
            if not self._running and not self._waiting:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            admitted = []
            while self._waiting and self._free_slots:
                req = self._waiting.popleft()
                req.slot = self._free_slots.pop()
                self._running[req.request_id] = req
                admitted.append(req)
            decoding = [r for r in self._running.values() if not r.aborted and r not in admitted]
            try:
                results = await asyncio.to_thread(self._step, admitted, decoding)
            except Exception as exc:  # noqa: BLE001 - hand the error to every request of the step
                for req in admitted + decoding:
                    req.queue.put_nowait(exc)
                    self._release(req)
                continue
            for req, token in results:
                self._deliver(req, token)

    def _deliver(self, req: _Request, token: int) -> None:
        if req.aborted:
            return
        req.generated += 1
        req.seen_mask[token] = True
        req.next_input = token
        reason = None
        if token in req.params.stop_token_ids:
            reason = "stop"
        elif req.generated >= req.params.max_tokens or len(req.prompt) + req.generated >= self.max_model_len:
            reason = "length"
        req.queue.put_nowait(TokenDelta([token], finished=reason is not None, finish_reason=reason))
        if reason is not None:
            self._release(req)

    def _release(self, req: _Request) -> None:
        if self._running.pop(req.request_id, None) is not None:
            self._free_slots.append(req.slot)

    def _release_aborted(self) -> None:
        for req in [r for r in self._running.values() if r.aborted]:
            self._release(req)

    @torch.inference_mode()
    def _step(self, admitted: list[_Request], decoding: list[_Request]) -> list[tuple[_Request, int]]:
        rows: list[_Request] = []
        hidden: list[torch.Tensor] = []
        for req in admitted:
            tokens = torch.tensor(req.prompt, device=self.device)
            hidden.append(self.runner.prefill(req.slot, tokens).unsqueeze(0))
            rows.append(req)
        if decoding:
            slots = torch.tensor([r.slot for r in decoding], device=self.device)
            inputs = torch.tensor([r.next_input for r in decoding], device=self.device)
            positions = torch.tensor([len(r.prompt) + r.generated - 1 for r in decoding], device=self.device)
            hidden.append(self.runner.decode(slots, inputs, positions))
            rows.extend(decoding)
        if not rows:
            return []
        return list(zip(rows, self._sample(rows, torch.cat(hidden)), strict=True))

    def _sample(self, rows: list[_Request], hidden: torch.Tensor) -> list[int]:
        """One token per row, drawn by ``models.sampling`` (the vLLM engine's processor uses the
        same function, so both engines sample alike).

        A frame constraint allows one contiguous code range (plus stop ids), so logits are computed
        for those ids only: the same distribution as masking the full vocabulary, far cheaper.
        """
        groups: dict[tuple, list[int]] = {}
        for i, req in enumerate(rows):
            c = req.params.constraint
            key = c.allowed(req.generated) if c is not None else (0, self.shape.vocab_size, ())
            groups.setdefault(key, []).append(i)
        out = [0] * len(rows)
        for (lo, hi, extra), idx in groups.items():
            ids = torch.cat((torch.arange(lo, hi), torch.tensor(extra, dtype=torch.long))).to(self.device)
            logits = self._group_logits(hidden[idx], lo, hi, extra)
            group = [rows[i] for i in idx]
            settings = [
                (p.temperature, p.top_p, p.top_k, p.repetition_penalty, r.seed, r.generated)
                for r in group
                for p in (r.params,)
            ]
            chosen = sample_candidates(
                logits,
                ids.expand(len(group), -1),
                torch.stack([r.seen_mask[ids] for r in group]),
                SamplingRows.build(settings, self.device),
            )
            for i, column in zip(idx, chosen.tolist(), strict=True):
                out[i] = int(ids[column])
        return out

    def _group_logits(self, hidden: torch.Tensor, lo: int, hi: int, extra: tuple[int, ...]) -> torch.Tensor:
        head = self.runner.w["lm_head.weight"]
        logits = F.linear(hidden, head[lo:hi])  # a view: no copy of the head's rows
        if extra:
            logits = torch.cat((logits, F.linear(hidden, head[list(extra)])), dim=1)
        return logits
