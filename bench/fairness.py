"""Fair scheduling on the CPU (eSpeak NG): does a short job wait for someone else's book?

1. Tenant B's 2-sentence job alone on the idle fleet (``--repeats`` times): submit-to-done.
2. Tenant A's book (``--book-segments``, 1,500) alone: its throughput (segments/s, submit to done).
3. The same book again, and B's job submitted ``--repeats`` times while it renders: B's
   submit-to-done under load, and the book's throughput with B beside it (2 and 3 interleaved
   ``--book-runs`` times; the throughputs are medians).

Targets (issue 17): B under load <= 2 x B idle + one segment's time; the book's throughput with B at
most 3 % lower than alone. One fleet, one run, real processes on a private Valkey.

    python bench/fairness.py --out bench/results/2026-12-01-fairness.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402

from narrate.embedded import EmbeddedValkey  # noqa: E402
from testing.fleetkit import espeak_settings, make_keys, start_fleet, wait_done  # noqa: E402


def book(segments: int) -> str:
    return " ".join(f"Sentence number {i} of the book is here." for i in range(segments))


def run_job(c: httpx.Client, text: str, **extra) -> tuple[float, dict]:
    started = time.monotonic()
    job = c.post("/v1/jobs", json={"text": text, **extra}).json()
    done = wait_done(c, job["id"], timeout=3600)
    return time.monotonic() - started, done


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--book-segments", type=int, default=1500)
    parser.add_argument("--repeats", type=int, default=5, help="B's job: runs alone, and runs beside each book")
    parser.add_argument("--book-runs", type=int, default=2, help="book renders alone and with B, interleaved")
    parser.add_argument("--speech-workers", type=int, default=0, help="0: the fleet's default")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    data = Path(tempfile.mkdtemp(prefix="narrate-fairness-"))
    valkey = EmbeddedValkey(data)
    url = valkey.start()
    prefix = "fair"
    settings = espeak_settings(url, prefix, data, tenant_chars_per_day=10**9)
    # the bench polls every 50 ms: no request limit in the way
    made = make_keys(url, prefix, {name: {"requests_per_minute": 10**6} for name in ("a", "b")})
    workers = args.speech_workers or settings.speech_worker_count
    fleet = start_fleet(settings, data / "logs", speech_workers=workers)
    short = "A short question. And its answer."
    report: dict = {"book_segments": args.book_segments, "speech_workers": workers}
    try:
        a = httpx.Client(base_url=fleet.base_url, headers={"Authorization": f"Bearer {made['a']}"}, timeout=120)
        b = httpx.Client(base_url=fleet.base_url, headers={"Authorization": f"Bearer {made['b']}"}, timeout=120)
        run_job(b, short)  # warm up
        idle = [run_job(b, short)[0] for _ in range(args.repeats)]
        def render_book(beside: bool) -> tuple[float, list[float]]:
            """The book, followed the same way both times; with ``beside``, B's job at each 10 %."""
            started = time.monotonic()
            job = a.post("/v1/jobs", json={"text": book(args.book_segments)}).json()
            shorts: list[float] = []
            while (state := a.get(f"/v1/jobs/{job['id']}").json())["status"] not in ("done", "failed"):
                due = state["segments_done"] >= args.book_segments * 0.1 * (1 + len(shorts))
                if beside and len(shorts) < args.repeats and due:
                    shorts.append(run_job(b, short)[0])
                time.sleep(0.05)
            return time.monotonic() - started, shorts

        alone_runs, with_runs, loaded = [], [], []
        for _ in range(args.book_runs):  # interleaved: the machine's drift hits both alike
            alone_runs.append(render_book(beside=False)[0])
            took, shorts = render_book(beside=True)
            with_runs.append(took)
            loaded += shorts
        alone_s, with_b_s = statistics.median(alone_runs), statistics.median(with_runs)
        segment_s = alone_s / args.book_segments * workers  # one segment's time on one engine
        report.update(
            short_idle_s=[round(x, 3) for x in idle],
            short_under_book_s=[round(x, 3) for x in loaded],
            short_idle_median_s=round(statistics.median(idle), 3),
            short_under_book_median_s=round(statistics.median(loaded), 3),
            short_under_book_max_s=round(max(loaded), 3),
            one_segment_s=round(segment_s, 3),
            target_short_s=round(2 * statistics.median(idle) + segment_s, 3),
            book_alone_s=[round(x, 2) for x in alone_runs],
            book_with_short_jobs_s=[round(x, 2) for x in with_runs],
            book_segments_per_s_alone=round(args.book_segments / alone_s, 2),
            book_segments_per_s_with_short_jobs=round(args.book_segments / with_b_s, 2),
            book_throughput_ratio=round(alone_s / with_b_s, 3),
        )
        report["met_short"] = report["short_under_book_max_s"] <= report["target_short_s"]
        report["met_book"] = report["book_throughput_ratio"] >= 0.97
        print("RESULT fairness", json.dumps(report), flush=True)
    finally:
        fleet.stop()
        valkey.stop()
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
