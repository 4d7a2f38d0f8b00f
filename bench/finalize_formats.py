"""Finalize time and peak memory of a long book, per output format (CPU): issue 18's streaming proof.

A synthetic book (``--hours`` of audio at 24 kHz, ~3.3 s sentences with 300/700/1500 ms pauses, 20
chapters) is stitched by the finalizer's own ``jobs.audio.stitch`` into each format, in a fresh
process per format, segments made on the fly (harmonics under a syllable envelope, a few chapters
louder than others) so that storage does not count. Reported per format: wall time, real-time factor,
peak RSS of the process (``ru_maxrss``), the file's size, and with loudness normalisation (the
lossy formats' default) also the normalised loudness that Debian's ffmpeg (ebur128) measures.

    python bench/finalize_formats.py --hours 10 --out bench/results/2026-12-01-finalize-10h.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

RATE = 24_000
SENTENCE_S = 3.3


def book_text(hours: float) -> str:
    sentences = int(hours * 3600 / (SENTENCE_S + 0.45))
    per_chapter = max(sentences // 20, 1)
    out = []
    for i in range(sentences):
        if i % per_chapter == 0:
            out.append(f"\n\n# Chapter {i // per_chapter + 1}\n\n")
        out.append(f"Sentence number {i} is said here. ")
        if i % 6 == 5:
            out.append("\n\n")
    return "".join(out)


def segment_pcm(index: int, chapter: int) -> bytes:
    n = int(RATE * (SENTENCE_S + 0.8 * np.sin(index)))
    t = np.arange(n) / RATE
    f0 = 100 + (index * 37) % 80
    x = sum(np.sin(2 * np.pi * f0 * k * t + k) / k for k in range(1, 8))
    amp = 0.08 if chapter % 3 == 0 else 0.3  # some chapters quieter
    x = x / 2.6 * (0.5 + 0.5 * np.sin(2 * np.pi * 4 * t) ** 2) * amp
    return (x * 32767).astype("<i2").tobytes()


def one(fmt: str, hours: float, normalize: bool, out_dir: Path) -> dict:
    from jobs.audio import Pauses, stitch
    from jobs.segmentation import plan_text

    plan = plan_text(book_text(hours))
    chapter_of = {s.index: s.chapter for s in plan.segments}
    lengths = {}
    for s in plan.segments:  # the finalizer knows each part's length from Redis; here: make them once
        lengths[s.index] = int(RATE * (SENTENCE_S + 0.8 * np.sin(s.index)))
    out = out_dir / f"book.{fmt}"
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t = time.perf_counter()
    manifest = stitch(
        plan,
        lambda i: segment_pcm(i, chapter_of[i]),
        out,
        fmt=fmt,
        model_rate=RATE,
        out_rate=RATE,
        pauses=Pauses(300, 700, 1500),
        samples=lengths,
        tags={"title": "A long book", "artist": "Bench"},
        loudness=(-18.0, -3.0) if normalize else None,
    )
    wall = time.perf_counter() - t
    result = {
        "format": fmt,
        "normalized": normalize,
        "segments": len(plan.segments),
        "chapters": len(manifest.chapters),
        "audio_h": round(manifest.duration_s / 3600, 3),
        "wall_s": round(wall, 1),
        "x_real_time": round(manifest.duration_s / wall, 1),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "rss_before_stitch_mib": round(rss_before / 1024, 1),
        "file_mib": round(out.stat().st_size / 2**20, 1),
        "loudness": manifest.loudness,
    }
    if normalize:
        report = subprocess.run(
            ["ffmpeg", "-nostats", "-i", str(out), "-af", "ebur128=peak=true", "-f", "null", "-"],
            capture_output=True, text=True,
        ).stderr.rsplit("Summary:", 1)[-1]  # fmt: skip
        found = re.search(r"I:\s+(-?[\d.]+) LUFS", report), re.search(r"Peak:\s+(-?[\d.]+) dBFS", report)
        if all(found):
            result["ffmpeg_ebur128"] = {"lufs": float(found[0].group(1)), "true_peak_dbtp": float(found[1].group(1))}
    out.unlink()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hours", type=float, default=10.0)
    parser.add_argument("--formats", default="wav,flac,m4b,mp3,opus")
    parser.add_argument("--normalize", choices=["default", "on", "off"], default="default")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: one format in this process
    args = parser.parse_args()
    if args.one:
        fmt, normalize = args.one.split(":")
        with tempfile.TemporaryDirectory() as tmp:
            print(json.dumps(one(fmt, args.hours, normalize == "1", Path(tmp))))
        return 0
    from jobs.encoding import FORMATS

    results = []
    for fmt in args.formats.split(","):
        normalize = FORMATS[fmt].lossy if args.normalize == "default" else args.normalize == "on"
        proc = subprocess.run(
            [sys.executable, __file__, "--hours", str(args.hours), "--one", f"{fmt}:{int(normalize)}"],
            capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip
        if proc.returncode != 0:
            print(proc.stderr[-2000:], file=sys.stderr)
            return 1
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        results.append(result)
        print("RESULT", json.dumps(result), flush=True)
    if args.out:
        args.out.write_text(json.dumps({"hours": args.hours, "cpu": os.cpu_count(), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
