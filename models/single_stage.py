"""The single-stage family: one engine turns text into audio itself, with no codec stage.

The seed document's "Single-Stage Models" pattern: a speech worker runs the engine and streams its
audio out piece by piece (delta audio, I1) as ``AudioChunk`` messages onto the same audio stream the
decoders feed, so assembly, progress, pauses, chapters and storage are those of the two-stage models.
eSpeak NG (models/espeak.py) is the one engine; its voices come from the library at run time.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SingleStageFamily:
    name: str
    sample_rate: int
    default_voice: str
    #: Speaking rate in words per minute: default and allowed range; pitch 0-100 likewise.
    default_rate: int
    rate_range: tuple[int, int]
    default_pitch: int
    pitch_range: tuple[int, int]
    #: eSpeak NG reads numbers, dates and abbreviations itself, per language.
    normalizes_text: bool = False
    #: It reads phoneme strings in its text (eSpeak NG: ``[[h@'loU]]``), for lexicons' phoneme entries.
    reads_phonemes: bool = True
    #: It stresses words marked as emphasised (eSpeak NG: SSML <emphasis>).
    reads_emphasis: bool = True

    @property
    def voices(self) -> tuple[str, ...]:
        """The languages (each also usable as ``<language>+<variant>``)."""
        from models.espeak import catalogue

        return tuple(sorted(catalogue().voices))

    @property
    def variants(self) -> tuple[str, ...]:
        from models.espeak import catalogue

        return tuple(sorted(catalogue().variants))

    def voice_problem(self, voice: str) -> str | None:
        from models.espeak import catalogue

        return catalogue().problem(voice)

    def prosody_problem(self, rate: int, pitch: int) -> str | None:
        lo, hi = self.rate_range
        if not lo <= rate <= hi:
            return f"rate {rate} is outside {lo}-{hi} words per minute"
        lo, hi = self.pitch_range
        if not lo <= pitch <= hi:
            return f"pitch {pitch} is outside {lo}-{hi}"
        return None


def espeak_family(name: str = "espeak") -> SingleStageFamily:
    from models import espeak

    return SingleStageFamily(
        name=name,
        sample_rate=espeak.SAMPLE_RATE,
        default_voice=espeak.DEFAULT_VOICE,
        default_rate=espeak.DEFAULT_RATE,
        rate_range=espeak.RATE_RANGE,
        default_pitch=espeak.DEFAULT_PITCH,
        pitch_range=espeak.PITCH_RANGE,
    )
