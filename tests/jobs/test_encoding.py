"""Every output format, written by the finalizer's stitch with its real encoder, read back by
independent readers: Debian's ffprobe/ffmpeg (another FFmpeg build than PyAV's wheel) for the
length, rate, channels, chapters and tags, and PyAV's demuxer for the chapters once more."""

from __future__ import annotations

import json
import shutil
import subprocess
from fractions import Fraction

import numpy as np
import pytest

from jobs.audio import Pauses, stitch
from jobs.encoding import FORMATS, CoverError, format_named, read_cover
from jobs.segmentation import plan_text
from tests.conftest import require

PAUSES = Pauses(sentence_ms=300, paragraph_ms=700, chapter_ms=1500)
NO_PAUSES = Pauses(0, 0, 0)
TEXT = (
    "Before any heading.\n\n# The First Chapter\n\nFirst. Second.\n\nThird.\n\n"
    "# Zwei: Über Äpfel\n\nFourth. Fifth.\n\n# Three\n\nSixth."
)
TAGS = {"title": "A Book", "album": "A Book", "artist": "Ann Author", "composer": "tara", "genre": "Audiobook", "date": "2026", "language": "deu"}
#: A codec's frame (samples at the file's rate): the most a decoder may pad the end by.
FRAME = {"m4b": 1024, "m4a": 1024, "mp3": 1152, "opus": 960, "wav": 0, "flac": 0}


def picture(width: int = 40, height: int = 30, codec: str = "png") -> bytes:
    """A picture made by FFmpeg's own encoder (PNG, or JPEG with ``codec="mjpeg"``)."""
    import av

    image = av.VideoFrame.from_ndarray(np.full((height, width, 3), 90, np.uint8), format="rgb24")
    encoder = av.CodecContext.create(codec, "w")
    encoder.width, encoder.height = width, height
    encoder.pix_fmt = "rgb24" if codec == "png" else "yuvj420p"
    encoder.time_base = Fraction(1, 25)
    if codec != "png":
        image = image.reformat(format="yuvj420p")
    return b"".join(bytes(p) for p in [*encoder.encode(image), *encoder.encode(None)])


def test_a_cover_must_be_a_png_or_jpeg_that_decodes_and_is_not_too_big():
    assert read_cover(picture(codec="mjpeg"), 1 << 20).mime == "image/jpeg"
    with pytest.raises(CoverError, match="not a PNG or JPEG"):
        read_cover(b"GIF89a" + bytes(100), 1 << 20)
    with pytest.raises(CoverError, match="at most 1,000"):
        read_cover(picture(), 1000) if len(picture()) > 1000 else read_cover(picture() + bytes(1000), 1000)
    with pytest.raises(CoverError, match="cannot be read"):
        read_cover(b"\x89PNG\r\n\x1a\n" + bytes(200), 1 << 20)
    with pytest.raises(CoverError, match="at most 64 pixels a side"):
        read_cover(picture(100, 20), 1 << 20, max_side=64)


