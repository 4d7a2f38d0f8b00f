"""The single-stage family end to end: API, speech workers (eSpeak NG), assembler and finalizer as real
processes on a real Redis. Speech where the text is, silence where the structure says, the right rate."""

from __future__ import annotations

import io
import json
import re
import threading
import time

import numpy as np
import pytest
import redis

from fleet.names import Names
from fleet.settings import Settings
from jobs.audio import Pauses
from jobs.segmentation import plan_text
from models.espeak import unavailable_reason
from testing.fleetkit import BOOK, download, read_sse, rms, segment_wpm, start_fleet, submit, wait_done
from testing.fleetkit import manifest as fleetkit_manifest
from tests.conftest import require

pytestmark = pytest.mark.integration
RATE = 22_050
#: Words per minute of a segment at eSpeak's default rate (175): measured 116-304 (median 200) over the
#: book's 51 segments; short monosyllabic sentences run fast ("In the box lay a brass key." 304), words
#: written as one and said as two slow ('"Forty-two," he said.' 116). A truncated segment or a stray
#: gap inside one moves most segments out of the band; the sample rate is asserted on its own.
WPM_BAND = (80, 350)


@pytest.fixture(scope="module")
def fleet(redis_url, data_dir, tmp_path_factory):
    require(unavailable_reason() is None, f"eSpeak NG: {unavailable_reason()}")
    from testing.fleetkit import delete_prefix

    prefix = f"espeak-{int(time.time() * 1000) % 10**9}"
    settings = Settings(
        redis_url=redis_url,
        key_prefix=prefix,
        data_dir=data_dir,
        models="espeak",
        default_model="espeak",
        block_ms=200,
        reclaim_idle_ms=10_000,
        heartbeat_s=1,
        segment_cache="tenant",  # test_a_revised_book_renders_only_its_changed_sentences
    )
    running = start_fleet(settings, tmp_path_factory.mktemp("espeak-logs"), speech_workers=2)
    yield running
    running.stop()
    delete_prefix(redis_url, prefix)


def manifest(fleet, job_id: str) -> dict:
    return fleetkit_manifest(fleet.settings, job_id)


def test_models_lists_voices_and_readiness(fleet, client):
    deadline = time.monotonic() + 60
    while True:
        (model,) = client.get("/v1/models").json()
        if model["ready"] or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert model["name"] == "espeak" and model["kind"] == "single-stage" and model["default"]
    assert model["ready"] and model["workers"] == {"speech": 2}, fleet.logs()
    assert model["sample_rate"] == RATE and model["default_voice"] == "en-us"
    assert {"en-us", "en", "fr", "de", "cmn"} <= set(model["voices"]) and "f3" in model["variants"]
    assert model["rate"] == {"default": 175, "min": 80, "max": 450}


