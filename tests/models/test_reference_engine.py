"""The PyTorch reference engine against Hugging Face's Llama, and its batching guarantees."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from models.engines.base import EngineError, FrameConstraint, SamplingParams
from models.engines.reference import LlamaRunner, ReferenceEngine, load_llama_weights
from models.orpheus import END_OF_SPEECH, ORPHEUS_LAYOUT

PROMPT = [128259, 128000, *range(300, 340), 128009, 128260, 128261, 128257]


def params(seed: int | None = 1, max_tokens: int = 71, **kw) -> SamplingParams:
    values = dict(
        max_tokens=max_tokens,
        temperature=0.6,
        top_p=0.8,
        repetition_penalty=1.3,
        seed=seed,
        stop_token_ids=(END_OF_SPEECH,),
        constraint=FrameConstraint(ORPHEUS_LAYOUT),
    )
    values.update(kw)
    return SamplingParams(**values)


async def collect(engine, request_id, prompt, p):
    out = []
    async for delta in engine.generate(request_id, prompt, p):
        out += delta.token_ids
    return out


@torch.inference_mode()
def assert_matches_hf(directory, prompt, steps=12):
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(str(directory), dtype=torch.float64).eval()
    shape, weights = load_llama_weights(directory, torch.float64, "cpu")
    runner = LlamaRunner(shape, weights, slots=2, max_len=len(prompt) + steps + 1)
    seq = list(prompt)
    hidden = runner.prefill(1, torch.tensor(seq))
    for _ in range(steps):
        ours = runner.logits(hidden[None])[0]
        theirs = hf(torch.tensor([seq])).logits[0, -1]
        assert torch.allclose(ours, theirs, atol=1e-5, rtol=0), (ours - theirs).abs().max()
        seq.append(int(theirs.argmax()))
        hidden = runner.decode(torch.tensor([1]), torch.tensor([seq[-1]]), torch.tensor([len(seq) - 1]))[0]


def test_tiny_logits_match_transformers(tiny_dir):
    assert_matches_hf(tiny_dir, PROMPT)


def test_llama3_rope_scaling_matches_transformers(tmp_path):
    """Llama 3.2 (and Orpheus) checkpoints use 'llama3' RoPE scaling: positions far apart must agree."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=4096,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    )
    LlamaForCausalLM(config).save_pretrained(str(tmp_path))
    assert "llama3" in json.dumps(json.loads((tmp_path / "config.json").read_text()))
    assert_matches_hf(tmp_path, list(range(3, 200)), steps=3)


def test_batch_invariance_and_seeded_reproducibility(tiny_dir):
    async def main():
        engine = ReferenceEngine(tiny_dir, max_num_seqs=4, max_model_len=512)
        alone = [await collect(engine, f"alone-{s}", PROMPT, params(seed=s)) for s in range(6)]
        # six at once through four slots: queued requests join as slots free up (continuous batching)
        together = await asyncio.gather(
            *(collect(engine, f"batch-{s}", PROMPT, params(seed=s)) for s in range(6))
        )
        await engine.shutdown()
        return alone, together

    alone, together = asyncio.run(main())
    assert together == alone
    assert len({tuple(t) for t in alone}) == 6  # different seeds, different codes
    for tokens in alone:
        assert len(tokens) == 71 or tokens[-1] == END_OF_SPEECH
        body = tokens[:-1] if tokens[-1] == END_OF_SPEECH else tokens
        ORPHEUS_LAYOUT.tokens_to_frames(
            body[: len(body) - len(body) % 7]
        )  # every code valid for its position


def test_greedy_is_deterministic_without_seed(tiny_dir):
    async def main():
        engine = ReferenceEngine(tiny_dir, max_num_seqs=2, max_model_len=512)
        a = await collect(engine, "a", PROMPT, params(seed=None, temperature=0.0))
        b = await collect(engine, "b", PROMPT, params(seed=None, temperature=0.0))
        await engine.shutdown()
        return a, b

    a, b = asyncio.run(main())
    assert a == b and len(a) == 71


def test_abort_frees_the_slot_and_errors_are_reported(tiny_dir):
    async def main():
        engine = ReferenceEngine(tiny_dir, max_num_seqs=1, max_model_len=256)
        gen = engine.generate("long", PROMPT, params(max_tokens=200))
        first = await gen.__anext__()
        await gen.aclose()  # leaving the stream aborts the request
        after = await asyncio.wait_for(collect(engine, "next", PROMPT, params(max_tokens=14)), 30)
        with pytest.raises(EngineError, match="max_model_len"):
            await collect(engine, "huge", list(range(300)), params())
        with pytest.raises(EngineError, match="vocabulary"):
            await collect(engine, "bad", [10**7], params())
        await engine.shutdown()
        return first, after

    first, after = asyncio.run(main())
    assert len(first.token_ids) == 1 and len(after) == 14
