from __future__ import annotations

import pytest

from jobs.segmentation import Pause, Plan, plan_text
from testing.segmentation_corpus import CASES


def texts(source: str, **kw) -> list[str]:
    return [s.text for s in plan_text(source, **kw).segments]


def test_abbreviations_decimals_quotes_and_ellipses_do_not_split():
    source = (
        'Dr. Smith paid $3.50 for it, e.g. on Monday. "Is it done?" she asked... He left. '
        "Mr. O'Neil arrived at 5 p.m. today. The U.S.A. is big. J. R. R. Tolkien wrote it."
    )
    assert texts(source) == [
        "Dr. Smith paid $3.50 for it, e.g. on Monday.",
        '"Is it done?" she asked...',
        "He left.",
        "Mr. O'Neil arrived at 5 p.m. today.",
        "The U.S.A. is big.",
        "J. R. R. Tolkien wrote it.",
    ]


def test_sentence_ending_in_a_quote_and_exclamations():
    assert texts('He said "stop." Then he ran! Why? "Because."') == [
        'He said "stop."',
        "Then he ran!",
        "Why?",
        '"Because."',
    ]


def test_unicode_and_scripts_without_case():
    assert texts("Ça va? Très bien… ok. 中文句子。第二句！Über alles.") == [
        "Ça va?",
        "Très bien… ok.",
        "中文句子。",
        "第二句！",
        "Über alles.",
    ]
    assert texts("Très bien… Ok.") == ["Très bien…", "Ok."]


def test_original_text_of_every_segment_is_recoverable():
    source = "# Title\n\nOne *bold* [link](http://x).  Two\nlines here.\n\n- item one. Item two\n"
    plan = plan_text(source)
    assert [source[s.start : s.end] for s in plan.segments] == [
        "Title",
        "One *bold* [link](http://x).",
        "Two\nlines here.",
        "item one.",
        "Item two",
    ]
    assert [s.text for s in plan.segments] == [
        "Title",
        "One bold link.",
        "Two lines here.",
        "item one.",
        "Item two",
    ]


def test_paragraphs_chapters_and_pauses():
    source = "Preface line.\n\n# Chapter One\n\nFirst. Second.\n\nThird.\n\nCHAPTER IV\n\nFourth.\n\nChapter 12: The End\nFifth."
    plan = plan_text(source)
    assert [c.title for c in plan.chapters] == ["", "Chapter One", "CHAPTER IV", "Chapter 12: The End"]
    by_text = {s.text: s for s in plan.segments}
    assert by_text["Preface line."].pause_after is Pause.CHAPTER
    assert by_text["Chapter One"].heading and by_text["Chapter One"].pause_after is Pause.PARAGRAPH
    assert by_text["First."].pause_after is Pause.SENTENCE
    assert by_text["Second."].pause_after is Pause.PARAGRAPH
    assert by_text["Third."].pause_after is Pause.CHAPTER
    assert by_text["Fifth."].pause_after is Pause.END
    assert [s.chapter for s in plan.segments] == [0, 1, 1, 1, 1, 2, 2, 3, 3]
    assert plan.segments[-1].paragraph > plan.segments[0].paragraph
    assert [c.first_segment for c in plan.chapters] == [0, 1, 5, 7]


@pytest.mark.parametrize("markdown", [False, True])
def test_chapter_lines_start_a_paragraph_and_carry_a_number(markdown):
    wrapped = (
        "It was long before he understood that the greater\n"
        "part of the reason she had left was his own silence, and\n"
        "book of hours lay closed on the table.\n\n"
        "Part of me wanted to stay.\n\nBook lovers know."
    )
    plan = plan_text(wrapped, markdown=markdown)
    assert [c.title for c in plan.chapters] == [""]
    assert texts(wrapped, markdown=markdown)[0].startswith("It was long") and len(plan.segments) == 3
    headings = (
        "CHAPTER I.\nDown the Rabbit-Hole\n\nChapter the Last\n\nBOOK TWENTY-ONE\n\nPart Two: Sea\n\nEnd."
    )
    assert [c.title for c in plan_text(headings, markdown=markdown).chapters] == [
        "CHAPTER I.", "Chapter the Last", "BOOK TWENTY-ONE", "Part Two: Sea"
    ]  # fmt: skip


