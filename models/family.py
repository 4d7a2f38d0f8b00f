"""The two-stage codec-LM family: a decoder-only LM whose output tokens are audio-codec codes.

A family is data: how the prompt is built, which token ids are codes of which frame position, the
stop tokens, the codec's frame rate and sample rate, its streaming receptive field, sampling
defaults and runaway limits. Orpheus (Llama-3.2-3B + SNAC 24 kHz, 7 codes per frame over 3
codebooks; models/orpheus.py) and Llasa (Llama + a single-codebook codec, 1 code per frame;
models/llasa.py) are instances; the ``tiny`` test models use exactly their layouts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from models.runaway import RunawayLimits, repeat_limit_frames


class InvalidCodeError(ValueError):
    """The LM produced a token that is not a valid code for its frame position."""


class TextTokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...


@dataclass(frozen=True)
class TokenLayout:
    """Where codes live in the LM's vocabulary.

    The code ``c`` at frame position ``p`` is token ``code_base + p * position_stride + c``
    (Orpheus: 7 positions, stride 4096; a single-codebook family: 1 position).
    """

    code_base: int
    codebook_size: int
    codes_per_frame: int
    position_stride: int
    stop_token_ids: tuple[int, ...]

    def offsets(self) -> np.ndarray:
        return self.code_base + np.arange(self.codes_per_frame, dtype=np.int64) * self.position_stride

    def allowed_range(self, position: int) -> tuple[int, int]:
        """Token ids [lo, hi) that are valid codes at frame position ``position``."""
        lo = self.code_base + position * self.position_stride
        return lo, lo + self.codebook_size

    def generated_range(self) -> tuple[int, int]:
        """Token ids [first, end) that hold every token a constrained request can generate: the codes
        of every frame position and the stop ids."""
        ranges = [self.allowed_range(p) for p in range(self.codes_per_frame)]
        first = min(*(lo for lo, _ in ranges), *self.stop_token_ids)
        end = max(*(hi for _, hi in ranges), *(t + 1 for t in self.stop_token_ids))
        return first, end

    def tokens_to_frames(self, tokens: Sequence[int]) -> np.ndarray:
        """Whole frames of codes ([n, codes_per_frame] int32) from code tokens; raises on invalid ones."""
        arr = np.asarray(tokens, dtype=np.int64)
        if arr.size % self.codes_per_frame:
            raise ValueError("tokens_to_frames needs whole frames")
        frames = arr.reshape(-1, self.codes_per_frame) - self.offsets()
        bad = (frames < 0) | (frames >= self.codebook_size)
        if bad.any():
            row, pos = (int(i) for i in np.argwhere(bad)[0])
            raise InvalidCodeError(
                f"the model produced an invalid code: token {int(arr[row * self.codes_per_frame + pos])} "
                f"at frame {row} position {pos} "
                f"is not a code for that position (valid: {self.allowed_range(pos)})"
            )
        return frames.astype(np.int32)

    def frames_to_tokens(self, frames: np.ndarray) -> list[int]:
        return (np.asarray(frames, dtype=np.int64) + self.offsets()).reshape(-1).tolist()


@dataclass(frozen=True)
class SamplingDefaults:
    temperature: float = 0.6
    top_p: float = 0.8
    top_k: int = 0
    repetition_penalty: float = 1.3


@dataclass(frozen=True)
class CodecLMFamily:
    name: str
    layout: TokenLayout
    #: Audio samples per codec frame, and the codec's sample rate.
    samples_per_frame: int
    sample_rate: int
    #: Token ids around the text prompt: [*prefix, *tokenize(prompt_text.format(voice, text)), *suffix].
    prompt_prefix: tuple[int, ...]
    prompt_suffix: tuple[int, ...]
    voices: tuple[str, ...]
    default_voice: str
    sampling: SamplingDefaults = field(default_factory=SamplingDefaults)
    #: Generation budget: frames per character of text (a bound, not a target), plus a floor.
    max_frames_per_char: float = 1.7
    min_frames: int = 12
    #: Frame positions that feed each codec level, for codecs with several levels (SNAC).
    codec_levels: tuple[tuple[int, ...], ...] = ((0,),)
    #: The text part of the prompt, tokenized by the checkpoint's tokenizer (special tokens by name).
    prompt_text: str = "{voice}: {text}"
    #: The codec decoder's measured receptive field in frames (streaming windows carry this much
    #: context on each side; NARRATE_LEFT_CONTEXT_FRAMES / NARRATE_LOOKAHEAD_FRAMES override).
    left_context_frames: int = 4
    lookahead_frames: int = 3
    #: What counts as a runaway segment (never stops, repeats, near-silence): models/runaway.py.
    runaway: RunawayLimits = field(default_factory=RunawayLimits)
    #: Numbers, dates, currencies... written as words before synthesis (jobs/normalize.py): codec
    #: LMs read digits badly.
    normalizes_text: bool = True
    #: Codec LMs read text only: lexicon entries must say words, not phonemes, and emphasis marks
    #: are taken out of what they are given.
    reads_phonemes: bool = False
    reads_emphasis: bool = False

    @property
    def frame_seconds(self) -> float:
        return self.samples_per_frame / self.sample_rate

    @property
    def frame_rate(self) -> float:
        """Codec frames per second of audio."""
        return self.sample_rate / self.samples_per_frame

    @property
    def codebooks(self) -> int:
        """Codec codebooks (levels) the frame's codes feed."""
        return len(self.codec_levels)

    @property
    def repeat_limit_frames(self) -> int:
        """Frames of one repeating cycle that make a runaway (``runaway.repeat_seconds``)."""
        return repeat_limit_frames(self.runaway, self.frame_seconds)

    def build_prompt(self, tokenizer: TextTokenizer, text: str, voice: str) -> list[int]:
        body = tokenizer.encode(self.prompt_text.format(voice=voice, text=text))
        return [*self.prompt_prefix, *body, *self.prompt_suffix]

    def max_frames(self, text: str) -> int:
        return max(self.min_frames, math.ceil(len(text) * self.max_frames_per_char))

    def max_tokens(self, text: str) -> int:
        """The generation budget in tokens: whole frames, no room for a stop token after the last one
        (a segment that needs its entire budget is a runaway anyway). With one code per frame a spare
        token would be a spare frame of audio."""
        return self.max_frames(text) * self.layout.codes_per_frame
