"""The single-stage family: one engine turns text into audio itself, with no codec stage.

The seed document's "Single-Stage Models" pattern: a speech worker runs the engine and streams its
audio out piece by piece (delta audio, I1) as ``AudioChunk`` messages onto the same audio stream the
decoders feed, so assembly, progress, pauses, chapters and storage are those of the two-stage models.

A family describes itself: its voices (and variants, if it has them), its default voice, its speaking
rate and pitch ranges (a family without a pitch says ``pitch_range == (0, 0)``), what its text may
carry (phonemes, emphasis), why it cannot run here, what its audio depends on (the segment cache's
identity) and how a process gets its one engine. Two families: eSpeak NG (models/espeak.py, formant
speech in 100+ languages) and Piper (models/piper.py, neural VITS voices in ONNX).
"""

from __future__ import annotations

import unicodedata
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import numpy as np

if TYPE_CHECKING:
    from fleet.settings import Settings


class VoiceError(ValueError):
    """A voice id the family does not have: a permanent error."""


class UnsupportedTextError(ValueError):
    """Text the chosen voice cannot read (it would only spell it): a permanent error."""


class SpeechEngine(Protocol):
    """A process's one engine of a family: text in, int16 PCM pieces out as they are made."""

    sample_rate: int

    def check_text(self, text: str, voice: str) -> None:
        """Raise UnsupportedTextError (or VoiceError) before any audio if the voice cannot say ``text``."""

    def synthesize(
        self, text: str, voice: str, on_audio: Callable[[np.ndarray], bool], *, rate: int, pitch: int
    ) -> None:
        """Speak ``text``; ``on_audio`` gets each piece (int16, ``sample_rate``), returning False aborts."""


class SingleStageFamily(ABC):
    """What a single-stage model tells the fleet. Subclasses are frozen dataclasses with these fields."""

    name: str
    sample_rate: int
    #: Speaking rate in words per minute (the engine's nominal pace): default and allowed range.
    default_rate: int
    rate_range: tuple[int, int]
    #: Pitch, 0-100 where the engine has one; (0, 0) and 0: no pitch setting (a job's pitch is 0).
    default_pitch: int = 0
    pitch_range: tuple[int, int] = (0, 0)
    #: It reads numbers, dates and abbreviations itself (no text normalisation by default).
    normalizes_text: bool = False
    #: It reads eSpeak NG phoneme mnemonics in ``[[ ]]`` in its text (a lexicon's phoneme entries).
    reads_phonemes: bool = False
    #: It stresses words marked as emphasised (the marks of jobs/segmentation.py).
    reads_emphasis: bool = False

    @property
    @abstractmethod
    def default_voice(self) -> str: ...

    @property
    @abstractmethod
    def voices(self) -> tuple[str, ...]:
        """The voice ids a job may name."""

    @property
    def variants(self) -> tuple[str, ...]:
        """Variants a voice id may carry as ``<voice>+<variant>`` (none unless the family has them)."""
        return ()

    @abstractmethod
    def voice_problem(self, voice: str) -> str | None:
        """Why ``voice`` is not a voice of this family (None: it is)."""

    def canonical_voice(self, voice: str) -> str:
        """The one spelling of a valid ``voice`` (its id as listed, aliases resolved): a job keeps it,
        so ``joe`` and ``en_US-joe-medium`` share segment-cache keys, seeds and the manifest's voice."""
        return voice

    @abstractmethod
    def unavailable_reason(self, settings: Settings) -> str | None:
        """Why the family cannot run with these settings (None: it can). Cheap: loads no engine."""

    @abstractmethod
    def identity(self, settings: Settings) -> str:
        """What its audio depends on besides the request (engine version, voice files, settings)."""

    @abstractmethod
    def engine(self, settings: Settings) -> SpeechEngine:
        """This process's one engine of the family (created on first use; blocking)."""

    @property
    def has_pitch(self) -> bool:
        return self.pitch_range != (0, 0)

    def prosody_problem(self, rate: int, pitch: int) -> str | None:
        lo, hi = self.rate_range
        if not lo <= rate <= hi:
            return f"rate {rate} is outside {lo}-{hi} words per minute"
        if not self.has_pitch:
            return None if pitch == 0 else f"model {self.name!r} has no pitch setting"
        lo, hi = self.pitch_range
        if not lo <= pitch <= hi:
            return f"pitch {pitch} is outside {lo}-{hi}"
        return None


# --- scripts: what a voice can read -------------------------------------------------------------------


def script_of(char: str) -> str | None:
    """The Unicode script of a letter (from its name: LATIN, CYRILLIC, HAN, ...); None for non-letters."""
    if not unicodedata.category(char).startswith("L") or unicodedata.category(char) == "Lm":
        return None
    name = unicodedata.name(char, "")
    if not name:
        return "UNKNOWN"
    first = name.split(" ", 1)[0]
    return "HAN" if first == "CJK" else first


def scripts_in(text: str) -> dict[str, str]:
    """script -> the first few letters of it in ``text`` (Latin left out: every voice names Latin letters)."""
    found: dict[str, str] = {}
    for char in text:
        script = script_of(char)
        if script and script != "LATIN" and len(found.get(script, "")) < 6:
            found[script] = found.get(script, "") + char
    return found


def script_name(script: str) -> str:
    return script.title()
