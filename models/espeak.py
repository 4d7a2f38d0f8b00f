"""eSpeak NG through ctypes: a single-stage family and its engine (text in, 22,050 Hz PCM out, streamed).

The library and its data come from the ``espeakng-loader`` wheel (the optional ``espeak`` extra,
GPL-3.0-or-later). eSpeak NG keeps its state in globals, so a process has at most one engine and every
call into the library holds one process-wide lock: two syntheses never run at once in one process
(parallelism comes from several worker processes). Synchronous mode: ``espeak_Synth`` calls our
callback with pieces of about ``buffer_ms`` of audio as it produces them, and returns when done.

Voices: ``<language>`` or ``<language>+<variant>``, e.g. ``en-us``, ``en-gb+f3``, ``fr+m2``. The
language is an eSpeak NG voice file's name, lower case (``espeak_ListVoices``); the variant one of
eSpeak's voice variants (``!v``: m1-m8, f1-f5, klatt, whisper, ...).
"""

from __future__ import annotations

import ctypes
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np

from models.single_stage import (
    SingleStageFamily,
    UnsupportedTextError,
    VoiceError,
    script_name,
    scripts_in,
)

SAMPLE_RATE = 22_050
DEFAULT_VOICE = "en-us"
#: Words per minute (eSpeak's ``espeakRATE``), and pitch 0-100 (``espeakPITCH``).
DEFAULT_RATE, RATE_RANGE = 175, (80, 450)
DEFAULT_PITCH, PITCH_RANGE = 50, (0, 100)
INSTALL_HINT = "pip install 'narration-fleet[espeak]' (eSpeak NG, GPL-3.0-or-later)"

# speak_lib.h
_SYNCHRONOUS = 2  # espeak_AUDIO_OUTPUT: AUDIO_OUTPUT_SYNCHRONOUS
_CHARS_UTF8 = 1
#: Phoneme mnemonics inside [[ ]] in the text (a lexicon's phoneme entries; jobs/lexicon.py). The
#: job's own text never holds "[[": validation writes it as "[ [" for this family.
_PHONEMES = 0x100
#: SSML markup: only for text with emphasis marks (others keep eSpeak's plain-text reading).
_SSML = 0x10
#: The emphasis marks of jobs/segmentation.py (models import nothing from jobs: the same two
#: private-use characters, tested to match).
_EMPHASIS_OPEN, _EMPHASIS_CLOSE = "\ue000", "\ue001"
_POS_CHARACTER = 1
_RATE, _PITCH = 1, 3  # espeak_PARAMETER
_EE_OK = 0

#: One word per script, to ask eSpeak NG whether a voice reads that script (see ``EspeakEngine.reading``).
SCRIPT_SAMPLES = {
    "CYRILLIC": "мама",
    "GREEK": "μαμά",
    "ARABIC": "كتاب",
    "HEBREW": "ספר",
    "DEVANAGARI": "किताब",
    "BENGALI": "বই",
    "HAN": "书本",
    "HIRAGANA": "ほん",
    "KATAKANA": "テレビ",
    "HANGUL": "책",
    "THAI": "หนังสือ",
    "GEORGIAN": "წიგნი",
    "ARMENIAN": "գիրք",
    "ETHIOPIC": "መጽሐፍ",
    "TAMIL": "புத்தகம்",
    "KANNADA": "ಪುಸ್ತಕ",
    "MALAYALAM": "പുസ്തകം",
    "GUJARATI": "પુસ્તક",
    "GURMUKHI": "ਕਿਤਾਬ",
    "SINHALA": "පොත",
}


class EspeakUnavailable(RuntimeError):
    """The espeak extra is not installed, or its library does not load."""


def unavailable_reason() -> str | None:
    """Why the eSpeak family cannot run here (None: it can). Cheap: imports the loader, not the library."""
    try:
        import espeakng_loader
    except ImportError:
        return f"eSpeak NG is not installed: {INSTALL_HINT}"
    if not Path(espeakng_loader.get_library_path()).exists():
        return f"espeakng-loader has no eSpeak NG library for this platform: {espeakng_loader.get_library_path()}"
    return None


# --- the library (one per process) -------------------------------------------------------------------

_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.c_void_p)


class _Voice(ctypes.Structure):
    _fields_ = [
        ("name", ctypes.c_char_p),
        ("languages", ctypes.c_void_p),  # (priority byte, NUL-terminated string)* then a 0 byte
        ("identifier", ctypes.c_char_p),
        ("gender", ctypes.c_ubyte),
        ("age", ctypes.c_ubyte),
        ("variant", ctypes.c_ubyte),
        ("xx1", ctypes.c_ubyte),
        ("score", ctypes.c_int),
        ("spare", ctypes.c_void_p),
    ]


