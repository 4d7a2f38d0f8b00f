"""The fleet's SNAC decoder against the snac package as published (24 kHz shape, random weights)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from snac import SNAC
from snac.layers import NoiseBlock

from models.snac_codec import CUT_MARGIN, PASS_COST_FRAMES, SNAC_24KHZ_CONFIG, SnacCodec

LEVELS = [[0], [1, 4], [2, 3, 5, 6]]


def published() -> SNAC:
    torch.manual_seed(0)
    model = SNAC(**SNAC_24KHZ_CONFIG).eval()
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, NoiseBlock):  # the fleet decodes without the random noise (I1)
                setattr(module, name, torch.nn.Identity())
    return model


def codes(batch: int, frames: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 4096, size=(batch, frames, 7)).astype(np.int32)


def test_folding_weight_norm_in_changes_no_sample():
    reference, codec = published(), SnacCodec(published(), LEVELS)
    frames = codes(2, 12)
    t = torch.as_tensor(frames, dtype=torch.long)
    with torch.inference_mode():
        expected = reference.decode([t[:, :, level].reshape(2, -1) for level in LEVELS])[:, 0].numpy()
    assert np.array_equal(codec.decode_frames(frames), expected)


@pytest.mark.timeout(600)
def test_the_compiled_decoder_serves_every_window_shape_with_the_same_audio():
    eager, compiled = SnacCodec(published(), LEVELS), SnacCodec(published(), LEVELS, compile=True)
    for batch, length in [(2, 10), (3, 7), (1, 12)]:  # new batch sizes and lengths: no failure
        frames = codes(batch, length, seed=length)
        a, b = eager.decode_frames(frames), compiled.decode_frames(frames)
        assert a.shape == b.shape == (batch, length * 2048)
        np.testing.assert_allclose(b, a, atol=2e-5)


def test_past_the_cut_the_decoder_sees_half_the_margin_either_way():
    """CUT_MARGIN's ground: a change at one position after the first decoder block moves the audio of
    8 positions either way (64 samples each) and nothing beyond; the margin is twice that."""
    codec = SnacCodec(published(), LEVELS)
    with torch.inference_mode():
        x = codec._front(codec.model.quantizer.from_codes(codec._codes(torch.as_tensor(codes(1, 32)).long())))
        assert x.shape[-1] == 32 * 32  # 32 positions a frame there
        audio = codec._back(x)[0, 0]
        nudged = x.clone()
        nudged[..., 500] += 1.0
        moved = torch.nonzero((codec._back(nudged)[0, 0] - audio).abs() > 1e-7).flatten()
    reach = max(500 - moved.min().item() // 64, moved.max().item() // 64 - 500)
    assert 0 < reach <= CUT_MARGIN // 2, reach


@pytest.mark.parametrize("left, right", [(4, 3), (0, 3), (20, 0), (4, 0), (0, 0), (9, 9), (16, 16)])
def test_a_window_cut_to_its_kept_frames_gives_the_samples_of_the_whole_windows_decode(left, right):
    """decode_frames' keep: the later blocks run on the kept frames and the margin only (a steady
    window, a first one, uniform windows' final ones with more context, none kept at all); the
    samples are those of the whole window's decode, to float rounding."""
    codec = SnacCodec(published(), LEVELS)
    frames = codes(1, 32, seed=left * 100 + right)
    whole = codec.decode_frames(frames)[0]
    kept = codec.decode_frames(frames, (left, 32 - right))[0]
    assert kept.shape == ((32 - left - right) * 2048,)
    np.testing.assert_allclose(kept, whole[left * 2048 : (32 - right) * 2048], atol=2e-6)


def passes_of(codec: SnacCodec) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    """Records the shapes of the decoder's passes through its first block and through the rest."""
    fronts, backs = [], []
    front_of, back_of = codec._front_of, codec._back_of
    codec._front_of = lambda frames: fronts.append(frames.shape) or front_of(frames)
    codec._back_of = lambda x: backs.append(tuple(x.shape)) or back_of(x)
    return fronts, backs


