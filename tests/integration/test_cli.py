"""The README's first command: ``narrate file`` on embedded defaults (private Valkey, local storage)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from fleet.settings import Settings
from models.espeak import unavailable_reason
from models.registry import get_model
from tests.conftest import require

pytestmark = pytest.mark.integration


def _without_espeak(tmp_path) -> str:
    """A PYTHONPATH on which ``import espeakng_loader`` and ``import piper`` fail, as on a machine
    without the espeak and piper extras."""
    fake = tmp_path / "no-espeak" / "espeakng_loader"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('the espeak extra is not installed')\n")
    return os.pathsep.join(p for p in (str(fake.parent), _without_piper(tmp_path)) if p)


def _without_piper(tmp_path) -> str:
    """A PYTHONPATH on which ``import piper`` fails, as on a machine without the piper extra (the
    README's first command installs eSpeak NG alone)."""
    fake = tmp_path / "no-piper" / "piper"
    fake.mkdir(parents=True, exist_ok=True)
    (fake / "__init__.py").write_text("raise ImportError('the piper extra is not installed')\n")
    return os.pathsep.join(p for p in (str(fake.parent), os.environ.get("PYTHONPATH", "")) if p)


def test_the_readme_first_command_speaks(tmp_path):
    """The README's first command, from `narrate file` on (the venv and `pip install -e '.[espeak]'`
    are this test run's own): eSpeak NG by default, speech at 22.05 kHz, chapters, no download."""
    require(unavailable_reason() is None, f"eSpeak NG: {unavailable_reason()}")
    root = Path(__file__).parents[2]
    readme = (root / "README.md").read_text(encoding="utf-8")
    command = next(line.strip() for line in readme.splitlines() if "bin/narrate file" in line)
    install, _, narrate = command.rpartition("&& .venv/bin/narrate ")
    assert "pip install -e '.[espeak]'" in install, command
    shutil.copytree(root / "examples", tmp_path / "examples")
    data = tmp_path / "data"
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL" and not k.startswith("NARRATE_")}
    env["NARRATE_DATA_DIR"] = str(data)
    env["PYTHONPATH"] = _without_piper(tmp_path)  # as the command installs it: eSpeak NG, no Piper
    result = subprocess.run(
        [sys.executable, "-m", "narrate.cli", *shlex.split(narrate)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "warning" not in result.stderr
    audio, rate = sf.read(tmp_path / "lighthouse.wav", dtype="int16")
    assert rate == 22050 and 60 < audio.size / rate < 180  # 51 sentences, ~108 s measured
    assert np.sqrt(np.mean(audio.astype(float) ** 2)) > 1000  # speech, not silence or noise-free gaps
    assert "51 segments, 3 chapters" in result.stdout and "100%" in result.stderr
    assert "started speech-0" in result.stderr and "started ar-" not in result.stderr  # no AR/decoder
    assert not (data / "models").exists()  # nothing built or downloaded


def test_the_readme_neural_command_speaks_with_piper(tmp_path):
    """The README's neural command (``pip install -e '.[piper]'``, then `narrate file` with no
    --model): Piper's voice by default, speech at 22.05 kHz, the book's chapters, no download."""
    from models.piper import unavailable_reason as piper_unavailable

    require(piper_unavailable() is None, f"Piper: {piper_unavailable()}")
    root = Path(__file__).parents[2]
    readme = (root / "README.md").read_text(encoding="utf-8")
    command = next(
        line.strip() for line in readme.splitlines() if "bin/narrate file" in line and "[piper]" in line
    )
    install, _, narrate_args = command.rpartition("&& .venv/bin/narrate ")
    assert "pip install -e '.[piper]'" in install, command
    shutil.copytree(root / "examples", tmp_path / "examples")
    data = tmp_path / "data"
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL" and not k.startswith("NARRATE_")}
    env["NARRATE_DATA_DIR"] = str(data)
    result = subprocess.run(
        [sys.executable, "-m", "narrate.cli", *shlex.split(narrate_args)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "warning" not in result.stderr
    output = next(a for a in shlex.split(narrate_args)[2:] if a.endswith((".wav", ".m4b", ".mp3", ".flac")))
    info = sf.info(tmp_path / output)
    assert info.samplerate == 22050 and 60 < info.duration < 180, info  # 51 sentences
    assert "51 segments, 3 chapters" in result.stdout and "100%" in result.stderr
    logs = "".join(p.read_text() for p in (data / "logs").glob("speech-*.log"))
    assert "Piper voice en_US-joe-medium loaded" in logs, logs[-2000:]
    assert not (data / "models").exists()  # nothing built or downloaded


def test_narrate_file_on_embedded_defaults(tmp_path, tiny_dir):
    """Without the espeak extra: the tiny model (noise), with a warning that says how to get speech."""
    data = tmp_path / "data"
    (data / "models").mkdir(parents=True)
    shutil.copytree(tiny_dir, data / "models" / tiny_dir.name)  # skip rebuilding the tiny model
    book = tmp_path / "book.md"
    book.write_text("# One\n\nHello there. How are you?\n\n# Two\n\nFine, thanks.", encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL" and not k.startswith("NARRATE_")}
    env["NARRATE_DATA_DIR"] = str(data)
    env["PYTHONPATH"] = _without_espeak(tmp_path)
    result = subprocess.run(
        [sys.executable, "-m", "narrate.cli", "file", str(book), "-o", str(tmp_path / "book.wav")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    info = sf.info(tmp_path / "book.wav")
    assert info.samplerate == 24000 and info.frames > 24000
    assert "5 segments, 2 chapters" in result.stdout
    assert "100%" in result.stderr  # the progress bar ran to the end
    assert "warning: eSpeak NG is not installed" in result.stderr and "'tiny' test model" in result.stderr
    assert "warning: Piper does not import" in result.stderr  # the voice narrate file tries first
    # the embedded server kept its data, append-only, in the data dir
    assert any((data / "valkey" / "appendonlydir").iterdir())


def _hide(tmp_path, module: str) -> str:
    """A PYTHONPATH entry on which ``import module`` fails, as on a machine without it."""
    fake = tmp_path / f"no-{module}" / module
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(f"raise ImportError('{module} is not installed here')\n")
    return str(fake.parent)


def narrate(tmp_path, *args, env_extra=None, timeout=300, stdin=None):
    """``narrate ...`` as a process on a data directory of its own (embedded Valkey, no REDIS_URL),
    with eSpeak NG (these tests are of its path: `narrate file` would prefer Piper where installed)."""
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL" and not k.startswith("NARRATE_")}
    env["NARRATE_DATA_DIR"] = str(tmp_path / "data")
    env["NARRATE_DEFAULT_MODEL"] = "espeak"
    env.update(env_extra or {})
    return subprocess.run(
        [sys.executable, "-m", "narrate.cli", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        input=stdin,
    )


BOOK_MD = "# One\n\nHello there. How are you today?\n\n# Two\n\nFine, thanks. The end."


def test_the_espeak_path_imports_no_torch_and_keeps_no_copy(tmp_path):
    """The README's path with torch made unimportable in every process of the tree: it still speaks;
    the format follows the extension; the summary says where everything is; the data directory
    keeps no copy of the book."""
    require(unavailable_reason() is None, f"eSpeak NG: {unavailable_reason()}")
    (tmp_path / "book.md").write_text(BOOK_MD, encoding="utf-8")
    hide = os.pathsep.join([_hide(tmp_path, "torch"), os.environ.get("PYTHONPATH", "")])
    result = narrate(
        tmp_path, "file", "book.md", "-o", "out/book.flac", "--manifest", env_extra={"PYTHONPATH": hide}
    )
    assert result.returncode == 0, result.stdout + result.stderr
    info = sf.info(tmp_path / "out" / "book.flac")
    assert info.format == "FLAC" and info.samplerate == 22050
    manifest = json.loads((tmp_path / "out" / "book.json").read_text())
    assert [c["title"] for c in manifest["chapters"]] == ["One", "Two"]
    assert f"out/book.flac: 0:{round(info.duration):02d} of audio ({info.duration:.1f} s)" in result.stdout
    assert "manifest (chapters, sentence times): out/book.json" in result.stdout
    # the progress bar's last audio figure (pauses included) is the file's duration
    assert f"0:{round(info.duration):02d} of audio" in result.stderr.rsplit("narrating", 1)[-1]
    stored = [p for p in (tmp_path / "data" / "storage").rglob("*") if p.is_file()]
    assert stored == [], stored


def test_a_piped_text_is_read_whole_and_the_model_asked_is_served_whatever_narrate_models(tmp_path):
    """A pipe cannot be read twice: the first block (8 KB) was lost to the EPUB sniff. NARRATE_MODELS
    (set for a fleet) listing other models refused the one narrate file chose."""
    require(unavailable_reason() is None, f"eSpeak NG: {unavailable_reason()}")
    text = " ".join(f"Sentence number {i} is here." for i in range(1, 321))  # ~9 KB
    result = narrate(
        tmp_path, "file", "/dev/stdin", "-o", "piped.wav", "--manifest", stdin=text,
        env_extra={"NARRATE_MODELS": "tiny"},
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    segments = json.loads((tmp_path / "piped.json").read_text())["segments"]
    assert [s["text"] for s in segments[:1] + segments[-1:]] == ["Sentence number 1 is here.", "Sentence number 320 is here."]
    assert len(segments) == 320


def test_an_m4b_has_the_manifests_chapters_and_the_books_tags(tmp_path):
    """``narrate file book.md -o book.m4b --author ...`` through the whole embedded fleet: Debian's
    ffprobe reads the chapters (titles, starts to the millisecond) and tags; the length is the
    manifest's within one AAC frame."""
    require(unavailable_reason() is None, f"eSpeak NG: {unavailable_reason()}")
    require(shutil.which("ffprobe") is not None, "ffprobe (Debian's ffmpeg; scripts/test.sh installs it)")
    (tmp_path / "book.md").write_text(BOOK_MD, encoding="utf-8")
    from tests.jobs.test_encoding import picture

    (tmp_path / "cover.jpg").write_bytes(picture(64, 48, codec="mjpeg"))
    result = narrate(
        tmp_path, "file", "book.md", "-o", "book.m4b", "--manifest", "--author", "Ann Author", "--year", "2026",
        "--cover", "cover.jpg",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    manifest = json.loads((tmp_path / "book.json").read_text())
    probe = json.loads(
        subprocess.run(
            ["ffprobe", "-v", "error", "-show_format", "-show_streams", "-show_chapters", "-of", "json", "book.m4b"],
            cwd=tmp_path, capture_output=True, text=True, check=True,
        ).stdout
    )  # fmt: skip
    assert [c["tags"]["title"] for c in probe["chapters"]] == [c["title"] for c in manifest["chapters"]] == ["One", "Two"]
    starts = [float(c["start_time"]) for c in probe["chapters"]]
    assert starts == pytest.approx([c["start_s"] for c in manifest["chapters"]], abs=0.0005)
    tags = probe["format"]["tags"]
    assert (tags["title"], tags["artist"], tags["date"], tags["genre"]) == ("book", "Ann Author", "2026", "Audiobook")
    assert tags["composer"] == get_model("espeak", Settings(models="espeak")).family.default_voice  # the narrator: the voice
    stream = next(s for s in probe["streams"] if s["codec_type"] == "audio")
    (cover,) = [s for s in probe["streams"] if s["disposition"]["attached_pic"]]
    assert (stream["codec_name"], int(stream["sample_rate"]), stream["channels"]) == ("aac", 22050, 1)
    assert (cover["codec_name"], cover["width"], cover["height"], cover["disposition"]["attached_pic"]) == (
        "mjpeg", 64, 48, 1
    )
    assert probe["format"]["tags"]["major_brand"].strip() == "M4B"
    assert abs(float(probe["format"]["duration"]) - manifest["duration_s"]) <= 1024 / 22050
    # normalised (m4b's default): FFmpeg's own BS.1770 meter (ebur128, Debian's build) finds the
    # target loudness and the true peak under the ceiling
    report = subprocess.run(
        ["ffmpeg", "-nostats", "-i", "book.m4b", "-af", "ebur128=peak=true", "-f", "null", "-"],
        cwd=tmp_path, capture_output=True, text=True, check=True,
    ).stderr.rsplit("Summary:", 1)[1]  # fmt: skip
    integrated = float(re.search(r"I:\s+(-?[\d.]+) LUFS", report).group(1))
    true_peak = float(re.search(r"Peak:\s+(-?[\d.]+) dBFS", report).group(1))
    assert abs(integrated - -18.0) <= 0.5 and true_peak <= -3.0, (report, manifest["loudness"])


def test_keep_then_clean_frees_the_data_directory(tmp_path):
    require(unavailable_reason() is None, f"eSpeak NG: {unavailable_reason()}")
    (tmp_path / "book.md").write_text(BOOK_MD, encoding="utf-8")
    kept = narrate(tmp_path, "file", "book.md", "--keep")
    assert kept.returncode == 0, kept.stderr
    stored = [p for p in (tmp_path / "data" / "storage").rglob("*") if p.is_file()]
    assert sorted({p.suffix for p in stored}) == [".json", ".pcm", ".wav"]  # the file, its manifest, its sentences
    assert len([p for p in stored if p.suffix == ".pcm"]) == 6 and all("segments" in p.parts for p in stored if p.suffix == ".pcm")
    assert "kept in the data directory as job" in kept.stdout and "narrate clean" in kept.stdout
    cleaned = narrate(tmp_path, "clean")
    assert cleaned.returncode == 0, cleaned.stderr
    assert re.search(r"freed \d+(\.\d)? (KB|MB) in .*data: 1 job\(s\)", cleaned.stdout), cleaned.stdout
    assert not [p for p in (tmp_path / "data" / "storage").rglob("*") if p.is_file()]
    assert not (tmp_path / "data" / "logs").exists()


def test_rate_and_pitch_reach_the_voice(tmp_path):
    require(unavailable_reason() is None, f"eSpeak NG: {unavailable_reason()}")
    (tmp_path / "book.md").write_text("A sentence that takes a while to say out loud.", encoding="utf-8")
    slow = narrate(tmp_path, "file", "book.md", "-o", "slow.wav", "--rate", "100", "--pitch", "20")
    fast = narrate(tmp_path, "file", "book.md", "-o", "fast.wav", "--rate", "300", "--pitch", "80")
    assert slow.returncode == fast.returncode == 0, slow.stderr + fast.stderr
    assert sf.info(tmp_path / "slow.wav").duration > 1.8 * sf.info(tmp_path / "fast.wav").duration


def test_narrate_fleet_runs_every_stage_as_children(redis_url, data_dir, tiny_dir, tmp_path):
    """`narrate fleet`: one command, the API and one worker of each kind as child processes."""
    import signal
    import time

    import httpx

    from narrate.supervisor import free_port
    from testing.fleetkit import delete_prefix

    port = free_port()
    prefix = f"fleetcmd-{int(time.time() * 1000) % 10**9}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("NARRATE_")}
    env.update(
        REDIS_URL=redis_url, NARRATE_KEY_PREFIX=prefix, NARRATE_DATA_DIR=str(data_dir), NARRATE_BLOCK_MS="200"
    )
    log = open(tmp_path / "fleet.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [sys.executable, "-m", "narrate.cli", "fleet", "--port", str(port)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        job_id = httpx.post(f"{base}/v1/jobs", json={"text": "# One\n\nA fleet of one command."}).json()["id"]
        while time.monotonic() < deadline + 120:
            status = httpx.get(f"{base}/v1/jobs/{job_id}").json()["status"]
            if status in ("done", "failed"):
                break
            time.sleep(0.3)
        assert status == "done", (tmp_path / "fleet.log").read_text()
        assert httpx.get(f"{base}/v1/jobs/{job_id}/audio").status_code == 200
    finally:
        proc.send_signal(signal.SIGINT)  # Ctrl-C stops the children and the command
        assert proc.wait(timeout=60) == 0
        log.close()
        delete_prefix(redis_url, prefix)
    text = (tmp_path / "fleet.log").read_text()
    for child in ("api", "ar-tiny-0", "decoder-0", "assembler-0", "finalizer-0"):
        assert f"started {child}" in text


def test_narrate_file_reads_an_epub_and_its_chapter_choice(tmp_path):
    """``narrate file book.epub``: the book's chapters (or those chosen) in the m4b, read by ffprobe;
    ``--list-chapters`` says what can be chosen; a DRM-protected book is refused before anything
    starts."""
    require(unavailable_reason() is None, f"eSpeak NG: {unavailable_reason()}")
    require(shutil.which("ffprobe") is not None, "ffprobe (Debian's ffmpeg; scripts/test.sh installs it)")
    from testing.epubkit import sample_book
    from tests.jobs.test_epub import _with

    (tmp_path / "novel.epub").write_bytes(sample_book(2))
    listing = narrate(tmp_path, "file", "novel.epub", "--list-chapters")
    assert listing.returncode == 0, listing.stderr
    assert "   2  Copyright  [47 characters]  (skipped: copyright-page)" in listing.stdout
    result = narrate(tmp_path, "file", "novel.epub", "-o", "part.m4b", "--chapters", "4,Chapter 3: Home")
    assert result.returncode == 0, result.stdout + result.stderr
    from testing.fleetkit import ffprobe

    probe = ffprobe(tmp_path / "part.m4b", "chapters", "format")
    assert [c["tags"]["title"] for c in probe["chapters"]] == ["Chapter 1: The Ship", "Chapter 3: Home"]
    assert probe["format"]["tags"]["title"] == "A Test Book"
    (tmp_path / "locked.epub").write_bytes(_with(sample_book(2), add={"META-INF/rights.xml": b"<r/>"}))
    refused = narrate(tmp_path, "file", "locked.epub", "-o", "locked.m4b")
    assert refused.returncode == 2 and "DRM-protected" in refused.stderr and not (tmp_path / "locked.m4b").exists()


def test_pause_markup_is_exact_silence_in_the_file(tmp_path):
    """``[pause 2s]`` and a scene break through the whole embedded fleet: the FLAC has exactly that
    much digital silence where the manifest says."""
    require(unavailable_reason() is None, f"eSpeak NG: {unavailable_reason()}")
    (tmp_path / "book.md").write_text("# One\n\nWait. [pause 2s] Now.\n\n***\n\nAfter the break.", encoding="utf-8")
    result = narrate(tmp_path, "file", "book.md", "-o", "book.flac", "--manifest")
    assert result.returncode == 0, result.stdout + result.stderr
    audio, rate = sf.read(tmp_path / "book.flac", dtype="int16")
    segs = json.loads((tmp_path / "book.json").read_text())["segments"]
    assert [s["text"] for s in segs] == ["One", "Wait.", "Now.", "After the break."]
    gaps = [segs[i + 1]["start_sample"] - segs[i]["start_sample"] - segs[i]["samples"] for i in range(3)]
    assert gaps == [round(0.7 * rate), 2 * rate, 2 * rate]  # paragraph, the markup, the scene break (2 s)
    for i in range(3):
        end = segs[i]["start_sample"] + segs[i]["samples"]
        assert not audio[end : segs[i + 1]["start_sample"]].any()


def test_a_kept_run_of_an_edited_book_renders_only_what_changed(tmp_path):
    """``narrate file --keep`` twice on one data directory, the book edited in between: the second
    run takes the unchanged sentences from the first's and says how many."""
    require(unavailable_reason() is None, f"eSpeak NG: {unavailable_reason()}")
    (tmp_path / "book.md").write_text(BOOK_MD, encoding="utf-8")
    first = narrate(tmp_path, "file", "book.md", "-o", "one.wav", "--keep")
    assert first.returncode == 0 and "reused" not in first.stdout, first.stdout + first.stderr
    (tmp_path / "book.md").write_text(BOOK_MD.replace("The end.", "The very end."), encoding="utf-8")
    second = narrate(tmp_path, "file", "book.md", "-o", "two.wav", "--keep")
    assert second.returncode == 0, second.stdout + second.stderr
    assert "6 segments, 2 chapters, 5 reused from earlier runs" in second.stdout


def test_narrate_file_places_its_workers_on_narrate_gpus(tmp_path, tiny_dir):
    """NARRATE_GPUS reaches `narrate file` as it reaches `narrate fleet`: an AR worker and a decoder
    on each GPU, pinned and named after it (here on the CPU, so pinning changes nothing but the
    names); a placement that cannot work is refused before anything starts."""
    data = tmp_path / "data"
    (data / "models").mkdir(parents=True)
    shutil.copytree(tiny_dir, data / "models" / tiny_dir.name)
    book = tmp_path / "book.md"
    book.write_text("Hello there. How are you? Fine, thanks.", encoding="utf-8")
    refused = narrate(tmp_path, "file", str(book), "--model", "tiny", env_extra={"NARRATE_GPUS": "0,0"})
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "a GPU listed twice: 0,0" in refused.stderr
    assert not (data / "valkey").exists() and not (data / "logs").exists()  # nothing was started

    gpus = {"NARRATE_GPUS": "0,1"}
    result = narrate(tmp_path, "file", str(book), "--model", "tiny", "-o", "out.wav", env_extra=gpus)
    assert result.returncode == 0, result.stdout + result.stderr
    assert sf.info(tmp_path / "out.wav").frames > 0
    logs = sorted(p.name for p in (data / "logs").glob("*.log"))
    for child in ("ar-tiny-g0-0", "ar-tiny-g1-0", "decoder-g0-0", "decoder-g1-0"):
        assert f"{child}.log" in logs, logs
    assert not any(name in logs for name in ("ar-tiny-0.log", "decoder-0.log")), logs