#: Every call into libespeak-ng holds this: its state is global to the process.
_LOCK = threading.RLock()


class _Library:
    def __init__(self, buffer_ms: int = 60) -> None:
        try:
            import espeakng_loader
        except ImportError as exc:
            raise EspeakUnavailable(f"eSpeak NG is not installed: {INSTALL_HINT}") from exc
        self.data_path = Path(espeakng_loader.get_data_path())
        lib = ctypes.CDLL(espeakng_loader.get_library_path())
        lib.espeak_Initialize.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
        lib.espeak_SetVoiceByName.argtypes = [ctypes.c_char_p]
        lib.espeak_SetParameter.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]
        lib.espeak_Synth.argtypes = [
            ctypes.c_char_p, ctypes.c_size_t, ctypes.c_uint, ctypes.c_int, ctypes.c_uint,
            ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p,
        ]  # fmt: skip
        lib.espeak_ListVoices.argtypes = [ctypes.POINTER(_Voice)]
        lib.espeak_ListVoices.restype = ctypes.POINTER(ctypes.POINTER(_Voice))
        lib.espeak_TextToPhonemes.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_int]
        lib.espeak_TextToPhonemes.restype = ctypes.c_char_p
        rate = lib.espeak_Initialize(_SYNCHRONOUS, buffer_ms, str(self.data_path).encode(), 0)
        if rate != SAMPLE_RATE:
            raise EspeakUnavailable(f"espeak_Initialize returned {rate}, expected {SAMPLE_RATE} Hz")
        self.lib = lib
        self._sink: Callable[[np.ndarray], bool] | None = None
        self._callback = _CALLBACK(self._on_synth)  # kept alive as long as the library
        lib.espeak_SetSynthCallback(self._callback)

    def _on_synth(self, wav, n: int, _events) -> int:
        if n <= 0 or self._sink is None:
            return 0
        keep_going = self._sink(np.ctypeslib.as_array(wav, shape=(n,)).copy())
        return 0 if keep_going else 1  # 1 aborts the synthesis

    def list_voices(self, spec_language: bytes | None = None) -> list[tuple[str, str, list[str]]]:
        """(name, identifier, languages) of eSpeak's voices (or of its variants, for b"variant")."""
        spec = None
        if spec_language is not None:
            spec = _Voice()
            spec.languages = ctypes.cast(ctypes.c_char_p(spec_language), ctypes.c_void_p)
        result = self.lib.espeak_ListVoices(ctypes.byref(spec) if spec is not None else None)
        voices = []
        i = 0
        while result[i]:
            v = result[i].contents
            voices.append((v.name.decode(), v.identifier.decode(), _languages(v.languages)))
            i += 1
        return voices

    def set_voice(self, name: str) -> None:
        status = self.lib.espeak_SetVoiceByName(name.encode())
        if status != _EE_OK:
            raise VoiceError(f"eSpeak NG could not load voice {name!r} (status {status})")

    def phonemes(self, text: str) -> str:
        buf = ctypes.create_string_buffer(text.encode())
        pointer = ctypes.c_void_p(ctypes.addressof(buf))
        out = []
        while pointer.value:
            out.append(self.lib.espeak_TextToPhonemes(ctypes.byref(pointer), _CHARS_UTF8, 0).decode())
        return " ".join(out)

    def synth(self, text: str, sink: Callable[[np.ndarray], bool], ssml: bool = False) -> None:
        data = text.encode()
        self._sink = sink
        flags = _CHARS_UTF8 | _PHONEMES | (_SSML if ssml else 0)
        try:
            status = self.lib.espeak_Synth(data, len(data) + 1, 0, _POS_CHARACTER, 0, flags, None, None)
        finally:
            self._sink = None
        if status != _EE_OK:
            raise RuntimeError(f"espeak_Synth failed with status {status}")


def _languages(pointer: int | None) -> list[tuple[int, str]]:
    """(priority, language) pairs of a voice; a lower priority number is a better match."""
    out = []
    address = pointer or 0
    while address and (priority := ctypes.c_ubyte.from_address(address).value):
        code = ctypes.string_at(address + 1)
        out.append((priority, code.decode()))
        address += len(code) + 2
    return out


_LIBRARY: _Library | None = None


def _library() -> _Library:
    """The process's one initialized library (created once, whichever thread asks first)."""
    global _LIBRARY
    with _LOCK:
        if _LIBRARY is None:
            _LIBRARY = _Library()
        return _LIBRARY


# --- voices ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Voice:
    id: str  # e.g. "en-us"
    name: str  # e.g. "English (America)"
    identifier: str  # eSpeak's file under voices/, e.g. "gmw/en-US"
    languages: tuple[str, ...]


