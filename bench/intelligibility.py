"""Intelligibility round trip (issue 21): the same sentences narrated by Piper (en_US-joe-medium) and
by eSpeak NG (en-us), each transcribed offline by PocketSphinx 5 (its US English acoustic model,
language model and dictionary ship inside the PyPI wheel: ``pip install -e '.[bench]'``), and the
word recall of each: the share of the text's words that the recogniser gives back, in order
(difflib's matching blocks over the word sequences), and the word error rate.

PocketSphinx is an old, small recogniser with a general-English trigram model: its own errors are
many, so the figures are a comparison on equal terms (the same text, recogniser and settings), not
an absolute measure. Each sentence is spoken alone (the engines' own calls, no fleet), resampled
to 16 kHz (soxr) and decoded as one utterance.

    python bench/intelligibility.py --out bench/results/2026-12-01-intelligibility-cpu.json
"""

from __future__ import annotations

import argparse
import difflib
import importlib.metadata
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
#: What the example's numbers and abbreviations are said as (both engines read them so).
NUMBERS = {"3.5": "three point five", "5": "five", "e.g.": "e g", "a.m.": "a m", "mr.": "mister", "dr.": "doctor"}


def words(text: str) -> list[str]:
    """Lower-case words, the way the recogniser's dictionary spells them (its output has no
    punctuation, numbers as words; British spellings become American: harbour -> harbor)."""
    text = text.lower()
    for written, said in NUMBERS.items():
        text = text.replace(written, said)
    text = text.replace("harbour", "harbor").replace("-", " ")
    return re.findall(r"[a-z']+", text)


def score(reference: list[str], hypothesis: list[str]) -> tuple[int, int]:
    """(reference words recognised in order, edit distance in words)."""
    matcher = difflib.SequenceMatcher(a=reference, b=hypothesis, autojunk=False)
    hits = sum(block.size for block in matcher.get_matching_blocks())
    # word-level Levenshtein for the WER
    previous = list(range(len(hypothesis) + 1))
    for i, r in enumerate(reference, 1):
        current = [i]
        for j, h in enumerate(hypothesis, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (r != h)))
        previous = current
    return hits, previous[-1]


def transcribe(decoder, audio: np.ndarray, rate: int) -> str:
    import soxr

    x = soxr.resample(audio.astype(np.float32) / 32768.0, rate, 16000)
    pcm = (np.clip(x, -1.0, 1.0) * 32767).astype(np.int16)
    decoder.start_utt()
    decoder.process_raw(pcm.tobytes(), full_utt=True)
    decoder.end_utt()
    hyp = decoder.hyp()
    return hyp.hypstr if hyp is not None else ""


def main() -> int:
    from pocketsphinx import Decoder

    from fleet.settings import Settings
    from jobs.segmentation import plan_text
    from models import espeak, piper

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--text", type=Path, default=ROOT / "examples" / "lighthouse.md")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    sentences = [s.spoken_text for s in plan_text(args.text.read_text(encoding="utf-8")).segments]
    sentences = [s for s in sentences if len(words(s)) >= 3]  # headings and "He shivered." say little
    engines = {
        "piper en_US-joe-medium": lambda t: piper.engine(Settings(speech_workers=1)).speak(t, "en_US-joe-medium"),
        "espeak en-us": lambda t: espeak.engine().speak(t, "en-us"),
    }
    decoder = Decoder(samprate=16000, logfn="/dev/null")
    recogniser = f"pocketsphinx {importlib.metadata.version('pocketsphinx')} (its en-us model, en-us.lm.bin)"
    report: dict = {"text": str(args.text.resolve().relative_to(ROOT)), "sentences": len(sentences),
                    "reference_words": sum(len(words(s)) for s in sentences), "recogniser": recogniser,
                    "engines": {}}  # fmt: skip
    for name, speak in engines.items():
        hits = errors = total = 0
        speech_s = 0.0
        examples = []
        for i, sentence in enumerate(sentences):
            audio = speak(sentence)
            speech_s += audio.size / 22050
            heard = transcribe(decoder, audio, 22050)
            ref, hyp = words(sentence), words(heard)
            h, e = score(ref, hyp)
            hits, errors, total = hits + h, errors + e, total + len(ref)
            if i < 6:
                examples.append({"text": sentence, "heard": heard})
        report["engines"][name] = {
            "word_recall": round(hits / total, 3),
            "wer": round(errors / total, 3),
            "speech_s": round(speech_s, 1),
            "examples": examples,
        }
        print(f"{name}: word recall {hits / total:.1%}, WER {errors / total:.1%} over {total} words", flush=True)
    print("RESULT intelligibility", json.dumps({k: {m: v[m] for m in ("word_recall", "wer")} for k, v in report["engines"].items()}))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