@pytest.mark.parametrize("pass_cost_frames", [0.0, PASS_COST_FRAMES])
def test_a_pass_of_windows_with_other_contexts_keeps_each_windows_own_samples(pass_cost_frames):
    """Windows of one length and other contexts go through the first block together and through
    the rest cut to their own kept frames: each still gets exactly its new frames' samples, as when
    decoded whole and alone. Whether the windows that keep fewer frames (23, 9) join the steady
    ones' pass (cut as wide, into their own context) or go alone is the cost of a pass against the
    frames it saves."""
    codec = SnacCodec(published(), LEVELS, max_batch=8, pass_cost_frames=pass_cost_frames)
    contexts = [(4, 3), (6, 3), (23, 0), (4, 3)]  # steady, steady with more context, a final one
    windows = [(codes(1, 32, seed=i)[0], left, right) for i, (left, right) in enumerate(contexts)]
    fronts, backs = passes_of(codec)
    audio = codec.decode_windows(windows)
    assert fronts == [(4, 32, 7)]
    steady = 25 * 32 + 2 * CUT_MARGIN  # 25 kept frames + the margins: the widest span
    if pass_cost_frames == 0:  # frames alone count: each span goes at its own width
        assert backs == [(2, 512, steady), (1, 512, 23 * 32 + 2 * CUT_MARGIN), (1, 512, 9 * 32 + CUT_MARGIN)]
    else:  # a pass costs more than the 18.5 frames the other two passes would save
        assert backs == [(4, 512, steady)]
    whole = SnacCodec(published(), LEVELS)
    for (frames, left, right), got in zip(windows, audio, strict=True):
        expected = whole.decode_frames(frames[None])[0][left * 2048 : (32 - right) * 2048]
        np.testing.assert_allclose(got, expected, atol=2e-6)


def test_windows_of_other_lengths_share_the_later_blocks_cut_to_one_span():
    """Past the first block a window's length no longer matters, only what it keeps: windows of
    three lengths go through the rest in one pass, each cut as wide as the widest span (into its
    own context). A window shorter than a pass's span goes in a pass of its own. (With a pass
    costing 78 frames this beats cutting each of the six spans to its own width: that saves 1.5
    frames for two passes more.) Windows that keep nothing are not decoded."""
    codec = SnacCodec(published(), LEVELS, max_batch=8)
    shapes = [(32, 4, 3), (28, 0, 3), (30, 4, 0), (24, 0, 0), (20, 4, 0), (6, 0, 3), (32, 29, 3), (12, 12, 0)]
    windows = [(codes(1, n, seed=i)[0], left, right) for i, (n, left, right) in enumerate(shapes)]
    fronts, backs = passes_of(codec)
    audio = codec.decode_windows(windows)
    assert sorted(fronts) == [(1, n, 7) for n in (6, 20, 24, 28, 30, 32)]
    assert backs == [
        (3, 512, 26 * 32 + CUT_MARGIN),  # 26 frames + the left margin; 25 + both; 25 + the right one
        (1, 512, 24 * 32),  # its whole window: wide enough to join, too short to be cut that wide
        (1, 512, 16 * 32 + CUT_MARGIN),  # its window is shorter than the spans before it
        (1, 512, 3 * 32 + CUT_MARGIN),
    ]
    assert [len(a) for a in audio[-2:]] == [0, 0]
    plan = codec.plan(windows)  # the same passes, planned without decoding
    assert sorted(plan.front) == [(rows, n) for rows, n, _ in sorted(fronts)]
    assert plan.back == [(rows, width) for rows, _, width in backs]
    assert plan.back_frames() == sum(rows * width for rows, _, width in backs) / 32
    whole = SnacCodec(published(), LEVELS)
    for (frames, left, right), got in zip(windows, audio, strict=True):
        n = frames.shape[0]
        expected = whole.decode_frames(frames[None])[0][left * 2048 : (n - right) * 2048]
        assert got.shape == expected.shape
        np.testing.assert_allclose(got, expected, atol=2e-6)


