"""The measuring parts of bench/fleet_vs_vllm.py: its figures are only as good as these."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import pytest
import redis

sys.path.insert(0, str(Path(__file__).parents[2] / "bench"))
import numpy as np  # noqa: E402
from fleet_vs_vllm import (  # noqa: E402
    StreamWatcher,
    decoder_gpu_memory_mib,
    decoder_work,
    fleet_variant,
    per_window,
    raw_seqs,
    run_raw,
    spread_per_window,
)

from fleet.messages import AudioChunk, CodeChunk, SegmentTask  # noqa: E402
from workers.decoder import DecodeStats  # noqa: E402


def test_per_window_is_a_rate_per_window():
    events = [(0.5, 10), (4.9, 5), (5.0, 20), (11.0, 3)]
    assert per_window(events, 0.0, 12.0) == [3.0, 4.0, 1.5]  # 15/5, 20/5, 3/2 (the last window is 2 s)


def test_spread_per_window_counts_an_amount_where_it_was_made():
    # 30 made evenly over [2, 8): 15 in [0, 5) and 15 in [5, 10); an instant at 11 counts in its window
    assert spread_per_window([(2.0, 8.0, 30.0), (11.0, 11.0, 4.0)], 0.0, 12.0) == pytest.approx([3.0, 3.0, 2.0])
    # a burst published at once after 10 s of making: per_window sees it in one window only
    assert per_window([(9.9, 100.0)], 0.0, 10.0) == [0.0, 20.0]
    assert spread_per_window([(0.0, 9.9, 100.0)], 0.0, 10.0) == pytest.approx([100 / 9.9, 100 / 9.9 * 4.9 / 5])


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
        "decoder: 40 chunks in 5 batches (8.0 per batch), GPU memory 1210 MiB at most (420 MiB in tensors)\n"
    )
    (tmp_path / "decoder-g1-0.log").write_text("decoder: 9 chunks in 3 batches (3.0 per batch)\n")  # on the CPU
    (tmp_path / "ar-orpheus-0.log").write_text("GPU memory 7000 MiB at most\n")  # not a decoder
    assert decoder_gpu_memory_mib(tmp_path) == {"decoder-g0-0": 1210}
    assert decoder_gpu_memory_mib(tmp_path, tensors=True) == {"decoder-g0-0": 420}


def test_stream_watcher_spreads_a_segments_chunks_from_its_task(redis_url, key_prefix):
    """A segment's first chunk counts from its task's admission, each next one from the chunk before;
    a retry's task starts the segment again."""
    client = redis.Redis.from_url(redis_url)
    streams = {"task": f"{key_prefix}:task", "code": f"{key_prefix}:code", "audio": f"{key_prefix}:audio"}
    watcher = StreamWatcher(redis_url, streams)
    try:
        time.sleep(0.3)
        base = int(time.time() * 1000) - 20_000
        task = SegmentTask(job_id="job-2", segment=3, text="Hi.", model="tiny", voice="v", seed=1)
        frames = np.zeros((25, 7), np.int32)

        def chunk(seq: int, final: bool = False) -> dict:
            return CodeChunk("job-2", 3, 1, seq, "tiny", 0, 0, final, frames).encode()

        # added out of time order (the watcher's readers see streams in any order): the chunks first
        client.xadd(streams["code"], chunk(0), id=f"{base + 5000}-1")
        client.xadd(streams["code"], chunk(1, True), id=f"{base + 6000}-1")
        client.xadd(streams["code"], chunk(0), id=f"{base + 10_000}-1")
        client.xadd(streams["task"], task.encode(), id=f"{base}-1")
        client.xadd(streams["task"], task.encode(), id=f"{base + 9000}-1")  # its retry
        deadline = time.perf_counter() + 5
        while len(watcher.segment_events) < 5 and time.perf_counter() < deadline:
            time.sleep(0.02)
        spans = [(round(b - a, 2), n) for a, b, n in watcher.code_spans]
        assert spans == [(5.0, 25), (1.0, 25), (1.0, 25)]
    finally:
        watcher.stop()


