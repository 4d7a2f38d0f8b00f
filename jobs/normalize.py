"""Text normalisation for models that read digits and symbols badly (codec LMs; eSpeak does its own).

``normalize(text, language)`` writes numbers, ordinals, years, currencies, percentages, times,
dates, units and common abbreviations as words, and returns, with the spoken text, a map from
each rewritten piece back to the span of the text it came from (``[spoken_start, spoken_end,
text_start, text_end]``), so timestamps and captions can quote what was written. One pass, one
alternation of rules, in order of precedence: linear in the text.

Languages: English ("eng", and "" when a job names none). Others are left as written (the plan says
which language was normalised); the rules are per language so another is one table more.
Written by hand: num2words, the usual library, is LGPL.
"""

from __future__ import annotations

import re
from collections.abc import Callable

SUPPORTED = ("eng",)

_ONES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen"]
_TENS = ["_", "_", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]
_SCALES = [(10**12, "trillion"), (10**9, "billion"), (10**6, "million"), (1000, "thousand")]
_ORDINAL_WORDS = {
    "one": "first", "two": "second", "three": "third", "five": "fifth", "eight": "eighth", "nine": "ninth",
    "twelve": "twelfth",
}  # fmt: skip
_MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October", "November", "December"]
_UNITS = {
    "km": ("kilometre", "kilometres"), "m": ("metre", "metres"), "cm": ("centimetre", "centimetres"),
    "mm": ("millimetre", "millimetres"), "kg": ("kilogram", "kilograms"), "g": ("gram", "grams"),
    "mg": ("milligram", "milligrams"), "l": ("litre", "litres"), "ml": ("millilitre", "millilitres"),
    "mph": ("mile per hour", "miles per hour"), "km/h": ("kilometre per hour", "kilometres per hour"),
    "ft": ("foot", "feet"), "lb": ("pound", "pounds"), "lbs": ("pound", "pounds"), "oz": ("ounce", "ounces"),
    "°C": ("degree Celsius", "degrees Celsius"), "°F": ("degree Fahrenheit", "degrees Fahrenheit"),
    "GB": ("gigabyte", "gigabytes"), "MB": ("megabyte", "megabytes"), "kHz": ("kilohertz", "kilohertz"),
    "Hz": ("hertz", "hertz"), "ms": ("millisecond", "milliseconds"),
}  # fmt: skip
_CURRENCIES = {"$": ("dollar", "dollars", "cent", "cents"), "£": ("pound", "pounds", "penny", "pence"),
               "€": ("euro", "euros", "cent", "cents"), "¥": ("yen", "yen", "", "")}  # fmt: skip
_ABBREVIATIONS = {
    "Dr.": "Doctor", "Mr.": "Mister", "Mrs.": "Missus", "Ms.": "Miz", "Prof.": "Professor", "St.": "Saint",
    "e.g.": "for example", "i.e.": "that is", "etc.": "et cetera", "vs.": "versus", "approx.": "approximately",
    "Jr.": "Junior", "Sr.": "Senior",
}  # fmt: skip


def cardinal(n: int) -> str:
    """1234 -> "one thousand two hundred thirty-four" (beyond trillions: digit by digit)."""
    if n < 0:
        return "minus " + cardinal(-n)
    if n >= 10**15:
        return " ".join(_ONES[int(d)] for d in str(n))
    if n < 20:
        return _ONES[n]
    if n < 100:
        tens, ones = divmod(n, 10)
        return _TENS[tens] + (f"-{_ONES[ones]}" if ones else "")
    if n < 1000:
        hundreds, rest = divmod(n, 100)
        return f"{_ONES[hundreds]} hundred" + (f" {cardinal(rest)}" if rest else "")
    for scale, word in _SCALES:
        if n >= scale:
            high, rest = divmod(n, scale)
            return f"{cardinal(high)} {word}" + (f" {cardinal(rest)}" if rest else "")
    raise AssertionError(n)


def ordinal(n: int) -> str:
    """21 -> "twenty-first"."""
    words = cardinal(n)
    head, sep, last = words.rpartition("-") if "-" in words.split(" ")[-1] else words.rpartition(" ")
    if last in _ORDINAL_WORDS:
        last = _ORDINAL_WORDS[last]
    elif last.endswith("y"):
        last = last[:-1] + "ieth"
    else:
        last += "th"
    return f"{head}{sep}{last}"