def test_a_batch_over_the_frame_limit_is_decoded_in_passes_with_the_same_audio():
    """decode_max_frames bounds a forward pass's activations (~2.5 MiB a frame): windows beyond it go
    in several passes, each window's audio as when decoded alone."""
    codec = SnacCodec(published(), LEVELS, max_batch=8, max_frames=20)
    assert [codec.windows_per_pass(n) for n in (7, 10, 11, 25)] == [2, 2, 1, 1]
    assert SnacCodec(published(), LEVELS, max_batch=8).windows_per_pass(10) == 8  # no frame limit
    fronts, backs = passes_of(codec)
    windows = [(codes(1, 10, seed=i)[0], 2, 3) for i in range(5)] + [(codes(1, 7, seed=9)[0], 2, 0)]
    audio = codec.decode_windows(windows)
    # five windows of 10 frames in passes of 2, 2, 1; the one of 7 alone
    assert sorted(fronts) == [(1, 7, 7), (1, 10, 7), (2, 10, 7), (2, 10, 7)]
    # past the first block 5 frames + the margins (~6 frames): 3 a pass
    assert backs == [(3, 512, 5 * 32 + 2 * CUT_MARGIN), (3, 512, 5 * 32 + 2 * CUT_MARGIN)]
    alone = SnacCodec(published(), LEVELS)  # max_batch 1 on the CPU: one window per pass
    for (frames, left, right), got in zip(windows, audio, strict=True):
        expected = alone.decode_windows([(frames, left, right)])[0]
        assert got.shape == expected.shape == ((frames.shape[0] - left - right) * 2048,)
        np.testing.assert_allclose(got, expected, atol=1e-5)


def test_the_bfloat16_decoder_gives_float32_audio_close_to_the_float32_decoder():
    """decoder_bf16: weights and activations in bfloat16 (half the bytes a GPU pass moves); the audio
    comes back as float32 samples of the same shape, within bfloat16's precision of float32's."""
    full, half = SnacCodec(published(), LEVELS), SnacCodec(published(), LEVELS, dtype=torch.bfloat16)
    assert {p.dtype for p in half.model.parameters()} == {torch.bfloat16}
    frames = codes(2, 12, seed=3)
    a, b = full.decode_frames(frames), half.decode_frames(frames)
    assert b.dtype == np.float32 and b.shape == a.shape == (2, 12 * 2048)
    error = np.abs(b - a).max() / np.abs(a).max()
    assert 0 < error < 0.05, error  # not bit-identical, and no more than bfloat16's rounding
    snr_db = 10 * np.log10(np.mean(a**2) / np.mean((b - a) ** 2))
    assert snr_db > 30, snr_db  # ~39 dB on these random weights
    windows = half.decode_windows([(frames[0], 4, 3), (frames[1], 0, 0)])
    assert [w.shape for w in windows] == [(5 * 2048,), (12 * 2048,)]


def test_decoder_bf16_loads_the_models_codec_in_bfloat16(make_settings, monkeypatch):
    from models.registry import get_model, load_codec

    monkeypatch.setenv("NARRATE_DECODER_BF16", "1")  # as an operator sets it
    monkeypatch.setenv("NARRATE_DECODE_PASS_COST_FRAMES", "12.5")
    settings = make_settings("unused:")
    assert settings.decoder_bf16
    codec = load_codec(get_model("tiny", settings), settings)
    assert codec.dtype == torch.bfloat16 and {p.dtype for p in codec.model.parameters()} == {torch.bfloat16}
    assert codec.pass_cost_positions == 12.5 * 32
    audio = codec.decode_windows([(codes(1, 8)[0], 2, 2)])[0]
    assert audio.dtype == np.float32 and audio.shape == (4 * 2048,) and np.isfinite(audio).all()
