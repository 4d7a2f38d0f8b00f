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
the default), a window's audio depends only on its codes. On GPUs windows of equal length are
decoded in batches of up to 256 (not promised bit-identical across batch compositions).

Only the new frames' audio of a window is kept, so the decoder's later blocks (~90 % of its work on
the CPU: they run at 3–24 kHz) run on those frames and a margin, not on the whole window: the cut is
made after its first block (375 positions a second, 32 a frame), where the rest of the decoder sees
8 positions either way (measured; the margin is twice that), so the kept samples are the same as
from the whole window's decode, to float rounding (~5e-7). For a steady window (4 + 25 + 3 frames)
that is 26 of 32 frames through the later blocks.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from snac import SNAC
from snac.layers import DecoderBlock, NoiseBlock
from torch.nn.utils import parametrize

#: After the first decoder block of SNAC 24 kHz, positions a later block's output depends on, either
#: way: 8 (tests/models/test_snac_codec.py), doubled. A window is cut there to its kept frames +- this.
CUT_MARGIN = 16

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
    ) -> SnacCodec:
        """Load a codec directory as the snac package saves it (config.json + pytorch_model.bin)."""
        model = SNAC.from_pretrained(str(directory))
        return cls(model, levels, device, max_batch, compile, max_frames, dtype, cut)

    def _codes(self, frames: torch.Tensor) -> list[torch.Tensor]:
        # frames: [B, n, codes_per_frame] -> one [B, n * len(level)] tensor per level, frame-major
        # device index tensors: indexing with a Python list would copy it to the device each call
        return [frames.index_select(2, index).reshape(frames.shape[0], -1) for index in self._level_index]

    @torch.inference_mode()
    def decode_frames(self, frames: np.ndarray, keep: tuple[int, int] | None = None) -> np.ndarray:
        """Decode [B, n, codes_per_frame] codes to [B, n * samples_per_frame] float32 audio, or, with
        ``keep`` = (first, end), the samples of frames first..end-1 only, [B, (end - first) * samples_per_frame]
        (the decoder's later blocks then run on those frames and a margin)."""
        batch = torch.as_tensor(np.ascontiguousarray(frames), dtype=torch.long, device=self.device)
        n = batch.shape[1]
        first, end = keep or (0, n)
        x = self._front(self.model.quantizer.from_codes(self._codes(batch)))  # [B, C, n * per_frame]
        per_frame = x.shape[-1] // n
        lo, hi = 0, x.shape[-1]
        if self._cut and keep is not None:
            lo, hi = max(0, first * per_frame - CUT_MARGIN), min(hi, end * per_frame + CUT_MARGIN)
        audio = self._back(x[..., lo:hi])  # [B, 1, (hi - lo) * per_position]
        per_position = self.samples_per_frame // per_frame
        start = (first * per_frame - lo) * per_position
        return audio[:, 0, start : start + (end - first) * self.samples_per_frame].float().cpu().numpy()

    def decode_windows(self, windows: Sequence[tuple[np.ndarray, int, int]]) -> list[np.ndarray]:
        """Decode windows (frames, left, right) and keep only the new frames' samples of each.

        Windows of the same length are decoded as one batch (in several passes where it would hold
        more than ``max_batch`` windows or ``max_frames`` frames); each window is trimmed of its left
        context and look-ahead, so consecutive windows of one segment concatenate seamlessly. A pass
        decodes from the first frame any of its windows keeps to the last (``decode_frames``' keep).
        """
        out: list[np.ndarray | None] = [None] * len(windows)
        by_length: dict[int, list[int]] = defaultdict(list)
        for i, (frames, _, _) in enumerate(windows):
            by_length[int(frames.shape[0])].append(i)
        hop = self.samples_per_frame
        for length, idx in by_length.items():
            if length == 0:
                for i in idx:
                    out[i] = np.zeros(0, dtype=np.float32)
                continue
            per_pass = self.windows_per_pass(length)
            for start in range(0, len(idx), per_pass):
                part = idx[start : start + per_pass]
                first = min(windows[i][1] for i in part)
                end = max(length - windows[i][2] for i in part)
                audio = self.decode_frames(np.stack([windows[i][0] for i in part]), (first, end))
                for row, i in enumerate(part):
                    _, left, right = windows[i]
                    out[i] = audio[row, (left - first) * hop : (length - right - first) * hop]
        return out  # type: ignore[return-value]

    def windows_per_pass(self, length: int) -> int:
        """How many windows of ``length`` frames one forward pass decodes."""
        if self.max_frames is None:
            return self.max_batch
        return max(1, min(self.max_batch, self.max_frames // length))


def to_pcm16(audio: np.ndarray) -> bytes:
    """float audio in [-1, 1] -> little-endian int16 bytes."""
    return (np.clip(audio, -1.0, 1.0) * 32767.0).round().astype("<i2").tobytes()
