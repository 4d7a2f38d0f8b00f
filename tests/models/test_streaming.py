"""The streaming contract (I1): windows cut by FrameChunker, decoded and trimmed, add up to the offline decode."""

from __future__ import annotations

import numpy as np
import pytest

from models.orpheus import END_OF_SPEECH, ORPHEUS_LAYOUT
from models.registry import MODELS
from models.snac_codec import SnacCodec
from models.streaming import FrameChunker

LEVELS = MODELS["tiny"].family.codec_levels


def random_frames(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 4096, size=(n, 7), dtype=np.int32)


def chunk_all(
    frames: np.ndarray, *, feed_size: int = 1, chunk=25, first=5, left=4, right=3, stop=True, uniform=False
):
    chunker = FrameChunker(
        ORPHEUS_LAYOUT,
        chunk_frames=chunk,
        first_chunk_frames=first,
        left_context=left,
        lookahead=right,
        uniform=uniform,
    )
    tokens = ORPHEUS_LAYOUT.frames_to_tokens(frames) + ([END_OF_SPEECH] if stop else [])
    windows = []
    for i in range(0, len(tokens), feed_size):
        windows += chunker.feed(tokens[i : i + feed_size])
    windows += chunker.finish()
    return chunker, windows


@pytest.mark.parametrize("n_frames", [0, 1, 4, 5, 8, 9, 30, 33, 57, 100])
@pytest.mark.parametrize("feed_size", [1, 7, 50])
def test_windows_cover_every_frame_exactly_once(n_frames, feed_size):
    frames = random_frames(n_frames)
    chunker, windows = chunk_all(frames, feed_size=feed_size)
    assert [w.seq for w in windows] == list(range(len(windows)))
    assert windows[-1].final and windows[-1].right == 0 and not any(w.final for w in windows[:-1])
    new = np.concatenate([w.frames[w.left : w.frames.shape[0] - w.right] for w in windows])
    np.testing.assert_array_equal(new, frames)
    if n_frames >= 5 + 3:
        assert windows[0].new_frames == 5 and windows[0].left == 0  # fast first audio
    for w in windows[1:]:
        assert w.left == min(4, sum(x.new_frames for x in windows[: w.seq]))
    # the ramp: 5, 10, 20, then 25 per window; only the final flush may differ
    assert [w.new_frames for w in windows[:-1]] == [min(25, 5 << k) for k in range(len(windows) - 1)]
    assert chunker.stopped and chunker.dropped_tokens == 0


@pytest.mark.parametrize("n_frames", [1, 27, 28, 31, 32, 33, 57, 60, 61, 100, 250])
@pytest.mark.parametrize("feed_size", [1, 7, 50])
def test_uniform_windows_are_all_one_length(n_frames, feed_size):
    """A segment without the ramp: its first window takes 4 more new frames for the left context it
    cannot have, its final one more left context; every window of a segment at least one window long
    is 32 frames, and the new frames still cover the segment exactly once."""
    frames = random_frames(n_frames)
    chunker, windows = chunk_all(frames, feed_size=feed_size, first=25, uniform=True)
    assert chunker.window_frames == 4 + 25 + 3
    new = np.concatenate([w.frames[w.left : w.frames.shape[0] - w.right] for w in windows])
    np.testing.assert_array_equal(new, frames)
    assert windows[-1].final and windows[-1].right == 0
    if n_frames >= 32:
        assert {w.frames.shape[0] for w in windows} == {32}
        assert windows[0].left == 0 and windows[0].new_frames == 29
        assert [w.new_frames for w in windows[1:-1]] == [25] * (len(windows) - 2)
        assert all(w.left >= 4 for w in windows[1:])
    else:
        assert [w.frames.shape[0] for w in windows] == [n_frames]  # one window: the whole segment
    # the same segment without uniform: windows of up to three lengths (first, steady, final)
    _, uneven = chunk_all(frames, feed_size=feed_size, first=25)
    assert len(uneven) >= len(windows)


def test_an_empty_final_window_stays_small():
    """Without look-ahead a segment can end exactly on a window: its final window has no new frames
    and is not widened to a full window of context to decode for nothing."""
    _, windows = chunk_all(random_frames(29 + 25), first=25, right=0, uniform=True)
    assert [w.new_frames for w in windows] == [29, 25, 0]
    assert windows[-1].final and windows[-1].frames.shape[0] == 4


