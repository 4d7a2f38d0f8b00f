from __future__ import annotations

import numpy as np
import pytest

from models import orpheus
from models.engines.base import FrameConstraint
from models.family import InvalidCodeError
from models.registry import MODELS

LAYOUT = orpheus.ORPHEUS_LAYOUT


def test_orpheus_token_ids_match_the_published_layout():
    # <custom_token_N> = 128256 + N, N = 10 + position * 4096 + code
    frame = np.array([[0, 1, 2, 3, 4, 5, 4095]], dtype=np.int32)
    tokens = LAYOUT.frames_to_tokens(frame)
    assert tokens == [128266, 132363, 136460, 140557, 144654, 148751, 156937]
    assert all(t < orpheus.VOCAB_SIZE for t in tokens)
    np.testing.assert_array_equal(LAYOUT.tokens_to_frames(tokens), frame)


def test_a_code_of_the_wrong_position_is_a_detected_error():
    tokens = LAYOUT.frames_to_tokens(np.zeros((2, 7), dtype=np.int32))
    tokens[9] = tokens[8]  # position 1's code where position 2's belongs
    with pytest.raises(InvalidCodeError, match="frame 1 position 2"):
        LAYOUT.tokens_to_frames(tokens)
    with pytest.raises(InvalidCodeError):
        LAYOUT.tokens_to_frames([orpheus.EOT] * 7)


def test_constraint_allows_one_position_and_stop_only_at_frame_boundaries():
    c = FrameConstraint(LAYOUT)
    assert c.allowed(0) == (128266, 128266 + 4096, (orpheus.END_OF_SPEECH,))
    assert c.allowed(3) == (128266 + 3 * 4096, 128266 + 4 * 4096, ())
    assert c.allowed(7) == c.allowed(0)


def test_prompt_format_and_budget():
    family = MODELS["orpheus"].family

    class Chars:
        def encode(self, text):
            return [orpheus.BEGIN_OF_TEXT, *map(ord, text)]

    prompt = family.build_prompt(Chars(), "Hi.", "leo")
    assert prompt[:2] == [orpheus.START_OF_HUMAN, orpheus.BEGIN_OF_TEXT]
    assert prompt[2:-4] == list(map(ord, "leo: Hi."))
    assert prompt[-4:] == [orpheus.EOT, orpheus.END_OF_HUMAN, orpheus.START_OF_AI, orpheus.START_OF_SPEECH]
    assert family.max_tokens("x" * 100) == 170 * 7 and family.max_frames("x") == 12
    assert family.frame_seconds == pytest.approx(2048 / 24000)


def test_tiny_uses_exactly_the_orpheus_layout():
    tiny, real = MODELS["tiny"].family, MODELS["orpheus"].family
    assert tiny.layout == real.layout
    assert (tiny.samples_per_frame, tiny.sample_rate, tiny.codec_levels) == (
        real.samples_per_frame,
        real.sample_rate,
        real.codec_levels,
    )
    assert tiny.prompt_prefix == real.prompt_prefix and tiny.prompt_suffix == real.prompt_suffix


def test_tiny_checkpoint_loads_through_the_real_loaders(tiny_dir):
    from models.registry import HFTextTokenizer

    tok = HFTextTokenizer(tiny_dir)
    ids = tok.encode("tara: Héllo.")
    assert ids[0] == orpheus.BEGIN_OF_TEXT and len(ids) == 1 + len("tara: Héllo.".encode())
    assert (tiny_dir / "config.json").exists() and (tiny_dir / "model.safetensors").exists()
    assert (tiny_dir / "snac" / "config.json").exists() and (tiny_dir / "snac" / "pytorch_model.bin").exists()


@pytest.mark.parametrize("model", ["orpheus", "llasa"])
def test_the_generated_range_holds_every_token_a_constrained_request_can_get(model):
    """The codes-only LM head (NARRATE_VLLM_CODES_ONLY_LOGITS) computes logits for this range only."""
    from models.llasa import llasa_family

    layout = (MODELS["orpheus"].family if model == "orpheus" else llasa_family()).layout
    first, end = layout.generated_range()
    allowed = [layout.allowed_range(p) for p in range(layout.codes_per_frame)]
    assert all(first <= lo and hi <= end for lo, hi in allowed)
    assert all(first <= t < end for t in layout.stop_token_ids)
    assert first == min(*layout.stop_token_ids, allowed[0][0]) and end == allowed[-1][1]
    if model == "orpheus":
        assert (first, end) == (orpheus.END_OF_SPEECH, orpheus.VOCAB_SIZE - 2)  # 28,680 of 156,940 ids
