"""A model that never stops, through the real fleet (processes, Redis, HTTP, SSE): every segment is
retried once with its next seed, then kept and flagged; the file holds exactly the last tries' audio."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import redis

from fleet.names import Names
from fleet.settings import Settings
from jobs.audio import Pauses
from jobs.segmentation import plan_text
from testing.fleetkit import attempts_of, download, offline_segment_audio, read_sse, start_fleet, submit
from testing.fleetkit import manifest as fleetkit_manifest

pytestmark = pytest.mark.integration

TEXT = "Hi there. The fog lifted."


def test_a_model_that_never_stops_is_retried_then_flagged(redis_url, data_dir, tiny_dir, tmp_path):
    from testing.fleetkit import delete_prefix

    prefix = f"runaway-{int(time.time() * 1000) % 10**9}"
    # the tiny weights never emit a stop token; served as "orpheus", whose family requires one
    settings = Settings(
        redis_url=redis_url,
        key_prefix=prefix,
        data_dir=data_dir,
        models="tiny,orpheus",
        orpheus_dir=tiny_dir,
        runaway_retries=1,
        block_ms=200,
        reclaim_idle_ms=10_000,
    )
    fleet = start_fleet(settings, tmp_path / "logs")
    try:
        with fleet.client() as client:
            job_id = submit(client, text=TEXT, model="orpheus", voice="zoe")["id"]
            events = list(read_sse(client, f"/v1/jobs/{job_id}/events", timeout=300))
            status = client.get(f"/v1/jobs/{job_id}").json()
            audio, rate = download(client, job_id)
        kinds = [e.event for e in events]
        assert kinds[-1] == "done", fleet.logs()
        runaway = sorted(
            (json.loads(e.data) for e in events if e.event == "runaway"), key=lambda d: d["index"]
        )
        warning = sorted(
            (json.loads(e.data) for e in events if e.event == "warning"), key=lambda d: d["index"]
        )
        assert [(d["index"], d["retry"], d["kind"]) for d in runaway] == [
            (0, 0, "never_stops"),
            (1, 0, "never_stops"),
        ]
        assert [(d["index"], d["retries"], d["kind"]) for d in warning] == [
            (0, 1, "never_stops"),
            (1, 1, "never_stops"),
        ]
        assert status["status"] == "done" and status["segments_flagged"] == 2 and status["segments_done"] == 2

        manifest = fleetkit_manifest(settings, job_id)
        assert manifest["flagged_segments"] == [0, 1]
        assert [s["runaway"]["kind"] for s in manifest["segments"]] == ["never_stops"] * 2
        assert "no stop token after 16 frames" in manifest["segments"][0]["runaway"]["detail"]

        # the file is the last tries' audio (retry 1's seed) and the pause: nothing of the first tries
        plan = plan_text(TEXT)
        texts = [s.text for s in plan.segments]
        last = offline_segment_audio(settings, texts, "zoe", model="orpheus", retry=1)
        first = offline_segment_audio(settings, texts, "zoe", model="orpheus", retry=0)
        gap = Pauses(settings.sentence_pause_ms, 0, 0).samples(plan.segments[0].pause_after, rate)
        # budgets: max(12, ceil(1.7 frames per character)) -> 16 and 26 frames
        assert rate == 24000 and [a.shape[0] for a in last] == [16 * 2048, 26 * 2048]
        assert audio.shape[0] == last[0].shape[0] + gap + last[1].shape[0]
        pieces = [audio[: last[0].shape[0]], audio[last[0].shape[0] + gap :]]
        for piece, kept, dropped in zip(pieces, last, first, strict=True):
            assert np.max(np.abs(piece.astype(np.int32) - kept)) <= 2
            assert np.max(np.abs(piece.astype(np.int32) - dropped)) > 1000  # the other seed's audio differs

        r = redis.Redis.from_url(redis_url)
        names = Names(prefix)
        latest, won = attempts_of(r, names, job_id)
        assert won == latest and len(won) == 2  # each kept the try started last (the retry, above)
        assert r.keys(f"{names.job(job_id)}:deltas:*") == []
    finally:
        fleet.stop()
        delete_prefix(redis_url, prefix)