@dataclass(frozen=True)
class VoiceCatalogue:
    voices: dict[str, Voice]
    #: variant id (lower case) -> eSpeak's variant file name
    variants: dict[str, str]
    #: other language codes (en-gb, zh, pt-pt, ...) -> the voice id that serves them best
    aliases: dict[str, str]

    def _voice(self, language: str) -> Voice | None:
        key = language.lower()
        return self.voices.get(key) or self.voices.get(self.aliases.get(key, ""))

    def problem(self, voice_id: str) -> str | None:
        language, _, variant = voice_id.partition("+")
        if self._voice(language) is None:
            return (
                f"unknown voice {voice_id!r}: {language!r} is not an eSpeak NG language (see GET /v1/models)"
            )
        if variant and variant.lower() not in self.variants:
            return f"unknown voice variant {variant!r} in {voice_id!r}; variants: {', '.join(sorted(self.variants))}"
        return None

    def canonical(self, voice_id: str) -> str:
        """A valid ``voice_id`` as listed: the language's voice id (aliases resolved), lower case."""
        language, _, variant = voice_id.partition("+")
        found = self._voice(language)
        if found is None or (variant and variant.lower() not in self.variants):
            return voice_id
        return f"{found.id}+{variant.lower()}" if variant else found.id

    def espeak_name(self, voice_id: str) -> str:
        """The name eSpeak's SetVoiceByName takes, e.g. "gmw/en-US+f3"."""
        if problem := self.problem(voice_id):
            raise VoiceError(problem)
        language, _, variant = voice_id.partition("+")
        name = self._voice(language).identifier
        return f"{name}+{self.variants[variant.lower()]}" if variant else name


@cache
def catalogue() -> VoiceCatalogue:
    """eSpeak NG's voices and variants (loads the library; raises EspeakUnavailable without it)."""
    lib = _library()
    with _LOCK:
        listed = lib.list_voices()
        variants = lib.list_voices(b"variant")
    voices = {}
    best: dict[str, tuple[int, str]] = {}
    for name, identifier, languages in listed:
        if not languages:
            continue
        dictionary = _dictionary_of(lib.data_path, identifier, languages[0][1])
        if not (lib.data_path / f"{dictionary}_dict").exists():
            continue
        vid = identifier.rsplit("/", 1)[-1].lower()
        voices[vid] = Voice(vid, name.strip(), identifier, tuple(code for _, code in languages))
        for priority, code in languages:
            if code.lower() not in best or priority < best[code.lower()][0]:
                best[code.lower()] = (priority, vid)
    aliases = {code: vid for code, (_, vid) in best.items() if code not in voices}
    variant_ids = {}
    for _name, identifier, _ in variants:
        file = identifier.rsplit("/", 1)[-1]
        if re.fullmatch(r"[A-Za-z0-9_-]+", file):
            variant_ids[file.lower()] = file
    return VoiceCatalogue(voices, variant_ids, aliases)


def _dictionary_of(data_path: Path, identifier: str, language: str) -> str:
    """The dictionary a voice needs: its file's ``dictionary`` line, else its base language (en-us ->
    en). Voices whose dictionary the data lacks (a few test voices) would speak nothing: left out."""
    try:
        text = (data_path / "lang" / identifier).read_text(encoding="utf-8", errors="replace")
    except OSError:
        text = ""
    if match := re.search(r"^dictionary\s+(\S+)", text, re.MULTILINE):
        return match.group(1)
    return language.split("-", 1)[0]


# --- scripts: what a voice can read -------------------------------------------------------------------


def _reads_as_word(phonemes: str) -> bool:
    """eSpeak NG read a sample word as one word (natively, or by switching language, shown as
    ``(xx)``), rather than spelling it letter by letter (separate words or ``_|`` between letters)."""
    core = re.sub(r"\([a-z0-9-]+\)", "", phonemes).strip()
    core = re.sub(r"[_|:]+$", "", core)
    return bool(core) and not re.search(r"\s|_\||_:", core)


# --- the engine ----------------------------------------------------------------------------------------