def year(n: int) -> str:
    """1990 -> "nineteen ninety", 2001 -> "two thousand one", 2026 -> "twenty twenty-six"."""
    high, low = divmod(n, 100)
    if 2000 <= n < 2010 or low == 0 and high % 10 == 0:
        return cardinal(n)
    if low == 0:
        return f"{cardinal(high)} hundred"
    return f"{cardinal(high)} {'oh ' + cardinal(low) if low < 10 else cardinal(low)}"


def decimal(text: str) -> str:
    """"3.14" -> "three point one four"."""
    whole, _, frac = text.partition(".")
    return f"{cardinal(int(whole.replace(',', '') or 0))} point " + " ".join(_ONES[int(d)] for d in frac)


def _number(text: str) -> str:
    if text[:1] in _MINUS:
        return "minus " + _number(text[1:])
    return decimal(text) if "." in text else cardinal(int(text.replace(",", "")))


def _plural(text: str) -> bool:
    return text.lstrip(_MINUS).replace(",", "") not in ("1", "1.0")


# --- the English rules ---------------------------------------------------------------------------

_NUM = r"\d{1,3}(?:,\d{3})+|\d+"
_MINUS = "-\u2212"
#: A minus sign: before a digit, after a space or an opening bracket ("-5 °C"; not "1990-2000").
_SIGN = r"(?:(?<![\w.,\-\u2212])[-\u2212](?=\d))?"
#: Words after which a four-digit number is a year ("in 1990", "since 2001", "December 2026").
_YEAR_WORDS = ["in", "In", "since", "Since", "by", "from", "From", "until", "of", "circa"]


def _after(words: list[str]) -> str:
    """A look-behind for any of ``words`` and a space (Python's look-behinds are fixed-width: one each);
    also "December 1, " before a year."""
    days = [rf"(?<=\b{w} \d, )|(?<=\b{w} \d\d, )" for w in _MONTHS] if words and words[-1] == _MONTHS[-1] else []
    return "(?:" + "|".join([rf"(?<=\b{re.escape(w)} )" for w in words] + days) + ")"



def _currency(m: re.Match) -> str:
    one, many, sub_one, sub_many = _CURRENCIES[m["cur"]]
    whole, cents, scale = m["amount"], m["cents"], m["scale"]
    if scale:  # "$4.5 million": four point five million dollars
        return f"{_number(whole + ('.' + cents if cents else ''))} {scale} {many}"
    words = f"{cardinal(int(whole.replace(',', '')))} {one if whole == '1' else many}"
    if cents and int(cents) and sub_one:
        value = int(cents.ljust(2, "0"))
        words += f" and {cardinal(value)} {sub_one if value == 1 else sub_many}"
    return words


def _hour(m: re.Match) -> str:
    """"5pm", "11 a.m." """
    return cardinal(int(m["hour"])) + (" a m" if m["half"][0].lower() == "a" else " p m") + (_end(m) if m["half"].endswith(".") else "")


def _time(m: re.Match) -> str:
    hours, minutes, half = int(m["h"]), int(m["min"]), m["ampm"]
    said = cardinal(hours)
    said += " o'clock" if minutes == 0 and not half else f" oh {cardinal(minutes)}" if minutes < 10 and minutes else f" {cardinal(minutes)}" if minutes else ""
    if half:
        said += (" a m" if half[0].lower() == "a" else " p m") + (_end(m) if half.endswith(".") else "")
    return said


def _end(m: re.Match) -> str:
    """The sentence's full stop, where an abbreviation's dot was also the sentence's last."""
    return "." if m.end() == len(m.string) else ""


def _iso_date(m: re.Match) -> str:
    y, mo, d = int(m["y"]), int(m["mo"]), int(m["d"])
    if not (1 <= mo <= 12 and 1 <= d <= 31):
        return m.group(0)
    return f"{_MONTHS[mo - 1]} {ordinal(d)}, {year(y)}"


def _unit(m: re.Match) -> str:
    one, many = _UNITS[m["unit"]]
    return f"{_number(m['value'])} {many if _plural(m['value']) else one}"


