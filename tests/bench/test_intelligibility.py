"""The intelligibility round trip of bench/intelligibility.py, small: sentences narrated by Piper and
by eSpeak NG, transcribed offline by PocketSphinx (its model ships in its PyPI wheel), and Piper's
word recall clearly above eSpeak NG's. Also the scoring itself, on words whose answer is known."""

from __future__ import annotations

import sys
from pathlib import Path

from tests.conftest import require, require_module

require_module("pocketsphinx", "PocketSphinx (the test extra), the offline recogniser of the round trip")

sys.path.insert(0, str(Path(__file__).parents[2] / "bench"))
from intelligibility import score, transcribe, words  # noqa: E402

SENTENCES = [
    "The harbour woke before the town did.",
    "Gulls argued over the nets while the old man counted crates.",
    "A boat came in late.",
    "Its hull was painted a tired blue.",
    "The letter arrived on Tuesday.",
    "It was sealed with green wax.",
    "He searched the shed anyway.",
    "The walk took an hour.",
    "Someone was singing above him.",
    "Light poured across the water.",
]


def test_scoring_counts_words_given_back_in_order():
    assert words("The harbour, at 5 a.m.!") == ["the", "harbor", "at", "five", "a", "m"]
    assert score(["a", "b", "c", "d"], ["a", "b", "c", "d"]) == (4, 0)
    assert score(["a", "b", "c", "d"], ["a", "x", "c"]) == (2, 2)  # b substituted, d deleted
    assert score(["a", "b"], []) == (0, 2)
    assert score(["a", "b"], ["b", "a"])[0] == 1  # in order only


def test_piper_is_heard_better_than_espeak():
    from models.espeak import unavailable_reason as espeak_unavailable
    from models.piper import unavailable_reason as piper_unavailable

    require(piper_unavailable() is None, f"Piper: {piper_unavailable()}")
    require(espeak_unavailable() is None, f"eSpeak NG: {espeak_unavailable()}")
    from pocketsphinx import Decoder

    from models import espeak, piper

    voice = piper.PiperEngine(piper.catalogue(None), threads=1, noise_scale=0.0, noise_w=0.0)
    speakers = {"piper": lambda t: voice.speak(t, "en_US-joe-medium"), "espeak": lambda t: espeak.engine().speak(t)}
    decoder = Decoder(samprate=16000, logfn="/dev/null")
    recall = {}
    for name, speak in speakers.items():
        hits = total = 0
        for sentence in SENTENCES:
            heard = words(transcribe(decoder, speak(sentence), 22050))
            hits += score(words(sentence), heard)[0]
            total += len(words(sentence))
        recall[name] = hits / total
    print(f"\nword recall over {total} words: {recall}")
    # measured: piper 0.67, espeak 0.16 (noise off: the same audio every run)
    assert recall["piper"] > 0.5 and recall["piper"] > recall["espeak"] + 0.2, recall
