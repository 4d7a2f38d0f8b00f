"""Piper's speed on the CPU (issue 21): the real-time factor of one book through a real fleet with 1
and 2 speech worker processes, and of the engine alone, and how busy the cores were.

- engine: one process, ``PiperEngine`` with 1 and with all cores' onnxruntime threads, on the book's
  sentences one after the other (the speech worker's own loop, without Redis);
- fleet: a private Valkey, the API, N speech workers (their onnxruntime threads: the cores over N,
  ``NARRATE_PIPER_THREADS`` unset), an assembler and a finalizer as real processes; the book
  (examples/lighthouse.md, 51 sentences) POSTed and timed to ``done``. Speech seconds are the
  manifest's segments (pauses left out); the real-time factor is speech seconds / wall seconds.
  Busy: the machine's CPU time (all processes, /proc/stat through psutil) over the job's wall time
  and cores; ``speech_cpu_share``: the speech workers' own CPU seconds over wall x cores.
  ``--oversubscribed`` adds N workers x all cores' threads each (what the thread setting prevents).

    python bench/piper_speed.py --out bench/results/2026-12-01-piper-speed-cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROOT = Path(__file__).resolve().parents[1]


def cores() -> int:
    return len(os.sched_getaffinity(0))


def engine_alone(sentences: list[str], threads: int) -> dict:
    from models import piper

    engine = piper.PiperEngine(piper.catalogue(None), threads=threads, preload="en_US-joe-medium")
    engine.speak("Warm up.", "en_US-joe-medium")
    t0 = time.perf_counter()
    samples = sum(engine.speak(s, "en_US-joe-medium").size for s in sentences)
    wall = time.perf_counter() - t0
    firsts = []  # a short sentence's first (and only) piece: what a segment's first audio waits for
    for _ in range(5):
        t1 = time.perf_counter()
        engine.synthesize(
            "The fog did not care.", "en_US-joe-medium", lambda _p, t1=t1: firsts.append(time.perf_counter() - t1)
        )  # None: stop after the first piece
    return {"threads": threads, "speech_s": round(samples / 22050, 1), "wall_s": round(wall, 2),
            "rtf": round(samples / 22050 / wall, 2),
            "first_piece_ms_median": round(sorted(firsts)[2] * 1000)}  # fmt: skip


def fleet_run(text: str, workers: int, threads: int = 0) -> dict:
    import httpx
    import psutil

    from fleet.settings import Settings
    from narrate.embedded import EmbeddedValkey
    from testing.fleetkit import manifest, start_fleet, wait_done

    data = Path(tempfile.mkdtemp(prefix="narrate-piper-speed-"))
    valkey = EmbeddedValkey(data)
    url = valkey.start()
    settings = Settings(redis_url=url, key_prefix="ps", data_dir=data, models="piper", default_model="piper",
                        block_ms=200, heartbeat_s=1, piper_threads=threads)  # fmt: skip
    fleet = start_fleet(settings, data / "logs", speech_workers=workers)
    try:
        client = httpx.Client(base_url=fleet.base_url, timeout=60)
        deadline = time.monotonic() + 120
        while not client.get("/v1/models").json()[0]["ready"]:
            assert time.monotonic() < deadline, fleet.logs()
            time.sleep(0.2)
        warm = client.post("/v1/jobs", json={"text": "Warm up, both of you. And again. Once more."}).json()
        wait_done(client, warm["id"], timeout=120)
        speech = [c.process for c in fleet.supervisor.children if c.name.startswith("speech-")]
        cpu0 = {p.pid: sum(psutil.Process(p.pid).cpu_times()[:2]) for p in speech}
        machine0 = psutil.cpu_times()
        t0 = time.perf_counter()
        job = client.post("/v1/jobs", json={"text": text, "title": "The Lighthouse"}).json()
        done = wait_done(client, job["id"], timeout=600)
        wall = time.perf_counter() - t0
        machine1 = psutil.cpu_times()
        cpu1 = {p.pid: sum(psutil.Process(p.pid).cpu_times()[:2]) for p in speech}
        assert done["status"] == "done", done
        m = manifest(settings, job["id"])
        speech_s = sum(s["end_s"] - s["start_s"] for s in m["segments"])
        busy = sum(machine1) - sum(machine0) - (machine1.idle - machine0.idle) - (machine1.iowait - machine0.iowait)
        logs = "".join((data / "logs" / f"speech-{i}.log").read_text() for i in range(workers))
        threads_logged = [int(t) for t in re.findall(r"Piper voice \S+ loaded \(.*?, (\d+) thread", logs)]
        return {
            "speech_workers": workers,
            "threads_per_worker": threads or max(1, cores() // workers),
            "segments": len(m["segments"]),
            "speech_s": round(speech_s, 1),
            "audio_s": round(m["duration_s"], 1),
            "wall_s": round(wall, 2),
            "rtf": round(speech_s / wall, 2),
            "machine_busy": round(busy / (wall * cores()), 2),
            "speech_cpu_share": round(sum(cpu1[p] - cpu0[p] for p in cpu1) / (wall * cores()), 2),
            "threads_logged": threads_logged,  # each worker's onnxruntime threads, as it logged them
        }
    finally:
        fleet.stop()
        valkey.stop()


def main() -> int:
    from jobs.segmentation import plan_text

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--text", type=Path, default=ROOT / "examples" / "lighthouse.md")
    parser.add_argument("--workers", default="1,2", help="speech worker counts to run, comma separated")
    parser.add_argument("--oversubscribed", action="store_true")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    text = args.text.read_text(encoding="utf-8")
    sentences = [s.spoken_text for s in plan_text(text).segments]
    report: dict = {"cores": cores(), "text": str(args.text.resolve().relative_to(ROOT)), "sentences": len(sentences)}
    report["engine_alone"] = [engine_alone(sentences, t) for t in sorted({1, cores()})]
    print("engine alone:", report["engine_alone"], flush=True)
    report["fleet"] = []
    for n in (int(w) for w in args.workers.split(",")):
        report["fleet"].append(fleet_run(text, n))
        print("fleet:", report["fleet"][-1], flush=True)
    if args.oversubscribed:
        report["fleet"].append({**fleet_run(text, cores(), threads=cores()), "oversubscribed": True})
        print("fleet:", report["fleet"][-1], flush=True)
    print("RESULT piper speed", json.dumps(report), flush=True)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
