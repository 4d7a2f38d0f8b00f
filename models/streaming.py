"""Stage 0 -> stage 1 streaming: a segment's token stream cut into decodable windows (invariant I1).

``FrameChunker`` turns the tokens an AR engine streams for one request into whole codec frames and,
as soon as enough frames exist, a window for the decoder: ``left`` frames of context already decoded,
the new frames, and ``right`` frames of look-ahead (not yet emitted; they come again as the next
window's new frames). The decoder trims context and look-ahead, so the concatenation of every
window's output is the audio of the whole segment, each sample exactly once. The first window is
small (fast first audio) and sizes double up to ``chunk_frames``; the last one flushes what is left
with no look-ahead.

With ``uniform`` every other window of a segment at least one window long has the same length,
``left_context + chunk_frames + lookahead`` frames: the first takes more new frames in place of the
left context it cannot have, and the last more left context (already-decoded frames: the audio it
keeps only gets closer to one offline decode). A decoder decodes windows of one length in one batched
pass, and windows of many lengths in as many small ones.

One chunker per request: it is the only per-request state of the AR stage (invariant I5).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from models.family import TokenLayout


@dataclass(frozen=True, slots=True)
class Window:
    seq: int
    frames: np.ndarray  # int32 [left + new + right, codes_per_frame]
    left: int
    right: int
    final: bool

    @property
    def new_frames(self) -> int:
        return int(self.frames.shape[0]) - self.left - self.right


class FrameChunker:
    def __init__(
        self,
        layout: TokenLayout,
        *,
        chunk_frames: int,
        first_chunk_frames: int,
        left_context: int,
        lookahead: int,
        uniform: bool = False,
    ) -> None:
        if chunk_frames < 1 or first_chunk_frames < 1 or left_context < 0 or lookahead < 0:
            raise ValueError("chunk sizes must be >= 1 and contexts >= 0")
        self.layout = layout
        self.chunk_frames = chunk_frames
        self.first_chunk_frames = first_chunk_frames
        self.left_context = left_context
        self.lookahead = lookahead
        self.uniform = uniform
        self.window_frames = left_context + chunk_frames + lookahead  # a full window
        self._frames: list[np.ndarray] = []
        self._n_frames = 0
        self._partial: list[int] = []
        self._emitted = 0  # frames whose audio some window already carries
        self._seq = 0
        self.stopped = False  # a stop token was seen at a frame boundary
        self.dropped_tokens = 0  # tokens of an incomplete last frame

    @property
    def frames(self) -> int:
        return self._n_frames

    def feed(self, tokens: Iterable[int]) -> list[Window]:
        """Take newly generated tokens; return the windows that became complete."""
        if self.stopped:
            return []
        stops = self.layout.stop_token_ids
        for token in tokens:
            if token in stops:
                self.stopped = True
                break
            self._partial.append(token)
        whole = len(self._partial) - len(self._partial) % self.layout.codes_per_frame
        if whole:
            frames = self.layout.tokens_to_frames(self._partial[:whole])
            del self._partial[:whole]
            self._frames.append(frames)
            self._n_frames += frames.shape[0]
        if self.stopped:  # a stop inside a frame: its partial frame is not audio
            self.dropped_tokens += len(self._partial)
            self._partial.clear()
        return self._ready()

    def finish(self) -> list[Window]:
        """The request ended: flush the remaining frames as the final window."""
        self.dropped_tokens += len(self._partial)
        self._partial.clear()
        windows = self._ready()
        windows.append(self._window(self._n_frames, right=0, final=True))
        return windows

    def all_frames(self) -> np.ndarray:
        if not self._frames:
            return np.zeros((0, self.layout.codes_per_frame), dtype=np.int32)
        if len(self._frames) > 1:
            self._frames = [np.concatenate(self._frames)]
        return self._frames[0]

    def _ready(self) -> list[Window]:
        windows = []
        while True:
            # a ramp: first_chunk_frames, then twice as many each window up to chunk_frames, so
            # the first audio comes fast and each later window is ready before the audio already
            # sent has played (generation at idle runs ~3x real time)
            target = min(self.chunk_frames, self.first_chunk_frames << min(self._seq, 16))
            if self.uniform and target == self.chunk_frames:
                target += max(0, self.left_context - self._emitted)
            if self._n_frames - self._emitted - self.lookahead < target:
                return windows
            windows.append(self._window(self._emitted + target, right=self.lookahead, final=False))

    def _window(self, end: int, *, right: int, final: bool) -> Window:
        start = max(0, self._emitted - self.left_context)
        if final and self.uniform and end > self._emitted:  # an empty final window needs no context
            start = max(0, min(start, end - self.window_frames))
        frames = self.all_frames()[start : end + right]
        window = Window(seq=self._seq, frames=frames, left=self._emitted - start, right=right, final=final)
        self._emitted = end
        self._seq += 1
        return window