def test_a_markdown_book_with_chapters(fleet, client):
    accepted = submit(client, text=BOOK, title="The Lighthouse", voice="en-us")
    job_id = accepted["id"]
    plan = plan_text(BOOK)
    assert accepted["segments_total"] == len(plan.segments) == 51 and accepted["chapters"] == 3
    events = list(read_sse(client, accepted["links"]["events"], timeout=120))
    assert events[-1].event == "done", [e.event for e in events][-5:]
    reported = {json.loads(e.data)["index"] for e in events if e.event == "segment"}
    assert reported == set(range(51))
    status = client.get(f"/v1/jobs/{job_id}").json()
    assert status["sample_rate"] == RATE and status["rate"] == 175 and status["pitch"] == 50

    audio, rate = download(client, job_id)
    assert rate == RATE and audio.dtype == np.int16 and audio.ndim == 1
    m = manifest(fleet, job_id)
    assert m["sample_rate"] == RATE and m["samples"] == audio.size
    s = fleet.settings
    pauses = Pauses(s.sentence_pause_ms, s.paragraph_pause_ms, s.chapter_pause_ms)
    by_index = {seg.index: seg for seg in plan.segments}
    # speech where the text is: every segment is loud enough to be speech all along its length
    for seg in m["segments"]:
        a, b = round(seg["start_s"] * RATE), round(seg["end_s"] * RATE)
        piece = audio[a:b]
        assert rms(piece) > 1000, f"segment {seg['index']} ({seg['text']!r}) is too quiet"
        halves = np.array_split(piece, 2)
        assert min(rms(h) for h in halves) > 300, f"segment {seg['index']} has a long silent half"
    # each segment lasts as long as its words take to say
    wpm = segment_wpm(m)
    print(f"\nwords per minute over {len(wpm)} segments: min {min(wpm.values()):.0f}, "
          f"median {np.median(list(wpm.values())):.0f}, max {max(wpm.values()):.0f}")  # fmt: skip
    assert all(WPM_BAND[0] < w < WPM_BAND[1] for w in wpm.values()), wpm
    # silence where the structure says, of the length it says
    for seg, nxt in zip(m["segments"], m["segments"][1:], strict=False):
        gap = round((nxt["start_s"] - seg["end_s"]) * RATE)
        assert gap == pauses.samples(by_index[seg["index"]].pause_after, RATE)
        assert not audio[round(seg["end_s"] * RATE) : round(nxt["start_s"] * RATE)].any()
    kinds = [by_index[i].pause_after.value for i in range(50)]
    assert kinds.count("chapter") == 2 and kinds.count("paragraph") > 0  # chapter ends, paragraph ends
    # chapters start where their first segment (the heading) starts
    starts = {seg["index"]: seg["start_s"] for seg in m["segments"]}
    assert [c["start_s"] for c in m["chapters"]] == [starts[c.first_segment] for c in plan.chapters]
    assert [c["title"] for c in m["chapters"]] == [c.title for c in plan.chapters]
    # parallel synthesis: both speech worker processes spoke segments of this job, each segment once
    spoken = {
        name: re.findall(rf"segment {job_id}:(\d+) \(attempt", (fleet.log_dir / f"{name}.log").read_text())
        for name in ("speech-0", "speech-1")
    }
    assert all(spoken.values()), {k: len(v) for k, v in spoken.items()}
    assert sorted(int(i) for v in spoken.values() for i in v) == list(range(51))
    # nothing left in flight
    r = redis.Redis.from_url(s.redis_url)
    names = Names(s.key_prefix)
    assert r.xlen(names.tasks("espeak")) == 0 and r.xlen(names.audio()) == 0
    r.close()