def test_raw_vllm_runs_once_per_max_num_seqs_and_the_fastest_is_the_figure(monkeypatch, capsys):
    import fleet_vs_vllm

    assert raw_seqs("512") == [512] and raw_seqs("512,1024") == [512, 1024]
    for bad in ("", "512,x", "0,512"):
        with pytest.raises(argparse.ArgumentTypeError):
            raw_seqs(bad)
    walls = {"512": 40.0, "1024": 32.0, "256": 50.0}  # the same tokens in less time at 1,024
    calls = []

    def phase(args, fleet, phase, extra=None):
        calls.append((phase, extra))
        return {"tokens": 700_000, "wall_s": walls[extra[-1]]}

    monkeypatch.setattr(fleet_vs_vllm, "phase_in_subprocess", phase)
    args = argparse.Namespace(raw_max_num_seqs=[512, 1024, 256], max_num_seqs=512)
    raw = run_raw(args, {})
    assert calls == [("offline", ["--raw-max-num-seqs", n]) for n in ("512", "1024", "256")]
    audio_s = 700_000 / 7 * 2048 / 24000
    assert raw["max_num_seqs"] == 1024 and raw["wall_s"] == 32.0
    assert raw["audio_s_per_s"] == pytest.approx(audio_s / 32.0)
    assert raw["by_max_num_seqs"] == pytest.approx({512: audio_s / 40, 1024: audio_s / 32, 256: audio_s / 50})
    assert "RESULT raw vLLM at max_num_seqs 1024" in capsys.readouterr().out
    # no list: the AR engine's own max_num_seqs, once
    calls.clear()
    assert run_raw(argparse.Namespace(raw_max_num_seqs=None, max_num_seqs=512), {})["max_num_seqs"] == 512
    assert calls == [("offline", ["--raw-max-num-seqs", "512"])]


def test_the_host_cpu_line_tells_apart_leases_that_share_a_model_name():
    """Two H100 leases both said "Intel(R) Xeon(R) Processor" and gave raw vLLM 230 and 330
    audio-s/s: the line also carries the family/model/stepping, the clock and a one-core Python
    speed, read from this machine."""
    import fleet_vs_vllm as bench

    host = bench.host_cpu()
    assert host["cores"] >= 1 and host["model"]
    parts = host["family_model_stepping"].split("/")
    assert len(parts) == 3 and all(p.isdigit() for p in parts), host
    assert host["mhz"] is None or host["mhz"] > 100
    assert 1 < host["python_mops_per_s"] < 1000  # a plain loop: tens of millions a second on any core
    line = bench.host_line(host)
    assert line.startswith(host["model"]) and host["family_model_stepping"] in line and "Python loop" in line
    assert bench.python_speed(iterations=1000, repeats=1) > 0


def test_decoder_work_sums_every_stats_line_of_every_decoder(tmp_path):
    """The lines as the decoder writes them (DecodeStats.line), one per 10 s, each since the last."""
    lines = [DecodeStats(3, 40, 85.0, 2.5).line(10.0), DecodeStats(2, 10, 20.0, 0.5).line(10.2)]
    (tmp_path / "decoder-g0-0.log").write_text("\n".join(f"INFO workers.decoder: {x}" for x in lines) + "\n")
    (tmp_path / "decoder-g0-1.log").write_text(DecodeStats(1, 5, 8.0, 1.25).line(5.0) + ", GPU memory 9 MiB\n")
    (tmp_path / "ar-orpheus-0.log").write_text(DecodeStats(1, 99, 1.0, 9.0).line(10.0))  # not a decoder
    work = decoder_work(tmp_path)
    assert (work["chunks"], work["batches"], work["audio_s"]) == (55, 6, 113.0)
    assert work["busy_s"] == pytest.approx(2.5 + 0.5 + 1.25, abs=0.01)