def test_underscores_inside_a_word_are_not_emphasis():
    assert texts("Open my_file_name now. Use _this_ and __that__.") == ["Open my_file_name now.", "Use this and that."]
    said = plan_text("Use _this_, not snake_case.").segments[0].say
    assert said == "Use \ue000this\ue001, not snake_case."  # stressed where eSpeak NG can


def test_markdown_drops_html_tags_not_comparisons():
    assert texts("If a < b and c > d, then stop. A <b>bold</b> <!-- note --> <br/>move.") == [
        "If a < b and c > d, then stop.",
        "A bold move.",
    ]


def test_a_wrapped_line_starting_with_a_number_is_prose_but_lists_stay_lists():
    assert texts("He was\n42. His wife was younger.") == ["He was 42.", "His wife was younger."]
    assert texts("Intro:\n1. First item.\n2. Second item.\n\n3. Third.\n- Dash.") == [
        "Intro:", "First item.", "Second item.", "Third.", "Dash."
    ]  # fmt: skip


def test_plain_text_keeps_markup_characters():
    plan = plan_text("# not a heading in plain text. *Stars* stay.", markdown=False)
    assert [s.text for s in plan.segments] == ["# not a heading in plain text.", "*Stars* stay."]


def test_code_blocks_and_rules_are_not_narrated():
    plan = plan_text("Before.\n\n```\nprint('x')\n```\n\n---\n\nAfter.")
    assert [s.text for s in plan.segments] == ["Before.", "After."]


@pytest.mark.parametrize(("max_chars", "clauses_fit"), [(40, False), (80, True), (120, True)])
def test_over_long_sentences_split_at_clause_boundaries(max_chars, clauses_fit):
    sentence = (
        "This sentence goes on and on; it has clauses, many of them, and more words — more than anyone "
        "would like, because it was written to test the splitter: with commas, semicolons and colons until it ends."
    )
    plan = plan_text(sentence, max_chars=max_chars)
    pieces = [sentence[s.start : s.end] for s in plan.segments]
    assert len(pieces) > 1
    assert all(len(p) <= max_chars for p in pieces)
    assert " ".join(pieces) == sentence  # nothing lost, nothing repeated
    if clauses_fit:  # else some clause is longer than the limit and is cut between words
        assert all(p[-1] in ",;:—." for p in pieces), pieces


def test_unbreakable_run_is_cut_at_the_limit():
    url = "https://example.com/" + "a" * 150
    plan = plan_text(url, max_chars=50)
    assert "".join(s.text for s in plan.segments) == url
    assert all(len(s.text) <= 50 for s in plan.segments)


def test_empty_and_markup_only_texts_have_no_segments():
    assert plan_text("   \n\n  ").segments == []
    assert plan_text("```\ncode\n```").segments == []


def test_plan_round_trips_through_json():
    plan = plan_text("# A\n\nOne. Two.\n\n# B\n\nThree.")
    again = Plan.from_json(plan.to_json())
    assert again.segments == plan.segments and again.chapters == plan.chapters


def test_segmentation_is_linear_enough_for_a_book():
    import time

    book = (
        "It was late. Dr. Reed said so, e.g. twice; nobody listened... The end came at 3.14 a.m.\n\n"
    ) * 5000
    start = time.perf_counter()
    plan = plan_text(book)
    assert len(plan.segments) == 15000
    assert time.perf_counter() - start < 20  # a generous bound: pysbd took ~100 s for a third of this


def test_an_initialism_before_a_capital_stays_in_its_sentence():
    texts = [s.text for s in plan_text("The U.S. Navy sailed. The U.K. Parliament sat. See the E.U. Then go home.").segments]
    assert texts == ["The U.S. Navy sailed.", "The U.K. Parliament sat.", "See the E.U. Then go home."]