def ffprobe(path) -> dict:
    require(shutil.which("ffprobe") is not None, "ffprobe (Debian's ffmpeg package; scripts/test.sh installs it)")
    out = subprocess.run(
        ["ffprobe", "-v", "error", "-show_format", "-show_streams", "-show_chapters", "-of", "json", str(path)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return json.loads(out.stdout)


def decoded_samples(path, rate: int) -> int:
    require(shutil.which("ffmpeg") is not None, "ffmpeg (Debian's package; scripts/test.sh installs it)")
    pcm = subprocess.run(
        ["ffmpeg", "-v", "error", "-i", str(path), "-f", "s16le", "-ac", "1", "-ar", str(rate), "-"],
        capture_output=True, check=True,
    ).stdout  # fmt: skip
    return len(pcm) // 2


def synthesize(plan, rate: int) -> dict[int, bytes]:
    """Each segment a tone of its own length and pitch (so the encoders have something to code)."""
    parts = {}
    for s in plan.segments:
        n = rate // 4 * (s.index % 3 + 2) + 37 * s.index  # not a multiple of any codec frame
        t = np.arange(n) / rate
        parts[s.index] = (np.sin(2 * np.pi * (180 + 40 * s.index) * t) * 6000).astype("<i2").tobytes()
    return parts


@pytest.mark.parametrize("fmt", ["m4b", "m4a", "mp3", "opus", "wav", "flac"])
def test_a_format_decodes_with_its_length_rate_chapters_and_tags(tmp_path, fmt):
    spec = FORMATS[fmt]
    rate = 48_000 if fmt == "opus" else 24_000
    plan = plan_text(TEXT)
    parts = synthesize(plan, rate)
    out = tmp_path / f"book.{spec.extension}"
    cover = read_cover(picture(), max_bytes=1 << 20)
    manifest = stitch(
        plan, parts.__getitem__, out, fmt=fmt, model_rate=rate, out_rate=rate, pauses=PAUSES,
        samples={i: len(b) // 2 for i, b in parts.items()}, tags=TAGS, cover=cover,
    )  # fmt: skip
    probe = ffprobe(out)
    stream = next(s for s in probe["streams"] if s["codec_type"] == "audio")
    pictures = [s for s in probe["streams"] if s.get("disposition", {}).get("attached_pic")]
    if spec.cover:  # the cover is attached: a picture stream of its size
        assert [(p["codec_name"], p["width"], p["height"]) for p in pictures] == [("png", 40, 30)], pictures
    else:
        assert pictures == []
    assert int(stream["sample_rate"]) == rate and stream["channels"] == 1
    decoded = decoded_samples(out, rate)
    assert manifest.samples <= decoded <= manifest.samples + FRAME[fmt], (decoded, manifest.samples)
    if not spec.chapters:
        return
    assert [c["title"] for c in manifest.chapters] == ["Chapter 1", "The First Chapter", "Zwei: Über Äpfel", "Three"]
    chapters = probe["chapters"]
    assert [c["tags"]["title"] for c in chapters] == [c["title"] for c in manifest.chapters]
    for found, wanted in zip(chapters, manifest.chapters, strict=True):
        assert abs(float(found["start_time"]) - wanted["start_s"]) <= 0.0005 + 1e-9  # to the millisecond
    tags = {k.lower(): v for k, v in {**probe["format"].get("tags", {}), **stream.get("tags", {})}.items()}
    for key, value in TAGS.items():
        assert tags.get(key) == value, (key, tags)

    import av  # and PyAV's own demuxer agrees on the chapters

    with av.open(str(out)) as container:
        starts = [float(c["start"] * c["time_base"]) for c in container.chapters()]
    assert starts == pytest.approx([c["start_s"] for c in manifest.chapters], abs=0.0005)


def test_bitrate_sets_the_encoders_rate(tmp_path):
    plan = plan_text("One sentence here. " * 40)
    rng = np.random.default_rng(1)  # noise: a pure tone needs fewer bits than either rate
    parts = {s.index: rng.integers(-8000, 8000, 6000).astype("<i2").tobytes() for s in plan.segments}
    sizes = {}
    for kbps in (32, 128):
        out = tmp_path / f"b{kbps}.m4a"
        stitch(plan, parts.__getitem__, out, fmt="m4a", model_rate=24_000, out_rate=24_000, pauses=NO_PAUSES, kbps=kbps)
        sizes[kbps] = int(ffprobe(out)["streams"][0]["bit_rate"]) / 1000
    assert abs(sizes[32] - 32) < 32 * 0.2
    assert sizes[128] > 2.5 * sizes[32]  # (FFmpeg's AAC tops out near 110 kb/s for 24 kHz mono)


def test_format_names_and_aliases():
    assert format_named("M4B").name == "m4b"
    assert format_named("aac").name == "m4a"  # AAC in MP4: ADTS has no place for chapters or the exact length
    assert format_named("ogg") is None


@pytest.mark.parametrize(("fmt", "model_rate", "out_rate"), [("wav", 24_000, 24_000), ("m4b", 24_000, 24_000), ("mp3", 24_000, 24_000), ("wav", 22_050, 48_000)])
def test_one_file_per_chapter_cut_at_the_chapter_marks(tmp_path, fmt, model_rate, out_rate):
    plan = plan_text(TEXT)
    parts = synthesize(plan, model_rate)
    chapters = tmp_path / "chapters"
    chapters.mkdir()
    manifest = stitch(
        plan, parts.__getitem__, tmp_path / f"book.{fmt}", fmt=fmt, model_rate=model_rate, out_rate=out_rate,
        pauses=PAUSES, samples={i: len(b) // 2 for i, b in parts.items()}, tags=TAGS, chapter_dir=chapters,
    )  # fmt: skip
    files = sorted(chapters.iterdir())
    assert [f.name for f in files] == [f"chapter-{n:03d}.{fmt}" for n in range(1, 5)]
    # resampled: the resampler's last samples of a chapter go to its file, not the next one's
    starts = [round(c["start_s"] * out_rate) for c in manifest.chapters] + [manifest.samples]
    for n, path in enumerate(files):
        wanted = starts[n + 1] - starts[n]
        assert wanted <= decoded_samples(path, out_rate) <= wanted + FRAME[fmt] + (1152 if fmt == "mp3" else 0)
        if fmt != "wav":
            tags = {k.lower(): v for k, v in ffprobe(path)["format"]["tags"].items()}
            assert (tags["title"], tags["track"], tags["album"]) == (manifest.chapters[n]["title"], f"{n + 1}/4", "A Book")
    if fmt == "wav":  # the chapters, end to end, are the book, sample for sample
        import soundfile as sf

        book, _ = sf.read(tmp_path / "book.wav", dtype="int16")
        np.testing.assert_array_equal(np.concatenate([sf.read(f, dtype="int16")[0] for f in files]), book)
