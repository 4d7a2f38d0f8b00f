"""The single-codebook family end to end: tiny-llasa (1 code per 20 ms frame, 16 kHz) and tiny
(Orpheus, 7 codes per frame, 24 kHz) served by the same fleet processes at once, each file at its own
model's rate, each segment equal to an offline decode."""

from __future__ import annotations

import time

import numpy as np
import pytest

from fleet.settings import Settings
from jobs.audio import Pauses
from jobs.segmentation import plan_text
from testing.fleetkit import download, offline_segment_audio, start_fleet, submit, wait_done
from testing.fleetkit import manifest as fleetkit_manifest

pytestmark = pytest.mark.integration

LLASA_TEXT = "# One\n\nThe harbour woke before the town did. Gulls argued.\n\n# Two\n\nThe fog lifted."


def test_llasa_and_orpheus_layouts_side_by_side(redis_url, data_dir, tiny_dir, tiny_llasa_dir, tmp_path):
    from testing.fleetkit import delete_prefix

    prefix = f"llasa-{int(time.time() * 1000) % 10**9}"
    settings = Settings(
        redis_url=redis_url,
        key_prefix=prefix,
        data_dir=data_dir,
        models="tiny,tiny-llasa",
        block_ms=200,
        reclaim_idle_ms=10_000,
    )
    fleet = start_fleet(settings, tmp_path / "logs")
    try:
        with fleet.client() as client:
            models = {m["name"]: m for m in client.get("/v1/models").json()}
            assert models["tiny-llasa"]["sample_rate"] == 16000 and models["tiny-llasa"]["voices"] == [
                "default"
            ]
            llasa_id = submit(client, text=LLASA_TEXT, model="tiny-llasa")["id"]
            resampled_id = submit(client, text="The fog lifted.", model="tiny-llasa", sample_rate=24000)["id"]
            orpheus_id = submit(client, text="The fog lifted. Gulls argued.", model="tiny", voice="leo")["id"]
            for job_id in (llasa_id, resampled_id, orpheus_id):
                status = wait_done(client, job_id, timeout=300)
                assert status["status"] == "done" and status["segments_flagged"] == 0, fleet.logs()
            audio, rate = download(client, llasa_id)
            resampled, resampled_rate = download(client, resampled_id)
            orpheus_audio, orpheus_rate = download(client, orpheus_id)
        assert (rate, resampled_rate, orpheus_rate) == (16000, 24000, 24000)

        plan = plan_text(LLASA_TEXT)
        reference = offline_segment_audio(
            settings, [s.text for s in plan.segments], "default", model="tiny-llasa"
        )
        pauses = Pauses(settings.sentence_pause_ms, settings.paragraph_pause_ms, settings.chapter_pause_ms)
        manifest = fleetkit_manifest(settings, llasa_id)
        assert manifest["sample_rate"] == 16000 and manifest["flagged_segments"] == []
        position = 0
        for seg, ref, entry in zip(plan.segments, reference, manifest["segments"], strict=True):
            # random weights use the whole budget: max(20, ceil(1.5 frames per character)) of 320 samples
            assert ref.shape[0] == max(20, -(-len(seg.text) * 3 // 2)) * 320
            assert (entry["start_sample"], entry["samples"]) == (position, ref.shape[0])
            piece = audio[position : position + ref.shape[0]]
            assert np.max(np.abs(piece.astype(np.int32) - ref)) <= 2, f"segment {seg.index} differs"
            position += ref.shape[0]
            gap = pauses.samples(seg.pause_after, 16000)
            assert not audio[position : position + gap].any()
            position += gap
        assert position == audio.shape[0]

        # the 24 kHz request: one 16 kHz segment (15 characters: 23 frames) resampled, within a sample
        assert abs(resampled.shape[0] - 23 * 320 * 24000 // 16000) <= 1
        tiny_plan = plan_text("The fog lifted. Gulls argued.")
        tiny_ref = offline_segment_audio(settings, [s.text for s in tiny_plan.segments], "leo")
        gap = pauses.samples(tiny_plan.segments[0].pause_after, 24000)
        assert orpheus_audio.shape[0] == tiny_ref[0].shape[0] + gap + tiny_ref[1].shape[0]
    finally:
        fleet.stop()
        delete_prefix(redis_url, prefix)