def test_pause_markup_and_scene_breaks():
    from jobs.errors import InvalidRequest

    plan = plan_text("Hello there. [PAUSE 1.5 s] Go.\n\n~ ~ ~\n\nOn. [pause 300ms]", markdown=False)
    assert [(s.text, s.pause_after.value, s.pause_ms) for s in plan.segments] == [
        ("Hello there.", "sentence", 1500),
        ("Go.", "scene", -1),  # a plain-text scene line too
        ("On.", "end", 300),
    ]
    assert all("[" not in s.text for s in plan.segments)  # markup is never spoken
    with pytest.raises(InvalidRequest, match="longer than 60 s"):
        plan_text("Hi. [pause 61s]")
    with pytest.raises(InvalidRequest, match="comes before any text"):
        plan_text("[pause 1s] Hi.")
    # not markup: left as text
    assert [s.text for s in plan_text("See [pause] and [pause two s].").segments] == ["See [pause] and [pause two s]."]


@pytest.mark.parametrize(("text", "sentences"), CASES, ids=[t[:30] for t, _ in CASES])
def test_the_hard_case_corpus(text, sentences):
    assert [text[s.start : s.end] for s in plan_text(text, markdown=False).segments] == sentences


def test_long_sentences_split_balanced_outside_brackets_without_tiny_tails():
    text = (
        "The committee, which had met for hours in the cold hall, finally agreed (after a long and bitter "
        "argument about money, time and people) that the bridge would be built, and the town cheered."
    )
    pieces = [text[s.start : s.end] for s in plan_text(text, max_chars=100).segments]
    assert all(len(p) <= 100 for p in pieces) and " ".join(pieces) == text
    assert min(len(p) for p in pieces) >= 40  # balanced: no tiny tail
    for p in pieces:  # never inside the parentheses, never between the subject and its relative clause
        assert p.count("(") == p.count(")")
        assert not p.endswith("The committee,")
    # a tail that would be tiny under a greedy cut ("... and so on.") is balanced instead
    run_on = "word " * 24 + "and so on."
    lengths = [s.end - s.start for s in plan_text(run_on, max_chars=100).segments]
    assert len(lengths) == 2 and min(lengths) >= 30, lengths


def test_a_paragraph_long_unpunctuated_run_is_split_in_linear_time():
    import time

    def seconds(n: int) -> float:
        text = "word " * n
        started = time.perf_counter()
        plan = plan_text(text, max_chars=100)
        assert all(s.end - s.start <= 100 for s in plan.segments)
        return time.perf_counter() - started

    small, large = seconds(20_000), seconds(160_000)
    assert large < 8 * small * 3  # 8x the text: within 3x of 8x the time (no quadratic blow-up)


def test_markdown_emphasis_is_kept_for_voices_that_stress_words(tmp_path):
    from fleet.settings import Settings
    from jobs.segmentation import EMPHASIS_CLOSE, EMPHASIS_OPEN
    from jobs.service import JobRequest, tasks_for, validate
    from models import espeak

    assert (espeak._EMPHASIS_OPEN, espeak._EMPHASIS_CLOSE) == (EMPHASIS_OPEN, EMPHASIS_CLOSE)  # one mark
    settings = Settings(data_dir=tmp_path, models="tiny,espeak")
    text = "I said *no* today. __Never__ again."
    job, plan = validate(JobRequest(text=text, model="espeak"), settings)
    assert [s.text for s in plan.segments] == ["I said no today.", "Never again."]  # captions: as written
    assert [t.text for t in tasks_for(job, plan)] == [
        f"I said {EMPHASIS_OPEN}no{EMPHASIS_CLOSE} today.",
        f"{EMPHASIS_OPEN}Never{EMPHASIS_CLOSE} again.",
    ]
    job, plan = validate(JobRequest(text=text, model="tiny"), settings)
    assert [t.text for t in tasks_for(job, plan)] == ["I said no today.", "Never again."]  # a codec LM: no marks
