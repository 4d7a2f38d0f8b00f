"""The single-codebook family (Llasa's layout, one code per frame): layout, the tiny checkpoint in
the real formats through the registry, streaming through its codec, and the reference engine under
the frame constraint. The abstraction holds with no Orpheus special case."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from fleet.messages import SegmentTask
from fleet.settings import Settings
from models import llasa
from models.engines.base import FrameConstraint
from models.family import InvalidCodeError
from models.registry import MODELS, get_model, load_codec, load_engine, load_tokenizer
from models.streaming import FrameChunker
from workers.ar import SegmentSynthesizer

FAMILY = MODELS["tiny-llasa"].family
LAYOUT = llasa.LLASA_LAYOUT


def test_llasa_token_ids_match_the_published_layout():
    assert (llasa.CODE_BASE, llasa.VOCAB_SIZE) == (128_264, 193_800)
    assert (llasa.TEXT_UNDERSTANDING_START, llasa.TEXT_UNDERSTANDING_END) == (128_258, 128_259)
    assert (llasa.SPEECH_GENERATION_START, llasa.SPEECH_GENERATION_END) == (128_260, 128_261)
    assert llasa.token_name(128_261) == "<|SPEECH_GENERATION_END|>"
    assert llasa.token_name(128_264) == "<|s_0|>" and llasa.token_name(193_799) == "<|s_65535|>"
    frames = np.array([[0], [1], [65535]], dtype=np.int32)
    tokens = LAYOUT.frames_to_tokens(frames)
    assert tokens == [128_264, 128_265, 193_799]
    np.testing.assert_array_equal(LAYOUT.tokens_to_frames(tokens), frames)
    with pytest.raises(InvalidCodeError, match="frame 1 position 0"):
        LAYOUT.tokens_to_frames([128_264, llasa.SPEECH_GENERATION_START])


def test_the_family_states_its_codec_shape():
    assert FAMILY.layout == LAYOUT and FAMILY.layout.codes_per_frame == 1 and FAMILY.codebooks == 1
    assert FAMILY.sample_rate == 16_000 and FAMILY.samples_per_frame == 320 and FAMILY.frame_rate == 50
    assert FAMILY.max_tokens("x" * 100) == 150 and FAMILY.max_tokens("Hi.") == 20  # frames = tokens
    # one code per frame: every step may be any code, or the stop token (every step is a boundary)
    c = FrameConstraint(LAYOUT)
    assert c.allowed(0) == c.allowed(1) == c.allowed(37) == (128_264, 193_800, (llasa.SPEECH_GENERATION_END,))


def test_tiny_llasa_checkpoint_in_the_real_formats(tiny_llasa_dir):
    from transformers import AutoTokenizer

    config = json.loads((tiny_llasa_dir / "config.json").read_text())
    assert config["vocab_size"] == 193_800 and config["architectures"] == ["LlamaForCausalLM"]
    assert (tiny_llasa_dir / "model.safetensors").exists()
    tok = AutoTokenizer.from_pretrained(str(tiny_llasa_dir))
    names = [*llasa.SPECIAL_TOKENS, "<|s_0|>", "<|s_65535|>", "<|eot_id|>"]
    assert tok.convert_tokens_to_ids(names) == [*range(128_256, 128_264), 128_264, 193_799, 128_009]
    codec_config = json.loads((tiny_llasa_dir / "snac" / "config.json").read_text())
    assert codec_config["vq_strides"] == [1] and codec_config["codebook_size"] == 65_536


def test_prompt_is_llasas_chat_turn(tiny_llasa_dir):
    settings = Settings(data_dir=tiny_llasa_dir.parent.parent, models="tiny-llasa")
    spec = get_model("tiny-llasa", settings)
    from transformers import AutoTokenizer

    prompt = spec.family.build_prompt(load_tokenizer(spec, settings), "Hi.", "default")
    text = AutoTokenizer.from_pretrained(str(tiny_llasa_dir)).decode(prompt)
    assert text == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n"
        "Convert the text to speech:<|TEXT_UNDERSTANDING_START|>Hi.<|TEXT_UNDERSTANDING_END|><|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n<|SPEECH_GENERATION_START|>"
    )
    assert prompt[0] == llasa.BEGIN_OF_TEXT and prompt[-1] == llasa.SPEECH_GENERATION_START


@pytest.fixture(scope="module")
def codec(tiny_llasa_dir):
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    settings = Settings(data_dir=tiny_llasa_dir.parent.parent, models="tiny-llasa")
    yield load_codec(get_model("tiny-llasa", settings), settings)
    torch.set_num_threads(before)


def stream(codec, frames, left, right):
    chunker = FrameChunker(LAYOUT, chunk_frames=25, first_chunk_frames=5, left_context=left, lookahead=right)
    windows = chunker.feed(LAYOUT.frames_to_tokens(frames) + [llasa.SPEECH_GENERATION_END]) + chunker.finish()
    deltas = codec.decode_windows([(w.frames, w.left, w.right) for w in windows])
    for w, d in zip(windows, deltas, strict=True):
        assert d.shape == (w.new_frames * 320,) and d.dtype == np.float32
    return np.concatenate(deltas)


@pytest.mark.parametrize("n_frames", [1, 14, 60, 133])
def test_streaming_through_the_single_codebook_codec_equals_an_offline_decode(codec, n_frames):
    assert codec.sample_rate == 16_000 and codec.samples_per_frame == 320 and codec.codes_per_frame == 1
    frames = np.random.default_rng(n_frames).integers(0, 65536, size=(n_frames, 1), dtype=np.int32)
    offline = codec.decode_frames(frames[None])[0]
    streamed = stream(codec, frames, FAMILY.left_context_frames, FAMILY.lookahead_frames)
    assert streamed.shape == offline.shape == (n_frames * 320,)
    assert np.max(np.abs(streamed - offline)) < 1e-5


def test_the_receptive_field_is_ten_frames(codec):
    """Why 10/10: measured, 10 frames of context and look-ahead leave < 1e-6 (float rounding), 9 about
    1e-5 (a third of an int16 step), 8 about 2e-4 (several int16 steps)."""
    frames = np.random.default_rng(5).integers(0, 65536, size=(80, 1), dtype=np.int32)
    offline = codec.decode_frames(frames[None])[0]
    assert np.max(np.abs(stream(codec, frames, 10, 10) - offline)) < 1e-6
    assert np.max(np.abs(stream(codec, frames, 8, 10) - offline)) > 1e-4
    assert np.max(np.abs(stream(codec, frames, 10, 8) - offline)) > 1e-4


def test_reference_engine_makes_valid_codes_and_audio(tiny_llasa_dir, codec):
    settings = Settings(data_dir=tiny_llasa_dir.parent.parent, models="tiny-llasa", max_model_len=512)
    spec = get_model("tiny-llasa", settings)
    engine = load_engine(spec, settings)
    synth = SegmentSynthesizer.for_model(spec, settings, engine)
    assert (synth.streaming.left_context, synth.streaming.lookahead) == (10, 10)
    texts = ["The harbour woke before the town did.", "Hi.", "Gulls argued over the nets."]

    async def run():
        async def one(i, text):
            task = SegmentTask("j", i, text, "tiny-llasa", "default", seed=i)
            return [w async for batch in synth.windows(task, f"j:{i}:1") for w in batch]

        try:
            return await asyncio.gather(*(one(i, t) for i, t in enumerate(texts)))
        finally:
            await engine.shutdown()

    for text, windows in zip(texts, asyncio.run(run()), strict=True):
        frames = sum(w.new_frames for w in windows)
        assert frames == max(20, int(np.ceil(len(text) * 1.5)))  # random weights use the whole budget
        codes = np.concatenate([w.frames[w.left : w.frames.shape[0] - w.right] for w in windows])
        assert codes.shape == (frames, 1) and codes.min() >= 0 and codes.max() < 65536
        assert len(np.unique(codes)) > frames // 2  # sampled codes, not a constant
        audio = np.concatenate(codec.decode_windows([(w.frames, w.left, w.right) for w in windows]))
        assert audio.shape == (frames * 320,) and np.isfinite(audio).all()
