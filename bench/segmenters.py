"""The sentence splitter (jobs/segmentation.py) against sentencex (MIT, ~300 languages; Wikimedia's),
side by side in one run: the hard-case corpus (testing/segmentation_corpus.py) and the time to split
books of growing size (linear time is required: the ratio of times should follow the ratio of sizes).

    pip install -e '.[bench]'     # sentencex
    python bench/segmenters.py [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jobs.segmentation import plan_text  # noqa: E402
from testing.segmentation_corpus import CASES, TRADE_OFFS  # noqa: E402

CJK = re.compile(r"[\u3040-\u30ff\u4e00-\u9fff]")
PARAGRAPH = (
    "Dr. Reed arrived at 3.15 p.m. on Friday, e.g. in time; nobody noticed. \"Is that you?\" she asked. "
    "The U.S. Navy's ship cost $4.5 million... It sailed at dawn! Visit https://example.com/v2.1 for more. "
    "J. R. R. Tolkien, who wrote it, was not there (he never was). The end came at last.\n\n"
)


def ours(text: str) -> list[str]:
    return [text[s.start : s.end] for s in plan_text(text, markdown=False, max_chars=10**9).segments]


def theirs(text: str) -> list[str]:
    from sentencex import segment

    language = "ja" if CJK.search(text) else "en"
    return [s.strip() for s in segment(language, text) if s.strip()]


def accuracy(split) -> dict:
    wrong = [text for text, want in CASES if split(text) != want]
    trade = [text for text, want in TRADE_OFFS if split(text) != want]
    return {"cases": len(CASES), "wrong": wrong, "trade_offs": len(TRADE_OFFS), "trade_offs_wrong": trade}


def timing(split, chars: int, repeats: int = 3) -> float:
    text = PARAGRAPH * (chars // len(PARAGRAPH) + 1)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        split(text)
        best = min(best, time.perf_counter() - started)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", help="write the results here (JSON)")
    args = parser.parse_args()
    results = {}
    for name, split in (("ours", ours), ("sentencex", theirs)):
        acc = accuracy(split)
        small, large = timing(split, 250_000), timing(split, 2_000_000)
        results[name] = {
            **acc,
            "seconds_250k_chars": round(small, 3),
            "seconds_2m_chars": round(large, 3),
            "chars_per_s_2m": round(2_000_000 / large),
            "time_ratio_8x_size": round(large / small, 2),
        }
        print(
            f"RESULT {name}: corpus {acc['cases'] - len(acc['wrong'])}/{acc['cases']} right "
            f"(trade-offs {acc['trade_offs'] - len(acc['trade_offs_wrong'])}/{acc['trade_offs']}); "
            f"2M characters in {large:.2f} s ({2_000_000 / large / 1e6:.2f} M chars/s); "
            f"8x the text took {large / small:.1f}x the time"
        )
        for text in acc["wrong"]:
            print(f"  {name} wrong: {text!r} -> {split(text)}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1, ensure_ascii=False)


if __name__ == "__main__":
    main()
