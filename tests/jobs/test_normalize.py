"""English text normalisation: what a codec LM is given for numbers, dates, money, units and
abbreviations, the map back to what was written, and who gets it (the family's switch, the job's)."""

from __future__ import annotations

import pytest

from fleet.settings import Settings
from jobs.normalize import cardinal, normalize, ordinal, year
from jobs.service import JobRequest, validate


@pytest.mark.parametrize(
    ("written", "said"),
    [
        ("It costs $4.99 today.", "It costs four dollars and ninety-nine cents today."),
        ("He paid £1,000.00 in cash.", "He paid one thousand pounds in cash."),
        ("A €1 coin and ¥500.", "A one euro coin and five hundred yen."),
        ("A $4.5 million ship.", "A four point five million dollars ship."),
        ("At 3:15 p.m. we met; at 7:00 we ate; at 9:05 we left.", "At three fifteen p m we met; at seven o'clock we ate; at nine oh five we left."),
        ("It rose 2.5% in 2026.", "It rose two point five percent in twenty twenty-six."),
        ("On 2026-12-01 it snowed.", "On December first, twenty twenty-six it snowed."),
        ("Born on December 1, 1990 in Leeds.", "Born on December first, nineteen ninety in Leeds."),
        ("The 21st runner ran 5 km in 21.5 minutes.", "The twenty-first runner ran five kilometres in twenty-one point five minutes."),
        ("In the 1990s, Dr. Smith and Mr. Jones met 3 times.", "In the nineteen nineties, Doctor Smith and Mister Jones met three times."),
        ("Since 1850, 1850 people came.", "Since eighteen fifty, one thousand eight hundred fifty people came."),
        ("Upgrade to v2.3.1 now.", "Upgrade to version two point three point one now."),
        ("It weighs 1 kg, or 2.2 lb, at 20 °C.", "It weighs one kilogram, or two point two pounds, at twenty degrees Celsius."),
        ("Tom & Jerry, e.g. cartoons, etc.", "Tom and Jerry, for example cartoons, et cetera."),
        ("We left at 5 p.m.", "We left at five p m."),
        ("Meet at 5pm or 4:30PM, not 11 AM.", "Meet at five p m or four thirty p m, not eleven a m."),
        ("Save it as MP3, drink H2O, do 3x more.", "Save it as MP three, drink H two O, do three x more."),
        ("No. I won't be No. 5 on Main St.", "No. I won't be number five on Main Street."),
        ("St. Paul's is on Main St., in the '80s and 90s.", "Saint Paul's is on Main Street, in the eighties and nineties."),
        ("It was -5 °C, a -12% drop, -0.5 more; pages 5-7.", "It was minus five degrees Celsius, a minus twelve percent drop, minus zero point five more; pages five-seven."),
        ("No numbers here.", "No numbers here."),
    ],
)
def test_english(written, said):
    assert normalize(written, "eng")[0] == said


def test_numbers_ordinals_and_years():
    assert [cardinal(n) for n in (0, 13, 40, 101, 1001, 12345, 3_000_000_042)] == [
        "zero", "thirteen", "forty", "one hundred one", "one thousand one",
        "twelve thousand three hundred forty-five", "three billion forty-two",
    ]  # fmt: skip
    assert [ordinal(n) for n in (1, 2, 3, 5, 12, 20, 21, 42, 100)] == [
        "first", "second", "third", "fifth", "twelfth", "twentieth", "twenty-first", "forty-second", "one hundredth",
    ]  # fmt: skip
    assert [year(n) for n in (1066, 1900, 1905, 2000, 2001, 2010, 2026)] == [
        "ten sixty-six", "nineteen hundred", "nineteen oh five", "two thousand", "two thousand one", "twenty ten",
        "twenty twenty-six",
    ]  # fmt: skip


def test_the_map_leads_back_to_what_was_written():
    written = "Pay $5 by 2026-01-02, not 7%."
    said, spans = normalize(written)
    assert said == "Pay five dollars by January second, twenty twenty-six, not seven percent."
    assert [(said[a:b], written[c:d]) for a, b, c, d in spans] == [
        ("five dollars", "$5"),
        ("January second, twenty twenty-six", "2026-01-02"),
        ("seven percent", "7%"),
    ]


def test_other_languages_are_left_as_written():
    assert normalize("Es kostet 5 Euro.", "deu") == ("Es kostet 5 Euro.", [])


def test_codec_models_get_it_espeak_does_not_and_a_job_can_say_otherwise(tmp_path):
    settings = Settings(data_dir=tmp_path, models="tiny,espeak")
    _, tiny = validate(JobRequest(text="It costs $5."), settings)
    _, espeak = validate(JobRequest(text="It costs $5.", model="espeak"), settings)
    _, off = validate(JobRequest(text="It costs $5.", normalize_text=False), settings)
    _, german = validate(JobRequest(text="Es kostet 5 Euro.", language="deu"), settings)
    (a,), (b,), (c,), (d,) = tiny.segments, espeak.segments, off.segments, german.segments
    assert (a.text, a.spoken_text, tiny.normalized) == ("It costs $5.", "It costs five dollars.", "eng")
    assert (b.spoken_text, espeak.normalized) == ("It costs $5.", "")  # eSpeak NG reads numbers itself
    assert c.spoken_text == "It costs $5." and d.spoken_text == "Es kostet 5 Euro."
    assert a.say_map == [[9, 21, 9, 11]]