_RULES: list[tuple[str, Callable[[re.Match], str]]] = [
    (r"(?P<y>\d{4})-(?P<mo>\d{2})-(?P<d>\d{2})\b", _iso_date),
    (
        r"(?P<cur>[$£€¥])\s?(?P<amount>" + _NUM + r")(?:\.(?P<cents>\d{1,2}))?(?:\s(?P<scale>thousand|million|billion|trillion)\b)?",
        _currency,
    ),
    (r"\b(?P<h>[01]?\d|2[0-3]):(?P<min>[0-5]\d)(?!\d)(?:\s?(?P<ampm>[aApP]\.?[mM]\.?)(?!\w))?", _time),
    (r"\b(?P<hour>1[0-2]|0?[1-9])\s?(?P<half>[aApP]\.?[mM]\.?)(?!\w)", _hour),
    (r"(?P<pct>" + _SIGN + r"\d+(?:\.\d+)?)\s?%", lambda m: f"{_number(m['pct'])} percent"),
    (r"\b(?P<ord>\d+)(?:st|nd|rd|th)\b", lambda m: ordinal(int(m["ord"]))),
    (r"\b(?P<decade>1[1-9]\d0|20\d0)s\b", lambda m: year(int(m["decade"])).rsplit(" ", 1)[0] + " " + _decade_word(int(m["decade"]))),
    (r"(?<![\w'])'?(?P<decade2>[1-9]0)s\b", lambda m: _decade_word(1900 + int(m["decade2"]))),  # the '80s
    (_after(_YEAR_WORDS + _MONTHS) + r"(?P<year>1[1-9]\d\d|20\d\d)\b(?![,.]\d)", lambda m: year(int(m["year"]))),
    (_after(_MONTHS) + r"(?P<day>[1-9]|[12]\d|3[01])\b(?![:.]\d)", lambda m: ordinal(int(m["day"]))),
    (
        r"(?P<value>" + _SIGN + r"\d+(?:\.\d+)?)\s?(?P<unit>km/h|°C|°F|" + "|".join(sorted((u for u in _UNITS if u[0] != "°" and u != "km/h"), key=len, reverse=True)) + r")(?![\w/])",
        _unit,
    ),
    (r"\bv(?P<ver>\d+(?:\.\d+)+)\b", lambda m: "version " + " point ".join(cardinal(int(p)) for p in m["ver"].split("."))),
    (r"(?P<dec>" + _SIGN + r"\d+\.\d+)", lambda m: _number(m["dec"])),
    (r"(?P<int>" + _SIGN + "(?:" + _NUM + r"))", lambda m: _number(m["int"])),
    (r"\bNo\.(?=\s?\d)", lambda m: "number"),
    # "Main St." is a street where a name is before it and no name after it; "St. Paul" a saint
    (r"(?P<street>\b[A-Z][a-z]+ )St\.(?=\s+[a-z]|\s*[,;:)]|\s*$)", lambda m: m["street"] + "Street" + _end(m)),
    ("(?P<abbr>" + "|".join(re.escape(a) for a in _ABBREVIATIONS) + r")(?=\s|$)", lambda m: _ABBREVIATIONS[m["abbr"]] + _end(m)),
    (r"(?<!\w)&(?!\w)", lambda m: "and"),
]


def _decade_word(n: int) -> str:
    tens = (n % 100) // 10
    if tens == 0:
        return "hundreds" if n % 1000 else "thousands"
    word = _TENS[tens] if tens >= 2 else "tens"
    return word[:-1] + "ies" if word.endswith("y") else word


_PATTERN = re.compile("|".join(f"(?P<r{i}>{pattern})" for i, (pattern, _) in enumerate(_RULES)))


def normalize(text: str, language: str = "eng") -> tuple[str, list[list[int]]]:
    """(what to say, the map of rewritten pieces: [said_start, said_end, text_start, text_end])."""
    if (language or "eng") not in SUPPORTED:
        return text, []
    out: list[str] = []
    spans: list[list[int]] = []
    pos = length = 0
    for m in _PATTERN.finditer(text):
        rule = next(int(k[1:]) for k, v in m.groupdict().items() if v is not None and k[0] == "r" and k[1:].isdigit())
        said = _RULES[rule][1](m)
        if said == m.group(0):
            continue
        # words, not glued to the letters around them ("MP3", "5pm", "H2O")
        if m.start() and text[m.start() - 1].isalpha() and said[:1].isalnum():
            said = " " + said
        if m.end() < len(text) and text[m.end()].isalpha() and said[-1:].isalnum():
            said += " "
        out.append(text[pos : m.start()])
        length += m.start() - pos
        spans.append([length, length + len(said), m.start(), m.end()])
        out.append(said)
        length += len(said)
        pos = m.end()
    out.append(text[pos:])
    return "".join(out), spans
