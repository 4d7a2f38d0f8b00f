"""The fault-injection suite at scale: the drivers of tests/integration/test_chaos.py and
test_memory_bound.py (tests/integration/fleetkit.py) on more segments, more kills, more Redis restarts.

    python bench/chaos.py --segments 1500 --kills 40 --interval 2 --redis-restarts 2 --paused-segments 5000
    python bench/chaos.py --cluster 6 --segments 1500 --kills 40 --paused-segments 0


1. Chaos (skipped with --segments 0): 2 AR workers, 2 decoders, 2 assemblers and an RQ worker on a
   private append-only Valkey narrate ``--segments`` short sentences once undisturbed (the reference),
   then again while a random worker is SIGKILLed every ``--interval`` s (every kind in turn, restarted
   by the supervisor) until the job has ended and ``--kills`` kills happened; Valkey is restarted
   ``--redis-restarts`` times (evenly through the job, ``--outage`` s away each time). Checked: the job
   is done, every segment exactly once and in order (manifest), audio bit-identical to the reference,
   no stage entry pending, no orphan key, no dead letter. With ``--cluster N`` the fleet's keys are on a
   Valkey Cluster (testing/cluster.py; RQ on the private Valkey) and instead of Redis restarts N
   primaries fail over evenly through the job (``fail_over``: each loses ``--lose`` s of its writes;
   the primary of the job's keys every other time), checked as well: writes were lost and redone.
2. Paused decoders (skipped with --paused-segments 0): a fresh fleet and Valkey; a job of
   ``--paused-segments`` sentences with every decoder SIGSTOPped; once back-pressure stops the AR
   stage, Redis memory is sampled against the bound of fleetkit.MemoryBound; SIGCONT; the job must
   complete with every segment exactly once and nothing left behind.

Prints the report and writes it as JSON to --out (a file, or a folder: chaos-<date>.json there).
Exits 1 if a check failed (the report says which).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import redis  # noqa: E402

from fleet.names import Names  # noqa: E402
from testing import fleetkit as kit  # noqa: E402


def check(report: dict, name: str, condition: bool, detail: object = "") -> None:
    report.setdefault("checks", {})[name] = bool(condition)
    if not condition:
        report.setdefault("failures", []).append(f"{name}: {detail}")


def chaos_phase(args, data_dir: Path, work: Path) -> dict:
    valkey = kit.PrivateValkey(work / "chaos-valkey").start()
    cluster = None
    settings = kit.chaos_settings(valkey.url, data_dir)
    settings = settings.model_copy(update={"max_text_chars": 20 * args.segments + 1000})
    if args.cluster:
        from testing.cluster import ValkeyCluster

        # the fleet's keys on the cluster; the private Valkey is RQ's (RQ does not support a cluster)
        cluster = ValkeyCluster(work / "chaos-cluster").start()
        settings = settings.model_copy(
            update={
                "redis_url": cluster.url, "rq_redis_url": valkey.url, "task_shards": 3, "durable_replicas": 1,
                "sweep_interval_s": 1.0,
            }
        )  # fmt: skip
    fleet = kit.start_fleet(
        settings, work / "chaos-logs", ar_workers=2, decoders=2, assemblers=2, finalizers=1, max_backoff_s=2.0
    )
    text = kit.short_sentences(args.segments)
    report: dict = {"segments": args.segments, "interval_s": args.interval, "outage_s": args.outage}
    try:
        with fleet.client() as client:
            started = time.monotonic()
            calm = kit.submit(client, text=text)["id"]
            check(report, "undisturbed run done", kit.wait_done(client, calm, 3600)["status"] == "done")
            report["undisturbed_wall_s"] = round(time.monotonic() - started, 1)
            reference = kit.download(client, calm)[0]
            stormy = kit.submit(client, text=text)["id"]
            restarts = 0 if cluster else args.redis_restarts  # a cluster's nodes fail over instead
            at = tuple((i + 1) / (restarts + 1) for i in range(restarts))
            failovers_at = tuple(0.8 * (i + 0.5) / args.cluster for i in range(args.cluster))  # all before 80 %
            storm = kit.storm(
                fleet,
                client,
                stormy,
                min_kills=args.kills,
                interval=args.interval,
                seed=args.seed,
                valkey=None if cluster else valkey,
                restarts_at=at,
                outage_s=args.outage,
                cluster=cluster,
                failovers_at=failovers_at,
                lose_s=args.lose,
                timeout=3600,
            )
            report.update(
                kills=len(storm.kills),
                kills_by_kind=storm.kills_by_kind,
                redis_restarts=storm.redis_restarts,
                restarted_at_segments=storm.restarted_at,
                storm_wall_s=storm.wall_s,
                status=storm.job["status"],
                segments_done=storm.job["segments_done"],
            )
            if cluster:
                report.update(
                    failovers=[
                        {
                            "killed": f.killed, "promoted": f.promoted, "replicas_stopped_s": f.stalled_s,
                            "promoted_s": f.promoted_s,
                            "segment_records_lost": None if f.before is None else len(f.before - f.after),
                        }
                        for f in storm.failovers
                    ],
                    segment_records_lost=storm.segments_lost,
                    recoveries_logged=sum(
                        log.read_text(errors="replace").count("queued again after Redis lost writes")
                        for log in fleet.log_dir.glob("*.log")
                    ),
                )  # fmt: skip
                check(report, "failovers", len(storm.failovers) == args.cluster, storm.failovers)
                check(report, "writes lost and redone", storm.segments_lost > 0, storm.failovers)
            check(report, "job done", storm.job["status"] == "done", storm.job)
            check(report, "kills", len(storm.kills) >= args.kills and all(storm.kills_by_kind.values()))
            check(report, "redis restarts", storm.redis_restarts == restarts)
            if storm.job["status"] == "done":
                order = kit.manifest_segments(settings, stormy)
                check(report, "every segment once, in order", order == list(range(args.segments)))
                report["segments_checked"] = len(order)
                audio = kit.download(client, stormy)[0]
                check(report, "audio identical to the undisturbed run", np.array_equal(audio, reference))
        names = Names(settings.key_prefix)
        with contextlib.closing(kit.connect(settings.redis_url)) as r, redis.Redis.from_url(valkey.url) as rq:
            orphans = kit.settled_orphan_keys(r, names, [calm, stormy], rq=rq)
            streams = kit.stage_streams(names, shards=settings.task_shards)
            pending = {s: r.xlen(s) + r.xpending(s, g)["pending"] for s, g in streams}
            check(report, "no orphan keys", not orphans, orphans[:20])
            check(report, "no pending entries", not any(pending.values()), pending)
            check(report, "no dead letters", r.xlen(names.dead_letters()) == 0)
        report["kill_list"] = storm.kills
    finally:
        fleet.stop()
        valkey.stop()
        if cluster is not None:
            cluster.stop()
    return report


def paused_phase(args, data_dir: Path, work: Path) -> dict:
    valkey = kit.PrivateValkey(work / "paused-valkey").start()
    settings = kit.memory_settings(valkey.url, data_dir, args.paused_segments)
    fleet = kit.start_fleet(settings, work / "paused-logs", ar_workers=2, decoders=2, assemblers=1)
    try:
        run = kit.paused_decoders_run(fleet, valkey, kit.short_sentences(args.paused_segments), ar_workers=2)
        report = run.report()
        check(report, "AR stage stopped", not run.moved_while_held and run.tasks_left > 0)
        check(report, "peak under the bound", run.peak_paused < run.bound.bound)
        check(report, "job done", run.job["status"] == "done", run.job)
        if run.job["status"] == "done":
            order = kit.manifest_segments(settings, run.job["id"])
            check(report, "every segment once, in order", order == list(range(args.paused_segments)))
        with redis.Redis.from_url(valkey.url) as r:
            names = Names(settings.key_prefix)
            orphans = kit.settled_orphan_keys(r, names, [run.job["id"]])
            check(report, "no orphan keys", not orphans, orphans[:20])
    finally:
        fleet.stop()
        valkey.stop()
    return report


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--segments", type=int, default=1500, help="segments of the chaos job (0: skip)")
    parser.add_argument("--kills", type=int, default=40, help="at least this many SIGKILLs")
    parser.add_argument("--interval", type=float, default=2.0, help="seconds between kills")
    parser.add_argument("--redis-restarts", type=int, default=1)
    parser.add_argument("--outage", type=float, default=5.0, help="seconds Valkey stays down per restart")
    parser.add_argument(
        "--paused-segments", type=int, default=5000, help="segments of the paused run (0: skip)"
    )
    parser.add_argument(
        "--cluster", type=int, default=0, metavar="FAILOVERS",
        help="run the chaos phase on a Valkey Cluster (3 primaries + 3 replicas) with this many failovers "
        "that lose writes (instead of Redis restarts)",
    )  # fmt: skip
    parser.add_argument("--lose", type=float, default=1.5, help="seconds of a primary's writes each failover loses")
    parser.add_argument("--seed", type=int, default=7, help="chooses the victims")
    parser.add_argument("--data-dir", default=None, help="tiny checkpoint, storage (default: a temp dir)")
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()

    from models.tiny import ensure_tiny_checkpoint

    work = Path(tempfile.mkdtemp(prefix="narrate-chaos-"))
    data_dir = Path(args.data_dir) if args.data_dir else work / "data"
    ensure_tiny_checkpoint(data_dir)
    report: dict = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.python_version()}",
        "command": " ".join(["python", *sys.argv]),
        "model": "tiny (reference engine, CPU)",
    }
    started = time.monotonic()
    for name, phase, wanted in (
        ("chaos", chaos_phase, args.segments),
        ("paused_decoders", paused_phase, args.paused_segments),
    ):
        if not wanted:
            continue
        phase_start = time.monotonic()
        try:
            report[name] = phase(args, data_dir, work)
        except Exception:  # noqa: BLE001 - report what broke, with the logs' place
            report[name] = {"failures": [traceback.format_exc()], "logs": str(work)}
        report[name]["phase_wall_s"] = round(time.monotonic() - phase_start, 1)
        print(f"{name}: {json.dumps(report[name], indent=1)}", flush=True)
    report["wall_s"] = round(time.monotonic() - started, 1)
    failures = [f for name in ("chaos", "paused_decoders") for f in report.get(name, {}).get("failures", [])]
    report["ok"] = not failures
    out = Path(args.out)
    if out.is_dir() or not out.suffix:
        out.mkdir(parents=True, exist_ok=True)
        out = out / f"chaos-{time.strftime('%Y-%m-%d')}.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"RESULT ok={report['ok']} wall_s={report['wall_s']} -> {out}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