def test_two_jobs_in_different_voices_at_once(fleet, client):
    text = BOOK.split("# Chapter Two")[0]
    results: dict[str, dict] = {}

    def run(voice: str, **extra) -> None:
        job = submit(client, text=text, voice=voice, **extra)
        results[voice] = wait_done(client, job["id"], timeout=120)

    threads = [threading.Thread(target=run, args=(v,)) for v in ("en-us", "en-gb+f3")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert {v: r["status"] for v, r in results.items()} == {"en-us": "done", "en-gb+f3": "done"}
    us, _ = download(client, results["en-us"]["id"])
    gb, _ = download(client, results["en-gb+f3"]["id"])
    n = min(us.size, gb.size)
    assert us.size != gb.size or np.corrcoef(us[:n], gb[:n])[0, 1] < 0.5  # two different voices
    from tests.models.test_espeak import f0

    assert f0(gb) > 1.3 * f0(us)  # the female variant speaks higher: no crosstalk between the jobs
    for voice, result in results.items():
        wpm = segment_wpm(manifest(fleet, result["id"]))
        assert all(WPM_BAND[0] < w < WPM_BAND[1] for w in wpm.values()), (voice, wpm)


def test_rate_is_a_job_setting(fleet, client):
    text = "# Fast\n\nThe walk took an hour. The path was steep; the wind was cold."
    slow = wait_done(client, submit(client, text=text, rate=120)["id"], timeout=60)
    fast = wait_done(client, submit(client, text=text, rate=360)["id"], timeout=60)
    assert slow["status"] == fast["status"] == "done"
    speech = [
        sum(s["end_s"] - s["start_s"] for s in manifest(fleet, j["id"])["segments"]) for j in (slow, fast)
    ]
    assert speech[1] < 0.5 * speech[0]


def test_a_segment_in_a_script_no_voice_reads_fails_the_job(fleet, client):
    text = "# Greetings\n\nHello there.\n\nសួស្តី ពិភពលោក។ Nice to meet you."
    job = submit(client, text=text)
    events = list(read_sse(client, job["links"]["events"], timeout=60))
    assert events[-1].event == "failed"
    error = json.loads(events[-1].data)["error"]
    assert "segment 2" in error and "Khmer" in error and "no eSpeak NG voice reads Khmer" in error, error
    status = client.get(f"/v1/jobs/{job['id']}").json()
    assert status["status"] == "failed" and status["error"] == error
    r = redis.Redis.from_url(fleet.settings.redis_url)
    letters = [json.loads(f[b"h"]) for _, f in r.xrange(Names(fleet.settings.key_prefix).dead_letters())]
    r.close()
    assert any(d["job_id"] == job["id"] and "Khmer" in d["error"] for d in letters)


def test_requests_the_voice_set_cannot_serve_are_refused(fleet, client):
    cases = [
        ({"voice": "xx-yy"}, "not an eSpeak NG language"),
        ({"voice": "en-us+nobody"}, "unknown voice variant"),
        ({"rate": 1000}, "rate 1000 is outside 80-450"),
        ({"pitch": -1}, "pitch -1 is outside 0-100"),
        ({"model": "nonesuch"}, "unknown model"),
    ]
    for body, message in cases:
        response = client.post("/v1/jobs", json={"text": "Hello.", **body})
        assert response.status_code == 422 and message in response.json()["detail"], (body, response.text)


def test_an_mp3_book_with_its_captions_and_speech_marks(fleet, client, tmp_path):
    """An MP3 over the real API (S3-less storage, real processes): Debian's ffprobe reads its ID3
    chapters; the SRT and WebVTT parse with the ``srt`` and ``webvtt-py`` libraries, a cue per
    sentence with the sentence's text and the manifest's times; the chapters track and the speech
    marks say the same; before the end a 409, a bad format a 422."""
    import shutil
    import subprocess

    import srt
    import webvtt

    require(shutil.which("ffprobe") is not None, "ffprobe (Debian's ffmpeg; scripts/test.sh installs it)")
    accepted = submit(client, text=BOOK, title="The Lighthouse", format="mp3", author="A. Keeper")
    job_id = accepted["id"]
    early = client.get(f"/v1/jobs/{job_id}/captions")
    assert early.status_code == 409 or wait_done(client, job_id)["status"] == "done", early.text
    assert wait_done(client, job_id)["status"] == "done"
    m = manifest(fleet, job_id)
    plan = plan_text(BOOK)

    audio = client.get(f"/v1/jobs/{job_id}/audio", follow_redirects=True)
    assert audio.status_code == 200 and audio.headers["content-type"] == "audio/mpeg"
    (tmp_path / "book.mp3").write_bytes(audio.content)
    probe = json.loads(
        subprocess.run(
            ["ffprobe", "-v", "error", "-show_chapters", "-show_format", "-of", "json", "book.mp3"],
            cwd=tmp_path, capture_output=True, text=True, check=True,
        ).stdout
    )  # fmt: skip
    assert [c["tags"]["title"] for c in probe["chapters"]] == [c.title for c in plan.chapters]
    assert [float(c["start_time"]) for c in probe["chapters"]] == pytest.approx(
        [c["start_s"] for c in m["chapters"]], abs=0.0005
    )
    assert probe["format"]["tags"]["artist"] == "A. Keeper"

    def ms(seconds: float) -> int:
        return round(seconds * 1000)

    sub = client.get(f"/v1/jobs/{job_id}/captions", params={"format": "srt"})
    assert sub.status_code == 200 and sub.headers["content-type"].startswith("application/x-subrip")
    cues = list(srt.parse(sub.text))
    assert len(cues) == len(m["segments"]) == 51
    for cue, seg in zip(cues, m["segments"], strict=True):
        assert cue.content == " ".join(seg["text"].split())
        assert round(cue.start.total_seconds() * 1000) == ms(seg["start_s"])
        assert round(cue.end.total_seconds() * 1000) == ms(seg["end_s"])

    vtt = client.get(f"/v1/jobs/{job_id}/captions", params={"format": "vtt"})
    assert vtt.headers["content-type"].startswith("text/vtt")
    captions = webvtt.from_buffer(io.StringIO(vtt.text))
    assert [c.text for c in captions] == [c.content for c in cues]
    def clock(text: str) -> int:
        h, m_, sec = text.split(":")
        return round((int(h) * 3600 + int(m_) * 60 + float(sec)) * 1000)

    assert [(clock(c.start), clock(c.end)) for c in captions] == [
        (ms(s["start_s"]), ms(s["end_s"])) for s in m["segments"]
    ]
    chapters = webvtt.from_buffer(
        io.StringIO(client.get(f"/v1/jobs/{job_id}/captions", params={"kind": "chapters"}).text)
    )
    assert [c.text for c in chapters] == [c["title"] for c in m["chapters"]]

    marks = [json.loads(line) for line in client.get(f"/v1/jobs/{job_id}/marks").text.splitlines()]
    assert [mk["time"] for mk in marks] == [ms(s["start_s"]) for s in m["segments"]]
    assert [mk["value"] for mk in marks] == [s["text"] for s in m["segments"]]
    for mk in marks:  # start/end: where the sentence is in the submitted text
        assert mk["type"] == "sentence" and mk["value"].split()[0] in BOOK[mk["start"] : mk["end"]], mk

    for params in ({"format": "ass"}, {"format": "srt", "kind": "chapters"}, {"kind": "words"}):
        bad = client.get(f"/v1/jobs/{job_id}/captions", params=params)
        assert bad.status_code == 422, (params, bad.text)


def test_a_book_with_a_file_per_chapter_and_their_zip(fleet, client, tmp_path):
    """chapter_files: each chapter's file over the real API (``?chapter=N``; Debian's ffprobe reads
    it: its length is the chapter's in the manifest, within an AAC frame), all of them in a zip; a
    chapter out of range, or chapter files not asked for, is a clear 422."""
    import shutil
    import subprocess
    import zipfile

    require(shutil.which("ffprobe") is not None, "ffprobe (Debian's ffmpeg; scripts/test.sh installs it)")
    job_id = submit(client, text=BOOK, title="The Lighthouse", format="m4b", chapter_files=True)["id"]
    plain_id = submit(client, text="One line only.", format="m4b")["id"]
    assert wait_done(client, job_id)["status"] == "done" and wait_done(client, plain_id)["status"] == "done"
    m = manifest(fleet, job_id)
    ends = [c["start_s"] for c in m["chapters"][1:]] + [m["duration_s"]]
    for n, (chapter, end) in enumerate(zip(m["chapters"], ends, strict=True), start=1):
        r = client.get(f"/v1/jobs/{job_id}/audio", params={"chapter": n}, follow_redirects=True)
        assert r.status_code == 200 and r.headers["content-type"] == "audio/mp4", r.text
        (tmp_path / f"{n}.m4b").write_bytes(r.content)
        probe = json.loads(
            subprocess.run(
                ["ffprobe", "-v", "error", "-show_format", "-of", "json", f"{n}.m4b"],
                cwd=tmp_path, capture_output=True, text=True, check=True,
            ).stdout
        )  # fmt: skip
        assert probe["format"]["tags"]["title"] == chapter["title"]
        assert abs(float(probe["format"]["duration"]) - (end - chapter["start_s"])) <= 1024 / RATE + 0.001
    archive = client.get(f"/v1/jobs/{job_id}/audio", params={"chapters": "zip"}, follow_redirects=True)
    assert archive.headers["content-type"] == "application/zip"
    with zipfile.ZipFile(io.BytesIO(archive.content)) as z:
        assert z.namelist() == ["chapter-001.m4b", "chapter-002.m4b", "chapter-003.m4b"]
        assert z.read("chapter-002.m4b") == (tmp_path / "2.m4b").read_bytes()
    for params, says in (
        ({"chapter": 4}, "chapter 4 is out of range: this book has chapters 1 to 3"),
        ({"chapter": 0}, "chapter 0 is out of range"),
        ({"chapters": "tar"}, "chapters"),
    ):
        bad = client.get(f"/v1/jobs/{job_id}/audio", params=params)
        assert bad.status_code == 422 and says in bad.json()["detail"], (params, bad.text)
    plain = client.get(f"/v1/jobs/{plain_id}/audio", params={"chapter": 1})
    assert plain.status_code == 422 and "no chapter files" in plain.json()["detail"]


@pytest.mark.parametrize("version", [2, 3])
def test_an_epub_uploaded_over_http_becomes_an_m4b_with_its_chapters(fleet, client, tmp_path, version):
    """An EPUB as a multipart upload to the real API (real HTTP, real Redis, real worker processes):
    the m4b that comes back has the book's body chapters (front and back matter skipped), its title,
    author and cover, as Debian's ffprobe reads them; the manifest quotes the chapters' sentences."""
    import shutil

    from testing.epubkit import sample_book
    from testing.fleetkit import ffprobe
    from tests.jobs.test_epub import BODY

    require(shutil.which("ffprobe") is not None, "ffprobe (Debian's ffmpeg; scripts/test.sh installs it)")
    r = client.post(
        "/v1/jobs",
        files={"file": ("novel.epub", sample_book(version), "application/epub+zip")},
        data={"format": "m4b"},
    )
    assert r.status_code == 202, r.text
    job_id = r.json()["id"]
    assert wait_done(client, job_id)["status"] == "done"
    audio = client.get(f"/v1/jobs/{job_id}/audio", follow_redirects=True)
    assert audio.status_code == 200
    (tmp_path / "book.m4b").write_bytes(audio.content)
    probe = ffprobe(tmp_path / "book.m4b", "chapters", "format", "streams")
    assert [c["tags"]["title"] for c in probe["chapters"]] == BODY
    tags = probe["format"]["tags"]
    assert (tags["title"], tags["artist"]) == ("A Test Book", "Ada Writer")
    assert any(s["disposition"]["attached_pic"] for s in probe["streams"])  # the book's cover
    texts = [s["text"] for s in manifest(fleet, job_id)["segments"]]
    assert "The U.S. Navy sailed at dawn." in texts and "The note is not read." not in " ".join(texts)
    assert not any("Copyright" in t or "Navy, 3." in t for t in texts)  # skipped matter


def test_a_lexicon_changes_a_words_audio(fleet, client):
    """A tenant lexicon through the real API and speech workers: "Nguyen" said as "Win" gives the
    audio of the text "Win", not that of "Nguyen" (eSpeak NG's length varies by ~15 samples from one
    call to the next for the same text, so "the same" is within 0.3 %; "Nguyen" is 3 % longer);
    the manifest quotes the written text and says what was said and how often the entry applied."""
    put = client.put("/v1/lexicons/people", json={"entries": [{"match": "Nguyen", "say": "Win"}]})
    assert put.status_code in (200, 201), put.text
    with_lexicon = submit(client, text="Hello Nguyen.", lexicons=["people"])
    said_directly = submit(client, text="Hello Win.")
    without = submit(client, text="Hello Nguyen.")
    for job in (with_lexicon, said_directly, without):
        assert wait_done(client, job["id"])["status"] == "done"
    a, _ = download(client, with_lexicon["id"])
    b, _ = download(client, said_directly["id"])
    c, _ = download(client, without["id"])
    assert abs(a.size - b.size) <= 0.003 * b.size < abs(a.size - c.size), (a.size, b.size, c.size)
    m = manifest(fleet, with_lexicon["id"])
    assert (m["segments"][0]["text"], m["segments"][0]["said"]) == ("Hello Nguyen.", "Hello Win.")
    assert m["lexicon"] == [{"say": "Win", "match": "Nguyen", "case_sensitive": False, "applied": 1}]
    assert client.delete("/v1/lexicons/people").status_code == 204


def _book(edits: dict[int, str] | None = None) -> str:
    words = ["amber", "birch", "cedar", "delta", "ember", "fjord", "grove", "heron", "inlet", "juniper"]
    sentences = [f"The {words[i % 10]} path turns {words[i // 10 % 10]} at mark {i}." for i in range(500)]
    for i, text in (edits or {}).items():
        sentences[i] = text
    paragraphs = [" ".join(sentences[p * 50 : (p + 1) * 50]) for p in range(10)]
    return "# The Long Walk\n\n" + "\n\n".join(paragraphs)


def test_a_revised_book_renders_only_its_changed_sentences(fleet, client):
    """A 500-sentence book, then the same book with 3 sentences edited: the second job renders
    exactly those 3 segments (counted in the speech workers' logs), says so in its status and its
    queued event, and its audio equals the first's everywhere outside them, sample for sample."""
    first = submit(client, text=_book(), title="Walk")
    assert wait_done(client, first["id"], timeout=240)["status"] == "done"
    edits = {7: "The amber path now bends left at mark seven.", 250: "A new line.", 499: "The end, at last."}
    second = submit(client, text=_book(edits), title="Walk")
    assert second["segments_total"] == 501 and second["segments_reused"] == 498  # the heading is a segment
    view = wait_done(client, second["id"], timeout=240)
    assert view["status"] == "done" and view["segments_reused"] == 498
    queued = next(read_sse(client, second["links"]["events"], timeout=60))
    assert queued.event == "queued" and json.loads(queued.data)["reused"] == 498
    rendered = sorted(
        int(i)
        for name in ("speech-0", "speech-1")
        for i in re.findall(rf"segment {second['id']}:(\d+) \(attempt", (fleet.log_dir / f"{name}.log").read_text())
    )
    assert rendered == [8, 251, 500]  # segment = sentence + 1 (the heading is segment 0)
    a, _ = download(client, first["id"])
    b, _ = download(client, second["id"])
    ma, mb = manifest(fleet, first["id"]), manifest(fleet, second["id"])
    for sa, sb in zip(ma["segments"], mb["segments"], strict=True):
        if sb["index"] in rendered:
            continue
        assert sa["text"] == sb["text"]
        np.testing.assert_array_equal(
            a[sa["start_sample"] : sa["start_sample"] + sa["samples"]],
            b[sb["start_sample"] : sb["start_sample"] + sb["samples"]],
        )
    # the same book once more: nothing to render, done from the cache alone
    third = submit(client, text=_book(edits), title="Walk")
    assert third["segments_reused"] == 501
    assert wait_done(client, third["id"], timeout=120)["status"] == "done"
    c, _ = download(client, third["id"])
    np.testing.assert_array_equal(b, c)


def test_a_phoneme_lexicon_entry_reaches_espeak(fleet, client):
    """A phoneme entry ("w'In", eSpeak NG's own mnemonics for "Win") through the real fleet: the voice
    reads the phonemes, not the word: the audio is not that of "Nguyen", and as long as "Win"'s
    (within 1 %: phoneme input keeps the word, the sentence's prosody may move a few samples)."""
    entry = {"match": "Nguyen", "phonemes": "w'In"}
    by_phonemes = submit(client, text="Hello Nguyen.", lexicon=[entry])
    as_word = submit(client, text="Hello Win.")
    as_written = submit(client, text="Hello Nguyen.", seed=1)
    for job in (by_phonemes, as_word, as_written):
        assert wait_done(client, job["id"])["status"] == "done"
    a, _ = download(client, by_phonemes["id"])
    b, _ = download(client, as_word["id"])
    c, _ = download(client, as_written["id"])
    assert manifest(fleet, by_phonemes["id"])["segments"][0]["said"] == "Hello [[w'In]]."
    assert abs(a.size - b.size) <= 0.01 * b.size and a.size != c.size
    refused = client.post("/v1/jobs", json={"text": "Hi.", "model": "espeak", "lexicon": [{"match": "Hi", "phonemes": "a[b"}]})
    assert refused.status_code == 422 and "phonemes are eSpeak NG mnemonics" in refused.json()["detail"]


def test_markdown_emphasis_is_stressed_by_the_voice(fleet, client):
    """*no* reaches the speech workers with its marks (the manifest shows them as Markdown's), and
    the voice says the sentence otherwise: longer, beyond eSpeak NG's own jitter of a few samples.
    (tests/models/test_espeak.py holds the <emphasis> itself against the same SSML without it.)"""
    stressed = submit(client, text="I said *no* today.")
    flat = submit(client, text="I said no today.")
    for job in (stressed, flat):
        assert wait_done(client, job["id"])["status"] == "done"
    a, _ = download(client, stressed["id"])
    b, _ = download(client, flat["id"])
    assert a.size > 1.02 * b.size, (a.size, b.size)
    (segment,) = manifest(fleet, stressed["id"])["segments"]
    assert (segment["text"], segment["said"]) == ("I said no today.", "I said *no* today.")
