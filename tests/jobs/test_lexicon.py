"""Pronunciation lexicons: entries, their order, RE2's linear time, and a job's plan."""

from __future__ import annotations

import time

import pytest

from fleet.settings import Settings
from jobs.errors import InvalidRequest
from jobs.lexicon import Lexicon, entries_from
from jobs.service import JobRequest, tasks_for, validate


def test_words_are_whole_and_case_insensitive_regexes_are_re2_and_the_first_listed_wins():
    lexicon = Lexicon(
        entries_from(
            [
                {"match": "Nguyen", "say": "Win"},
                {"match": "SQL", "say": "sequel", "case_sensitive": True},
                {"regex": r"\bv(\d+)\.(\d+)\b", "say": "version"},
                {"match": "Dr. Who", "say": "Doctor Who"},
                {"match": "Dr.", "say": "Drive"},  # listed after "Dr. Who": that one wins where both match
            ]
        )
    )
    said = lexicon.apply("nguyen's Nguyenville: SQL, not sql; v1.2 on Dr. Who and Elm Dr.")
    assert said == "Win's Nguyenville: sequel, not sql; version on Doctor Who and Elm Drive"
    assert [e["applied"] for e in lexicon.report()] == [1, 1, 1, 1, 1]


def test_a_pathological_regex_runs_in_linear_time():
    lexicon = Lexicon(entries_from([{"regex": r"(a+)+$", "say": "x"}]))
    started = time.perf_counter()
    lexicon.apply("a" * 200_000 + "b")  # Python's re would backtrack for ever here
    assert time.perf_counter() - started < 5


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        ([{"say": "x"}], "give either match (a word or phrase) or regex"),
        ([{"match": "a", "regex": "b", "say": "x"}], "not both"),
        ([{"regex": "(unclosed", "say": "x"}], "is not valid RE2"),
        ([{"regex": "a*", "say": "x"}], "matches empty text"),
        ([{"regex": r"(a)\1", "say": "x"}], "is not valid RE2"),  # back-references: not linear, not RE2
        ([{"match": "x" * 201, "say": "y"}], "at most 200"),
        ([{"match": "a", "say": 5}], "say is the text to say"),
        ([{"match": "a", "say": "b", "colour": 1}], "an object with match or regex"),
        ([{"match": "a", "say": "b"}] * 1001, "at most 1,000"),
        ("not a list", "a list of entries"),
    ],
)
def test_bad_entries_are_refused_naming_the_entry(raw, says):
    with pytest.raises(InvalidRequest) as refused:
        entries_from(raw)
    assert says in str(refused.value)


def test_a_jobs_plan_says_the_replacement_and_keeps_the_written_text(tmp_path):
    settings = Settings(data_dir=tmp_path, models="tiny")
    request = JobRequest(
        text="Mr. Nguyen arrived. Nothing here.",
        lexicon=entries_from([{"match": "Nguyen", "say": "Win"}]),
        normalize_text=False,  # the lexicon alone here (tests/jobs/test_normalize.py: both)
    )
    job, plan = validate(request, settings)
    first, second = plan.segments
    assert (first.text, first.say, second.say) == ("Mr. Nguyen arrived.", "Mr. Win arrived.", "")
    assert [t.text for t in tasks_for(job, plan)] == ["Mr. Win arrived.", "Nothing here."]  # what the voice gets
    assert plan.lexicon == [{"say": "Win", "match": "Nguyen", "case_sensitive": False, "applied": 1}]
    with pytest.raises(InvalidRequest, match="with nothing to say"):
        validate(JobRequest(text="Nguyen.", lexicon=entries_from([{"regex": r"\w+\.?", "say": ""}])), settings)


def test_phoneme_entries_are_for_families_that_read_phonemes(tmp_path):
    settings = Settings(data_dir=tmp_path, models="tiny,espeak")
    entries = entries_from([{"match": "Nguyen", "phonemes": "w'In"}])
    _, plan = validate(JobRequest(text="Hello Nguyen. Not [[this]].", model="espeak", lexicon=entries), settings)
    assert [s.spoken_text for s in plan.segments] == ["Hello [[w'In]].", "Not [ [this]]."]  # only the lexicon's
    with pytest.raises(InvalidRequest, match="cannot read: give say"):
        validate(JobRequest(text="Hello Nguyen.", model="tiny", lexicon=entries), settings)
    for bad in ({"match": "a", "phonemes": "x[y"}, {"match": "a", "say": "b", "phonemes": "c"}):
        with pytest.raises(InvalidRequest):
            entries_from([bad])
