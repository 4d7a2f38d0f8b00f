"""The measuring parts of bench/fleet_vs_vllm.py: its figures are only as good as these."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import pytest
import redis

sys.path.insert(0, str(Path(__file__).parents[2] / "bench"))
from fleet_vs_vllm import StreamWatcher, decoder_gpu_memory_mib, fleet_variant, per_window  # noqa: E402

from fleet.messages import AudioChunk  # noqa: E402


def test_per_window_is_a_rate_per_window():
    events = [(0.5, 10), (4.9, 5), (5.0, 20), (11.0, 3)]
    assert per_window(events, 0.0, 12.0) == [3.0, 4.0, 1.5]  # 15/5, 20/5, 3/2 (the last window is 2 s)


def test_fleet_variant_parses_and_refuses():
    assert fleet_variant("two:ar_workers=2,NARRATE_X=a=b") == ("two", {"ar_workers": "2", "NARRATE_X": "a=b"})
    assert fleet_variant("two-gpus:gpus=0+1,decoder_placement=first") == ("two-gpus", {"gpus": "0,1", "decoder_placement": "first"})
    for bad in (":ar_workers=2", "two:ar_workers", "two:=2"):
        with pytest.raises(argparse.ArgumentTypeError):
            fleet_variant(bad)


def test_stream_watcher_times_entries_when_redis_added_them(redis_url, key_prefix):
    """A reader that lags under load must not move the timeline: an entry added (by its id) 10 s
    ago counts 10 s ago, however late the watcher reads it."""
    client = redis.Redis.from_url(redis_url)
    streams = {"task": f"{key_prefix}:task", "code": f"{key_prefix}:code", "audio": f"{key_prefix}:audio"}
    watcher = StreamWatcher(redis_url, streams)
    try:
        time.sleep(0.3)  # the watcher is waiting on the (empty) streams
        added_ms = int(time.time() * 1000) - 10_000
        chunk = AudioChunk("job-1", 0, 0, 0, False, 24000, b"\0\0" * 12000)
        client.xadd(streams["audio"], chunk.encode(), id=f"{added_ms}-1")
        seen = time.perf_counter()
        deadline = seen + 5
        while "job-1" not in watcher.first and time.perf_counter() < deadline:
            time.sleep(0.02)
        assert seen - watcher.first["job-1"] == pytest.approx(10.0, abs=0.1)
        assert watcher.audio_s == [(watcher.first["job-1"], 0.5)]
    finally:
        watcher.stop()


def test_decoder_gpu_memory_is_each_decoders_last_stats_line(tmp_path):
    (tmp_path / "decoder-g0-0.log").write_text(
        "decoder: 9 chunks in 3 batches (3.0 per batch), GPU memory 900 MiB at most\n"
        "decoder: 40 chunks in 5 batches (8.0 per batch), GPU memory 1210 MiB at most\n"
    )
    (tmp_path / "decoder-g1-0.log").write_text("decoder: 9 chunks in 3 batches (3.0 per batch)\n")  # on the CPU
    (tmp_path / "ar-orpheus-0.log").write_text("GPU memory 7000 MiB at most\n")  # not a decoder
    assert decoder_gpu_memory_mib(tmp_path) == {"decoder-g0-0": 1210}
