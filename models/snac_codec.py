"""SNAC codec decoder (stage 1): frames of codes -> PCM, in batched windows.

The decoder is used without its NoiseBlocks' random noise (they draw fresh noise on every call, even
in eval mode): with it off, a retried or re-decoded chunk gives bit-identical audio, and streaming
output equals an offline decode (invariant I1). Measured receptive field of SNAC 24 kHz (random
weights, fp32): a window edge disturbs the 3 nearest frames on either side and nothing beyond
(error < 1e-6 at 3 frames), hence the defaults left_context_frames=4, lookahead_frames=3.

On the CPU, windows are decoded one at a time: batching there gains nothing (one window of 32
frames decodes faster alone than in a batch of 8) and batched float32 convolutions are not
batch-invariant (oneDNN picks kernels by shape, so a window's samples move in the last bits with its
neighbours, flipping int16 LSBs). One at a time, with one intra-op thread (NARRATE_TORCH_THREADS=1,
the default), a window's audio depends only on its codes. On GPUs windows are decoded in batches
of up to 256 (below; not promised bit-identical across batch compositions).

Only the new frames' audio of a window is kept, so the decoder's later blocks (~90 % of its work on
the CPU: they run at 3–24 kHz) run on those frames and a margin, not on the whole window: the cut is
made after its first block (375 positions a second, 32 a frame), where the rest of the decoder sees
8 positions either way (measured; the margin is twice that), so the kept samples are the same as
from the whole window's decode, to float rounding (~5e-7). For a steady window (4 + 25 + 3 frames)
that is 26 of 32 frames through the later blocks. Past the cut a window's length no longer matters,
only its span, so a batch of windows is decoded in two stages: the first block batched by window
length, the rest batched by span (``decode_windows``). How the spans are grouped weighs the frames a
grouping runs against the passes it takes: on a GPU each pass costs as much as tens of frames
(``PASS_COST_FRAMES``), so many narrow passes can be slower than a few wide ones.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from snac import SNAC
from snac.layers import DecoderBlock, NoiseBlock
from torch.nn.utils import parametrize

#: After the first decoder block of SNAC 24 kHz, positions a later block's output depends on, either
#: way: 8 (tests/models/test_snac_codec.py), doubled. A window is cut there to its kept frames +- this.
CUT_MARGIN = 16

#: What one pass through the later blocks costs beyond its frames, in frames (``decode_pass_cost_frames``):
#: on an H100 (compiled, bfloat16; session 27, bench/decoder_speed.py --windows) ~1.6 ms a pass against
#: ~20 us a frame, fitted to the bench's cut/whole pairs of reads of 8, and predicting those of reads
#: of 32 within ~0.04 s of 1.7-2.9 s. Any cost from 32 to 150 groups the fleet's uneven windows alike.
PASS_COST_FRAMES = 78.0

#: Groupings of the spans the later blocks' passes are chosen from: a span joins a pass at least this
#: share of the pass's width (0: any span its window can hold; 1: only spans as wide).
_FILLS = (0.0, 0.5, 0.75, 0.9, 1.0)

#: The shape of SNAC 24 kHz as Orpheus uses it (hubertsiuzdak/snac_24khz's config.json): 19.8 M
#: parameters, hop 512, codebooks of 4096 at strides 4/2/1 -> 1 + 2 + 4 codes per 2048-sample frame.
SNAC_24KHZ_CONFIG = dict(
    sampling_rate=24000,
    encoder_dim=48,
    encoder_rates=[2, 4, 8, 8],
    latent_dim=None,
    decoder_dim=1024,
    decoder_rates=[8, 8, 4, 2],
    attn_window_size=None,
    codebook_size=4096,
    codebook_dim=8,
    vq_strides=[4, 2, 1],
    noise=True,
    depthwise=True,
)


@dataclass
class _Span:
    """A window as the decoder's later blocks see it: of its ``positions`` after the first block
    (32 a frame), they need ``lo..hi-1`` for its ``kept`` positions from ``first``."""

    window: int  # its index in decode_windows' input
    positions: int
    lo: int
    hi: int
    first: int
    kept: int

    @property
    def width(self) -> int:
        return self.hi - self.lo


@dataclass
class DecodePlan:
    """How decode_windows batches a set of windows: its passes through the first block (windows,
    frames each) and through the rest (windows, positions each)."""

    front: list[tuple[int, int]]
    back: list[tuple[int, int]]
    positions_per_frame: int

    def back_frames(self) -> float:
        """Frames through the later blocks (32 positions each), margins and wider cuts included."""
        return sum(rows * width for rows, width in self.back) / self.positions_per_frame


class SnacCodec:
    def __init__(
        self,
        model: SNAC,
        levels: Sequence[Sequence[int]],
        device: str = "cpu",
        max_batch: int | None = None,
        compile: bool = False,
        max_frames: int | None = None,
        dtype: torch.dtype = torch.float32,
        cut: bool = True,
        pass_cost_frames: float = PASS_COST_FRAMES,
    ) -> None:
        for _name, module in list(model.named_modules()):
            for child_name, child in list(module.named_children()):
                if isinstance(child, NoiseBlock):
                    setattr(module, child_name, torch.nn.Identity())
            # weight norm recomputes every convolution's weight on every call (3 kernels per layer):
            # compute it once; the weights are bit-identical to what each call would compute
            if parametrize.is_parametrized(module, "weight"):
                parametrize.remove_parametrizations(module, "weight", leave_parametrized=True)
        # bfloat16 weights and activations: half the bytes through the Snake activations and the
        # upsampling convolutions, which is what the decoder's GPU time goes to (not bit-identical
        # to float32: ~1e-2 at most on random weights); the audio leaves as float32 either way
        self.model = model.eval().to(device=device, dtype=dtype)
        self.dtype = dtype
        layers = self.model.decoder.model
        # where the decoder is cut to a window's kept frames: after its first upsampling block (the
        # shape measured for CUT_MARGIN; another shape is decoded whole)
        first_block = next(i for i, layer in enumerate(layers) if isinstance(layer, DecoderBlock))
        self._cut = cut and list(model.decoder_rates) == [8, 8, 4, 2] and model.attn_window_size is None
        self._front, self._back = layers[: first_block + 1], layers[first_block + 1 :]
        if compile:
            # fuses the Snake activations and residual adds around the convolutions; dynamic shapes:
            # windows come in many lengths and batch sizes, and one compilation serves them all
            self._front = torch.compile(self._front, dynamic=True)
            self._back = torch.compile(self._back, dynamic=True)
        self.device = device
        self.levels = [list(level) for level in levels]
        self._level_index = [torch.tensor(level, device=device) for level in self.levels]
        self.sample_rate = int(model.sampling_rate)
        self.samples_per_frame = int(model.hop_length * model.vq_strides[0])
        self.codes_per_frame = sum(len(level) for level in self.levels)
        # positions after the first block: the later blocks upsample each to this many samples
        self._samples_per_position = int(np.prod(model.decoder_rates[1:]))
        self._positions_per_frame = self.samples_per_frame // self._samples_per_position
        # past the first block spans are grouped into passes to the least frames + passes x this
        self.pass_cost_positions = pass_cost_frames * self._positions_per_frame
        self.max_batch = max_batch or (1 if device == "cpu" else 256)
        # activations grow with the frames of a pass (~2.5 MiB each for SNAC 24 kHz in float32)
        self.max_frames = max_frames

    @classmethod
    def load(
        cls,
        directory: str | Path,
        levels: Sequence[Sequence[int]],
        device: str = "cpu",
        max_batch: int | None = None,
        compile: bool = False,
        max_frames: int | None = None,
        dtype: torch.dtype = torch.float32,
        cut: bool = True,
        pass_cost_frames: float = PASS_COST_FRAMES,
    ) -> SnacCodec:
        """Load a codec directory as the snac package saves it (config.json + pytorch_model.bin)."""
        model = SNAC.from_pretrained(str(directory))
        return cls(model, levels, device, max_batch, compile, max_frames, dtype, cut, pass_cost_frames)

    def _codes(self, frames: torch.Tensor) -> list[torch.Tensor]:
        # frames: [B, n, codes_per_frame] -> one [B, n * len(level)] tensor per level, frame-major
        # device index tensors: indexing with a Python list would copy it to the device each call
        return [frames.index_select(2, index).reshape(frames.shape[0], -1) for index in self._level_index]

    def _front_of(self, frames: np.ndarray) -> torch.Tensor:
        """[B, n, codes_per_frame] codes -> the decoder's state after its first block, [B, C, n * 32]."""
        batch = torch.as_tensor(np.ascontiguousarray(frames), dtype=torch.long, device=self.device)
        return self._front(self.model.quantizer.from_codes(self._codes(batch)))

    def _back_of(self, x: torch.Tensor) -> np.ndarray:
        """[B, C, positions] -> [B, positions * samples a position] float32 audio on the host."""
        return self._back(x)[:, 0].float().cpu().numpy()

    def _span(self, positions: int, first: int, end: int) -> tuple[int, int]:
        """Of a window's ``positions`` after the first block, those the later blocks need for its
        frames first..end-1: theirs and the margin (all of them where the decoder is not cut)."""
        if not self._cut:
            return 0, positions
        per_frame = self._positions_per_frame
        return max(0, first * per_frame - CUT_MARGIN), min(positions, end * per_frame + CUT_MARGIN)

    @torch.inference_mode()
    def decode_frames(self, frames: np.ndarray, keep: tuple[int, int] | None = None) -> np.ndarray:
        """Decode [B, n, codes_per_frame] codes to [B, n * samples_per_frame] float32 audio, or, with
        ``keep`` = (first, end), the samples of frames first..end-1 only, [B, (end - first) * samples_per_frame]
        (the decoder's later blocks then run on those frames and a margin)."""
        n = frames.shape[1]
        first, end = keep or (0, n)
        x = self._front_of(frames)
        lo, hi = self._span(x.shape[-1], first, end) if keep else (0, x.shape[-1])
        start = (first * self._positions_per_frame - lo) * self._samples_per_position
        return self._back_of(x[..., lo:hi])[:, start : start + (end - first) * self.samples_per_frame]

    @torch.inference_mode()
    def decode_windows(self, windows: Sequence[tuple[np.ndarray, int, int]]) -> list[np.ndarray]:
        """Decode windows (frames, left, right) and keep only the new frames' samples of each.

        Each window is trimmed of its left context and look-ahead, so consecutive windows of one
        segment concatenate seamlessly. Two stages, each batched as wide as ``max_batch`` and
        ``max_frames`` allow: the first block runs on whole windows, batched by length (it needs the
        codes of the whole window); the later blocks run on each window's kept frames and the margin
        (``_span``), batched by that span whatever the window's length, a window cut wider (into
        more of its own context) where it joins a pass of wider spans (``_back_passes``: frames
        against passes, ``pass_cost_frames``). A window that keeps nothing is not decoded.
        """
        out: list[np.ndarray] = [np.zeros(0, dtype=np.float32)] * len(windows)
        spans = self._spans(windows)
        state: dict[int, torch.Tensor] = {}  # a window's state after the first block, [C, positions]
        for part in self._front_passes(spans):
            x = self._front_of(np.stack([windows[span.window][0] for span in part]))
            state.update((span.window, x[row]) for row, span in enumerate(part))
        per_position = self._samples_per_position
        for group, width in self._back_passes(spans):
            # a span cut wider than it needs takes more of its own window's context, on the side
            # there is some
            starts = [min(span.lo, span.positions - width) for span in group]
            audio = self._back_of(
                torch.stack(
                    [state[span.window][:, s : s + width] for span, s in zip(group, starts, strict=True)]
                )
            )
            for span, s, row in zip(group, starts, audio, strict=True):
                begin = (span.first - s) * per_position
                out[span.window] = row[begin : begin + span.kept * per_position]
        return out

    def plan(self, windows: Sequence[tuple[np.ndarray, int, int]]) -> DecodePlan:
        """How decode_windows would batch these windows, without decoding them."""
        spans = self._spans(windows)
        front = [(len(part), part[0].positions // self._positions_per_frame) for part in self._front_passes(spans)]
        back = [(len(group), width) for group, width in self._back_passes(spans)]
        return DecodePlan(front, back, self._positions_per_frame)

    def _spans(self, windows: Sequence[tuple[np.ndarray, int, int]]) -> list[_Span]:
        """The windows that keep a frame, as the later blocks see them."""
        spans = []
        per_frame = self._positions_per_frame
        for i, (frames, left, right) in enumerate(windows):
            length = int(frames.shape[0])
            if length - left - right > 0:
                lo, hi = self._span(length * per_frame, left, length - right)
                spans.append(
                    _Span(
                        i, length * per_frame, lo, hi, left * per_frame, (length - left - right) * per_frame
                    )
                )
        return spans

    def _front_passes(self, spans: list[_Span]) -> list[list[_Span]]:
        """The first block's passes: windows of one length together, as many as fit a pass."""
        by_length: dict[int, list[_Span]] = defaultdict(list)
        for span in spans:
            by_length[span.positions].append(span)
        passes = []
        for positions, same in by_length.items():
            per_pass = self.windows_per_pass(positions // self._positions_per_frame)
            passes += [same[start : start + per_pass] for start in range(0, len(same), per_pass)]
        return passes

    def _back_passes(self, spans: list[_Span]) -> list[tuple[list[_Span], int]]:
        """The later blocks' passes: of the groupings ``_grouped`` makes (one a fill in ``_FILLS``),
        the one of least cost, each pass costing its positions and ``pass_cost_positions``."""
        best: list[tuple[list[_Span], int]] = []
        best_cost = float("inf")
        for fill in _FILLS:
            passes = self._grouped(spans, fill)
            cost = sum(self.pass_cost_positions + len(group) * width for group, width in passes)
            if cost < best_cost:
                best, best_cost = passes, cost
        return best

    def _grouped(self, spans: list[_Span], fill: float) -> list[tuple[list[_Span], int]]:
        """The widest span left sets a pass's width; it takes the spans at least ``fill`` of that wide
        whose windows are as wide (each is cut that wide, into its own context), as many as
        ``max_batch`` and ``max_frames`` allow."""
        pending = sorted(spans, key=lambda span: span.width, reverse=True)
        passes = []
        while pending:
            width = pending[0].width
            limit = self.windows_per_pass(-(-width // self._positions_per_frame))
            group: list[_Span] = []
            rest: list[_Span] = []
            for span in pending:
                fits = span.positions >= width and span.width >= fill * width
                (group if fits and len(group) < limit else rest).append(span)
            passes.append((group, width))
            pending = rest
        return passes

    def windows_per_pass(self, length: int) -> int:
        """How many windows of ``length`` frames one forward pass decodes."""
        if self.max_frames is None:
            return self.max_batch
        return max(1, min(self.max_batch, self.max_frames // length))


def to_pcm16(audio: np.ndarray) -> bytes:
    """float audio in [-1, 1] -> little-endian int16 bytes."""
    return (np.clip(audio, -1.0, 1.0) * 32767.0).round().astype("<i2").tobytes()
