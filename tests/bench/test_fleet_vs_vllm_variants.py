"""bench/fleet_vs_vllm.py's fleet variants without a benchmark: the changes reach the variant's
settings, ``redis=cluster`` puts the fleet on a real Valkey Cluster (RQ on the single server) where
the bench's own stream readers work, and the per-round ratios and their medians add up."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import redis

sys.path.insert(0, str(Path(__file__).parents[2] / "bench"))
import fleet_vs_vllm as bench  # noqa: E402

from fleet.messages import AudioChunk  # noqa: E402
from fleet.names import Names  # noqa: E402

OVERRIDES = dict(models="tiny", default_model="tiny", segment_cache="off")


def fake_run(audio_s: float = 20.0, wall_s: float = 10.0, ttfa: float = 0.5) -> dict:
    """What run_fleet returns, as far as fleet_summary reads it (one 2,048-sample segment)."""
    return {
        "complete": True, "wall_s": wall_s, "audio_s": audio_s, "ttfa_s": [ttfa], "timeline": [],
        "ar_tokens_per_s_made": {"whole": 1400, "steady": None, "tail": 1200},
        "resources_steady": {"cpu_percent": {"api": 30.0, "valkey-node-0": 5.0, "valkey-node-1": 7.0}},
        "queue_peaks": {}, "redis_memory_peak_mb": 1.0, "short_jobs_first_audio_s": [], "short_jobs_done_s": [],
        "first_byte_idle": None, "first_byte_loaded": None, "manifests": [{"segments": [{"samples": 2048 * 10}]}],
        "decoder_work": {"chunks": 4, "batches": 2, "audio_s": 20.0, "busy_s": 0.5},
    }  # fmt: skip


def single_valkey(url: str):
    """An EmbeddedValkey as variant_redis reads it: its URL and its process."""
    return SimpleNamespace(url=url, process=SimpleNamespace(pid=os.getpid()))


def test_redis_kind_is_checked_when_parsed():
    assert bench.fleet_variant("c:redis=cluster,task_shards=3") == ("c", {"redis": "cluster", "task_shards": "3"})
    with pytest.raises(argparse.ArgumentTypeError, match="redis="):
        bench.fleet_variant("c:redis=sentinel")


def test_a_variant_gets_its_settings_and_the_parsed_change_stays_whole(monkeypatch, tmp_path, redis_url):
    seen = {}

    def run_fleet(args, env, settings, log_dir, ar_workers, redis_pids):
        seen.update(settings=settings, env=env, ar_workers=ar_workers, pids=redis_pids)
        return fake_run()

    monkeypatch.setattr(bench, "run_fleet", run_fleet)
    args = SimpleNamespace(ar_workers=1, data_dir=str(tmp_path))
    name, change = bench.fleet_variant("v:ar_workers=2,task_shards=3,cuda_mps=true,NARRATE_X=1")
    summary = bench.run_variant(args, OVERRIDES, "p", single_valkey(redis_url), name, change, tmp_path / "logs-v")
    assert change == {"ar_workers": "2", "task_shards": "3", "cuda_mps": "true", "NARRATE_X": "1"}  # run again later
    assert (seen["ar_workers"], seen["settings"].task_shards, seen["env"]["NARRATE_X"]) == (2, 3, "1")
    assert seen["settings"].cuda_mps is True  # run_fleet starts the variant's MPS daemon from it
    assert seen["settings"].redis_url == redis_url and seen["settings"].rq_redis_url is None
    assert seen["settings"].key_prefix == "p-v"
    assert summary["change"] == {
        "task_shards": "3", "cuda_mps": "true", "ar_workers": 2, "redis": "single", "NARRATE_X": "1"
    }  # fmt: skip
    assert summary["tokens_per_s"] == 7.0  # 10 frames x 7 codes in 10 s
    assert summary["redis_cpu_percent"] == 12.0  # the valkey processes only
    assert summary["ar_tokens_per_s_made"] == {"whole": 1400, "steady": None, "tail": 1200}  # the variant's own
    assert summary["decoder_work"]["busy_s"] == 0.5  # the decoders' GPU time, beside the fleet's


@pytest.mark.integration
def test_redis_cluster_runs_the_variant_on_a_cluster_and_the_readers_work_there(monkeypatch, tmp_path, redis_url):
    """The fleet's Redis is a fresh 3 + 3 Valkey Cluster, RQ stays on the single server, and the
    bench's StreamWatcher and QueueSampler read the task shards (three slots) and the audio stream
    there; the cluster is gone after the variant."""
    seen = {}

    def run_fleet(args, env, settings, log_dir, ar_workers, redis_pids):
        assert settings.redis_url.startswith("redis+cluster://") and settings.task_shards == 3
        assert settings.rq_redis_url == redis_url
        names, model = Names(settings.key_prefix), settings.default_model
        tasks = [names.tasks(model, shard) for shard in range(settings.task_shards)]
        watcher = bench.StreamWatcher(settings.redis_url, {"task": tasks, "code": names.codes(model), "audio": names.audio()})
        sampler = bench.QueueSampler(settings.redis_url, {"tasks": tasks})
        client = bench.redis_client(settings.redis_url)
        try:
            # no wait for the readers to start: what is added after the watcher exists is seen
            for shard, stream in enumerate(tasks):
                client.xadd(stream, AudioChunk(f"job-{shard}", 0, 0, 0, False, 24000, b"").encode())
            client.xadd(names.audio(), AudioChunk("job-0", 0, 0, 0, False, 24000, b"\0\0" * 12000).encode())
            deadline = time.perf_counter() + 5
            while (len(watcher.first_by["task"]) < 3 or not watcher.first) and time.perf_counter() < deadline:
                time.sleep(0.02)
            time.sleep(1.2)  # two samples of the queues
            seen.update(tasks=sorted(watcher.first_by["task"]), audio=[a for _, a in watcher.audio_s])
            seen.update(peak=sampler.peak["tasks"], memory=sampler.memory_peak, pids=redis_pids)
        finally:
            watcher.stop()
            sampler.stop()
            client.close()
        return fake_run()

    monkeypatch.setattr(bench, "run_fleet", run_fleet)
    args = SimpleNamespace(ar_workers=1, data_dir=str(tmp_path))
    name, change = bench.fleet_variant("cluster:redis=cluster,task_shards=3")
    summary = bench.run_variant(args, OVERRIDES, "cb", single_valkey(redis_url), name, change, tmp_path / "logs-c")
    assert seen["tasks"] == ["job-0", "job-1", "job-2"] and seen["audio"] == [0.5]
    assert seen["peak"] == 3 and seen["memory"] > 0
    assert len([k for k in seen["pids"] if k.startswith("valkey-node-")]) == 6 and "valkey-rq" in seen["pids"]
    assert summary["change"]["redis"] == "cluster"
    for pid in (p for k, p in seen["pids"].items() if k.startswith("valkey-node-")):
        with pytest.raises(ProcessLookupError):  # stopped with the variant
            os.kill(pid, 0)
    assert redis.Redis.from_url(redis_url).ping()  # the single server is the caller's: left running


def test_round_ratios_and_their_medians():
    def summary(audio, tokens, ttfa):
        return {"audio_s_per_s": audio, "tokens_per_s": tokens, "ttfa_idle_median_s": ttfa, "complete": True, "redis_cpu_percent": 0}

    rounds = []
    for fleet, variant in [((2.0, 100, 0.5), (1.0, 50, 1.0)), ((4.0, 200, 0.5), (3.0, 150, 0.5))]:
        base, v = summary(*fleet), summary(*variant)
        v["ratio_over_fleet"] = bench.ratios(v, base)
        rounds.append(bench.round_row(base, {"c": v}))
    assert rounds[0]["variants"]["c"]["ratio_over_fleet"] == {"audio_s_per_s": 0.5, "tokens_per_s": 0.5, "ttfa_idle_median_s": 2.0}
    m = bench.variant_medians(rounds)["c"]
    assert m["audio_s_per_s_median"] == 2.0 and m["audio_s_per_s_ratio_of_medians"] == 2.0 / 3.0
    assert m["audio_s_per_s_ratio_median"] == pytest.approx((0.5 + 0.75) / 2)
    assert m["ttfa_idle_median_s_ratio_median"] == 1.5