@pytest.mark.parametrize("n_frames", [9, 40, 100])
def test_uniform_windows_keep_the_ramp(n_frames):
    """A job's first segment keeps its fast first audio: only its final window changes."""
    frames = random_frames(n_frames)
    _, uniform = chunk_all(frames, first=1, uniform=True)
    _, plain = chunk_all(frames, first=1)
    assert [w.new_frames for w in uniform] == [w.new_frames for w in plain]
    for u, p in zip(uniform[:-1], plain[:-1], strict=True):
        np.testing.assert_array_equal(u.frames, p.frames)
    if n_frames >= 32:
        assert uniform[-1].frames.shape[0] == 32 and uniform[-1].left >= plain[-1].left


def test_tokens_after_stop_are_ignored_and_partial_frames_dropped():
    chunker = FrameChunker(ORPHEUS_LAYOUT, chunk_frames=25, first_chunk_frames=5, left_context=4, lookahead=3)
    tokens = ORPHEUS_LAYOUT.frames_to_tokens(random_frames(2))
    chunker.feed(tokens + tokens[:3])  # two frames and a partial third
    chunker.feed([END_OF_SPEECH] + tokens)  # stop mid-frame: the partial frame is dropped
    windows = chunker.finish()
    assert chunker.frames == 2 and chunker.dropped_tokens == 3 and chunker.stopped
    assert windows[-1].final and windows[-1].frames.shape[0] == 2


@pytest.fixture
def one_thread():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def codec(tiny_dir):
    return SnacCodec.load(tiny_dir / "snac", LEVELS)


def test_tiny_codec_shape(codec):
    assert codec.sample_rate == 24000 and codec.samples_per_frame == 2048 and codec.codes_per_frame == 7
    audio = codec.decode_frames(random_frames(3)[None])
    assert audio.shape == (1, 3 * 2048) and audio.dtype == np.float32


@pytest.mark.parametrize("uniform", [False, True])
@pytest.mark.parametrize("n_frames", [1, 6, 40, 83])
def test_streaming_deltas_equal_one_offline_decode(codec, n_frames, uniform):
    frames = random_frames(n_frames, seed=n_frames)
    offline = codec.decode_frames(frames[None])[0]
    _, windows = chunk_all(frames, first=25 if uniform else 5, uniform=uniform)
    deltas = codec.decode_windows([(w.frames, w.left, w.right) for w in windows])
    for w, d in zip(windows, deltas, strict=True):
        assert d.shape == (w.new_frames * 2048,) and d.dtype == np.float32
    streamed = np.concatenate(deltas)
    assert streamed.shape == offline.shape
    # SNAC's receptive field is 3 frames each side; 4 left / 3 right leaves only float rounding
    assert np.max(np.abs(streamed - offline)) < 1e-5
    # no discontinuity at chunk boundaries: the jump across a boundary is like any other step
    steps = np.abs(np.diff(streamed))
    boundaries = np.cumsum([len(d) for d in deltas])[:-1]
    boundaries = boundaries[(boundaries > 0) & (boundaries < len(streamed))]
    if len(boundaries):
        assert np.max(steps[boundaries - 1]) <= np.max(steps) + 1e-6


def test_too_little_context_is_audible(codec):
    """The check above can fail: without look-ahead the chunk edges differ from the offline decode."""
    frames = random_frames(40, seed=1)
    offline = codec.decode_frames(frames[None])[0]
    _, windows = chunk_all(frames, left=0, right=0)
    streamed = np.concatenate(codec.decode_windows([(w.frames, w.left, w.right) for w in windows]))
    assert np.max(np.abs(streamed - offline)) > 1e-3


def test_batched_windows_equal_single_windows(codec, one_thread):
    """On the CPU (one window at a time, one intra-op thread: the workers' defaults) a chunk's audio
    does not depend on the chunks decoded with it: the fleet's audio is bit-identical run to run."""
    windows = [(random_frames(32, seed=s), 4, 3) for s in range(20)] + [(random_frames(9, seed=99), 4, 0)]
    batched = codec.decode_windows(windows)
    for window, audio in zip(windows, batched, strict=True):
        np.testing.assert_array_equal(codec.decode_windows([window])[0], audio)
