"""pydub against PyAV for the finalizer's job (issue 18: choose the library by measurement).

The same synthetic book (``--minutes`` of 24 kHz mono, 3.3 s sentences with 300 ms pauses) written
as AAC in MP4 at 64 kb/s, each way in a fresh process:

- PyAV (what the finalizer uses): ``jobs.encoding.open_sink``, segment by segment;
- pydub, the way its API is meant to be used: an ``AudioSegment`` per sentence, summed with the
  pauses, then ``export(format="mp4", codec="aac", bitrate="64k")`` (it runs the ``ffmpeg`` binary).

Reported: wall time and peak RSS (this process and, for pydub, its ffmpeg child). Needs
``pip install pydub`` (not a dependency of the project) and an ``ffmpeg`` binary.

    python bench/pydub_vs_pyav.py --minutes 30 --out bench/results/2026-12-01-pydub-vs-pyav.json
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

RATE = 24_000


def sentence(i: int) -> np.ndarray:
    n = int(RATE * (3.3 + 0.8 * np.sin(i)))
    t = np.arange(n) / RATE
    x = sum(np.sin(2 * np.pi * (100 + (i * 37) % 80) * k * t + k) / k for k in range(1, 8))
    return (x / 2.6 * 0.3 * 32767).astype("<i2")


def with_pyav(minutes: float, out: Path) -> None:
    from jobs.encoding import FORMATS, open_sink

    sink = open_sink(out, FORMATS["m4a"], RATE, kbps=64)
    pause = np.zeros(RATE * 3 // 10, dtype=np.int16)
    for i in range(int(minutes * 60 / 3.6)):
        sink.write(sentence(i))
        sink.write(pause)
    sink.close()


def with_pydub(minutes: float, out: Path) -> None:
    from pydub import AudioSegment

    pause = AudioSegment.silent(duration=300, frame_rate=RATE)
    book = AudioSegment.empty()
    for i in range(int(minutes * 60 / 3.6)):
        book += AudioSegment(sentence(i).tobytes(), sample_width=2, frame_rate=RATE, channels=1) + pause
    book.export(out, format="mp4", codec="aac", bitrate="64k")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=30)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "book.m4a"
            t = time.perf_counter()
            (with_pyav if args.one == "pyav" else with_pydub)(args.minutes, out)
            wall = time.perf_counter() - t
            own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            child = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
            print(json.dumps({
                "library": args.one, "minutes": args.minutes, "wall_s": round(wall, 2),
                "peak_rss_mib": round(own, 1), "child_peak_rss_mib": round(child, 1),
                "file_mib": round(out.stat().st_size / 2**20, 2),
            }))  # fmt: skip
        return 0
    results = []
    for library in ("pyav", "pydub", "pyav", "pydub"):  # interleaved, twice
        proc = subprocess.run(
            [sys.executable, __file__, "--minutes", str(args.minutes), "--one", library],
            capture_output=True, text=True,
        )  # fmt: skip
        if proc.returncode:
            print(proc.stderr[-2000:], file=sys.stderr)
            return 1
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print("RESULT", json.dumps(results[-1]), flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