class EspeakEngine:
    """Text -> 22,050 Hz int16 PCM through eSpeak NG, delivered piece by piece as it is synthesized."""

    sample_rate = SAMPLE_RATE

    def __init__(self) -> None:
        self._lib = _library()
        self.voices = catalogue()
        self._reads: dict[tuple[str, str], int] = {}

    def reading(self, voice: str, script: str, sample: str | None = None) -> int:
        """How ``voice`` reads text in ``script``: 2 natively, 1 by switching to another language
        (eSpeak NG does that by itself for some scripts), 0 not at all (it would spell it letter by
        letter). Asked once per voice and script, with a sample word of the script."""
        key = (voice, script)
        if key not in self._reads:
            word = SCRIPT_SAMPLES.get(script) or sample or ""
            with _LOCK:
                self._lib.set_voice(self.voices.espeak_name(voice))
                phonemes = self._lib.phonemes(word)
            self._reads[key] = (1 if "(" in phonemes else 2) if _reads_as_word(phonemes) else 0
        return self._reads[key]

    def check_text(self, text: str, voice: str) -> None:
        """Raise UnsupportedTextError if ``text`` holds letters of a script ``voice`` cannot read."""
        for script, letters in scripts_in(text).items():
            if self.reading(voice, script, letters):
                continue
            how = {v: self.reading(v, script, letters) for v in self.voices.voices}
            readers = sorted((v for v in how if how[v]), key=lambda v: -how[v])
            hint = (
                f"voices that read it: {', '.join(readers[:25])}"
                if readers
                else f"no eSpeak NG voice reads {script_name(script)}"
            )
            raise UnsupportedTextError(
                f"voice {voice!r} cannot read {script_name(script)} text ({letters!r}); "
                f"eSpeak NG would only spell it letter by letter ({hint})"
            )

    def synthesize(
        self,
        text: str,
        voice: str,
        on_audio: Callable[[np.ndarray], bool],
        *,
        rate: int = DEFAULT_RATE,
        pitch: int = DEFAULT_PITCH,
    ) -> None:
        """Speak ``text``: ``on_audio`` gets each piece (int16) as eSpeak produces it; returning False
        aborts. Blocks until done; one synthesis at a time per process (the library lock)."""
        name = self.voices.espeak_name(voice)
        if not RATE_RANGE[0] <= rate <= RATE_RANGE[1] or not PITCH_RANGE[0] <= pitch <= PITCH_RANGE[1]:
            raise ValueError(f"rate {rate} (allowed {RATE_RANGE}) or pitch {pitch} (allowed {PITCH_RANGE})")
        ssml = _EMPHASIS_OPEN in text  # emphasis marks (jobs/segmentation.py): SSML <emphasis>
        if ssml:
            escaped = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
            text = "<speak>" + escaped.replace(_EMPHASIS_OPEN, "<emphasis>").replace(_EMPHASIS_CLOSE, "</emphasis>") + "</speak>"
        with _LOCK:
            self._lib.set_voice(name)
            self._lib.lib.espeak_SetParameter(_RATE, rate, 0)
            self._lib.lib.espeak_SetParameter(_PITCH, pitch, 0)
            self._lib.synth(text, on_audio, ssml=ssml)

    def speak(self, text: str, voice: str = DEFAULT_VOICE, **params: int) -> np.ndarray:
        """The whole audio of ``text`` at once (tests, tools)."""
        pieces: list[np.ndarray] = []
        self.synthesize(text, voice, lambda p: pieces.append(p) is None, **params)
        return np.concatenate(pieces) if pieces else np.zeros(0, np.int16)


_ENGINE: EspeakEngine | None = None


def engine() -> EspeakEngine:
    """This process's engine (created on first use; eSpeak NG's globals allow only one)."""
    global _ENGINE
    with _LOCK:
        if _ENGINE is None:
            _ENGINE = EspeakEngine()
        return _ENGINE


# --- the family ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EspeakFamily(SingleStageFamily):
    """eSpeak NG as a single-stage family: its voices come from the library at run time."""

    name: str = "espeak"
    sample_rate: int = SAMPLE_RATE
    default_voice: str = DEFAULT_VOICE
    default_rate: int = DEFAULT_RATE
    rate_range: tuple[int, int] = RATE_RANGE
    default_pitch: int = DEFAULT_PITCH
    pitch_range: tuple[int, int] = PITCH_RANGE
    #: eSpeak NG reads numbers, dates and abbreviations itself, per language.
    normalizes_text: bool = False
    #: It reads phoneme strings in its text (``[[h@'loU]]``), for lexicons' phoneme entries.
    reads_phonemes: bool = True
    #: It stresses words marked as emphasised (SSML <emphasis>).
    reads_emphasis: bool = True

    @property
    def voices(self) -> tuple[str, ...]:
        """The languages (each also usable as ``<language>+<variant>``)."""
        return tuple(sorted(catalogue().voices))

    @property
    def variants(self) -> tuple[str, ...]:
        return tuple(sorted(catalogue().variants))

    def voice_problem(self, voice: str) -> str | None:
        return catalogue().problem(voice)

    def canonical_voice(self, voice: str) -> str:
        return catalogue().canonical(voice)

    def unavailable_reason(self, settings=None) -> str | None:
        return unavailable_reason()

    def identity(self, settings=None) -> str:
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version("espeakng-loader")
        except PackageNotFoundError:
            return ""

    def engine(self, settings=None) -> EspeakEngine:
        return engine()


def espeak_family(name: str = "espeak") -> EspeakFamily:
    return EspeakFamily(name=name)
