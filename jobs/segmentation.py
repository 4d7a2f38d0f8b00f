"""Long text -> a plan of segments (sentences), grouped into paragraphs and chapters.

Every segment keeps the span of the original text it came from (``original[start:end]``), so the
source of any piece of audio is recoverable; ``text`` is what is spoken (Markdown markup removed,
whitespace collapsed). Headings (Markdown ``#`` lines, "Chapter 3" / "CHAPTER IV" lines) start chapters
and are spoken as segments of their own. Pauses follow the structure: sentence < paragraph < chapter.

The sentence splitter is rule-based and linear in the text's length: a boundary is a run of
terminators (. ! ? … and CJK 。！？), optional closing quotes/brackets, whitespace, then something that
can start a sentence (an upper-case letter, a digit, an opening quote). Titles such as "Dr.",
initials such as "J. R. R." and initialisms such as "U.S." never end a sentence (so "...in the U.S.
Then" stays one: a merge nobody hears, where a break inside "U.S. Navy" they would); decimals and
"e.g. so" never reach the check. testing/segmentation_corpus.py holds the hard cases it is held to.

Sentences over ``max_chars`` are cut by bisection at the strongest clause break (; : then dashes,
commas, a space before "and"/"but", other commas, spaces) that keeps the pieces balanced, outside
brackets and quotes where possible, never leaving a tiny tail, and not after a subject whose comma
opens a relative clause ("The committee, which...") where another break exists.

Markup: ``[pause 2s]`` is an exact silence there (``Segment.pause_ms``); a rule line is a scene break.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from enum import StrEnum

from jobs.errors import InvalidRequest


class Pause(StrEnum):
    """The pause that follows a segment."""

    SENTENCE = "sentence"
    PARAGRAPH = "paragraph"
    SCENE = "scene"  # a scene break: a rule (***, * * *, ---) or an EPUB's <hr>
    CHAPTER = "chapter"
    END = "end"


@dataclass(frozen=True, slots=True)
class Segment:
    index: int
    text: str
    start: int
    end: int
    chapter: int
    paragraph: int
    heading: bool
    pause_after: Pause
    #: An explicit pause after it (``[pause 2s]`` markup), milliseconds, instead of ``pause_after``'s;
    #: -1: none.
    pause_ms: int = -1
    #: What the voice says, where a lexicon or the normaliser changed ``text`` (jobs/lexicon.py,
    #: jobs/normalize.py); "": ``text``.
    say: str = ""
    #: The normaliser's rewritten pieces: [say_start, say_end, text_start, text_end] each.
    say_map: list = field(default_factory=list)

    @property
    def spoken_text(self) -> str:
        return self.say or self.text


@dataclass(frozen=True, slots=True)
class Chapter:
    index: int
    title: str
    first_segment: int


@dataclass(slots=True)
class Plan:
    segments: list[Segment] = field(default_factory=list)
    chapters: list[Chapter] = field(default_factory=list)
    #: The job's lexicon entries and how often each was applied (jobs/lexicon.py).
    lexicon: list[dict] = field(default_factory=list)
    #: Segments taken from the segment cache, not rendered: index -> [object key, samples].
    reused: dict[int, list] = field(default_factory=dict)
    #: The language whose rules wrote numbers and symbols as words (jobs/normalize.py); "": none.
    normalized: str = ""
    #: Each segment's segment-cache key and the cache's scope (jobs/segcache.py); empty: no cache.
    cache_keys: list[str] = field(default_factory=list)
    cache_scope: str = ""

    def to_json(self) -> str:
        return json.dumps(
            {
                "segments": [asdict(s) for s in self.segments],
                "chapters": [asdict(c) for c in self.chapters],
                "lexicon": self.lexicon,
                "reused": {str(i): v for i, v in self.reused.items()},
                "normalized": self.normalized,
                "cache_keys": self.cache_keys,
                "cache_scope": self.cache_scope,
            },
            ensure_ascii=False,
            separators=(",", ":"),
        )

    @classmethod
    def from_json(cls, raw: str | bytes) -> Plan:
        data = json.loads(raw)
        segments = [Segment(**{**s, "pause_after": Pause(s["pause_after"])}) for s in data["segments"]]
        return cls(
            segments=segments,
            chapters=[Chapter(**c) for c in data["chapters"]],
            lexicon=data.get("lexicon", []),
            reused={int(i): v for i, v in data.get("reused", {}).items()},
            normalized=data.get("normalized", ""),
            cache_keys=data.get("cache_keys", []),
            cache_scope=data.get("cache_scope", ""),
        )


# --- blocks: paragraphs and headings ---------------------------------------------------------------

_MD_HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(?P<title>.+?)\s*#*\s*$")
_NUMBER_WORD = (
    "(?:one|two|three|four|five|six|seven|eight|nine|ten|eleven|twelve|thirteen|fourteen|fifteen|sixteen"
    "|seventeen|eighteen|nineteen|twenty|thirty|forty|fifty|sixty|seventy|eighty|ninety|hundred|first"
    "|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|thirteenth|fourteenth"
    "|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|twentieth|thirtieth|fortieth|fiftieth|last)"
)
#: A Roman numeral (not empty: the look-behind needs a numeral's letter just read).
_ROMAN = r"m{0,4}(?:cm|cd|d?c{0,3})(?:xc|xl|l?x{0,3})(?:ix|iv|v?i{0,3})(?<=[ivxlcdm])"
#: "Chapter 12", "CHAPTER IV.", "Part Two: ...", "Book the First": the word and a number (figures, a
#: Roman numeral or number words), at the start of a paragraph ("...the greater / part of the
#: reason" and "Part of me wanted to stay." are prose).
_CHAPTER_LINE = re.compile(
    rf"^\s*(?P<title>(?:chapter|part|book)\s+(?:\d+|{_ROMAN}|(?:the\s+)?{_NUMBER_WORD}(?:[- ]{_NUMBER_WORD})?)"
    r"\b[^\n]{0,80})\s*$",
    re.IGNORECASE,
)
_RULE = re.compile(r"^\s{0,3}([-*_])(\s*\1){2,}\s*$")  # --- *** ___ : a scene break
#: A scene break in plain text too: a line of one symbol, three times or more (* * *, ###, ~~~, • • •).
_SCENE_LINE = re.compile(r"^\s*([*#~•·⁂])(\s*\1){2,}\s*$|^\s*⁂\s*$")
#: Explicit pauses: [pause 2s], [pause 1.5 s], [pause 300ms]; at most MAX_PAUSE_MS each.
_PAUSE_MARK = re.compile(r"\[\s*pause\s+(\d{1,3}(?:\.\d{1,3})?)\s*(ms|s)\s*\]", re.IGNORECASE)
MAX_PAUSE_MS = 60_000
_FENCE = re.compile(r"^\s{0,3}(```|~~~)")
_LIST_ITEM = re.compile(r"^\s{0,3}(?:[-*+]|(?P<number>\d{1,3})[.)])\s+")


def _list_item(line: str, interrupts: bool) -> re.Match | None:
    """A list item's marker. Where it would interrupt a paragraph, a numbered list must start at 1,
    as in CommonMark (a wrapped line "42. His wife..." is prose, and its number is said)."""
    match = _LIST_ITEM.match(line)
    if match and interrupts and match["number"] not in (None, "1"):
        return None
    return match


@dataclass(slots=True)
class Block:
    """A paragraph or a heading: the span ``text[start:end]`` of the text it is planned from."""

    start: int
    end: int
    heading: bool
    #: A scene break (no text): the segment before it ends with a scene pause.
    scene: bool = False
    #: A paragraph that starts a chapter with no title to say (a book's untitled chapter).
    chapter: bool = False


def _lines(text: str):
    """Yield (start, end) of each line, end excluding the newline."""
    pos = 0
    for match in re.finditer(r"\r\n|\n|\r", text):
        yield pos, match.start()
        pos = match.end()
    yield pos, len(text)


def _blocks(text: str, markdown: bool) -> list[Block]:
    blocks: list[Block] = []
    current: Block | None = None
    in_fence = False
    in_list = False  # current is a list item: the next item, whatever its number, is one too

    def close() -> None:
        nonlocal current
        if current is not None:
            blocks.append(current)
            current = None

    for start, end in _lines(text):
        line = text[start:end]
        if markdown and _FENCE.match(line):
            in_fence = not in_fence  # code is not narrated
            close()
            continue
        if in_fence:
            continue
        if _SCENE_LINE.match(line) or (markdown and _RULE.match(line)):
            close()
            blocks.append(Block(start, start, heading=False, scene=True))
            continue
        if not line.strip():
            close()
            continue
        heading = _heading_span(text, start, end, markdown, starts_block=current is None)
        if heading is not None:
            close()
            blocks.append(Block(heading[0], heading[1], heading=True))
            continue
        if markdown and (item := _list_item(line, interrupts=current is not None and not in_list)):
            close()  # each list item reads as its own paragraph
            current, in_list = Block(start + item.end(), end, heading=False), True
            continue
        if current is None:
            current, in_list = Block(start, end, heading=False), False
        else:
            current.end = end
    close()
    return blocks


#: Longer lines are never headings (and the heading patterns never scan a huge line).
_MAX_HEADING_LINE = 300


def _heading_span(
    text: str, start: int, end: int, markdown: bool, starts_block: bool
) -> tuple[int, int] | None:
    """A heading's title span: a Markdown heading anywhere (as in CommonMark), a chapter line only
    where a paragraph would start (a wrapped line of prose may begin with "part" or "book")."""
    if end - start > _MAX_HEADING_LINE:
        return None
    line = text[start:end]
    match = (_MD_HEADING.match(line) if markdown else None) or (_CHAPTER_LINE.match(line) if starts_block else None)
    if match is None:
        return None
    return start + match.start("title"), start + match.end("title")


# --- sentences ------------------------------------------------------------------------------------

#: Abbreviations that are (nearly) never the end of a sentence, lower-case, without the final dot.
_NON_FINAL_ABBREVIATIONS = frozenset(
    [
        "mr",
        "mrs",
        "ms",
        "mx",
        "dr",
        "prof",
        "sr",
        "jr",
        "st",
        "mt",
        "ft",
        "capt",
        "col",
        "gen",
        "lt",
        "sgt",
        "cpl",
        "maj",
        "adm",
        "gov",
        "sen",
        "rep",
        "rev",
        "hon",
        "pres",
        "fr",
        "msgr",
        "sra",
        "srta",
        "mme",
        "mlle",
        "messrs",
        "e.g",
        "i.e",
        "cf",
        "viz",
        "vs",
        "v",
        "approx",
        "ca",
        "fig",
        "figs",
        "no",
        "nos",
        "vol",
        "vols",
        "pp",
        "p",
        "ch",
        "sec",
        "art",
        "dept",
        "est",
        "jan",
        "feb",
        "mar",
        "apr",
        "jun",
        "jul",
        "aug",
        "sep",
        "sept",
        "oct",
        "nov",
        "dec",
    ]
)
_TERMINATOR = re.compile(r"[.!?…。！？]+[\"'”’)\]»›]*")
_CJK_FINAL = frozenset("。！？")
_OPENERS = "\"'“‘([«‹¿¡*_"  # may precede a sentence's first letter


def _is_boundary(text: str, term: re.Match[str], para_end: int) -> tuple[bool, int]:
    """Whether the terminator ends a sentence; also where the next sentence starts."""
    end = term.end()
    if term.group()[-1] in _CJK_FINAL or term.group()[0] in _CJK_FINAL:
        nxt = end
        while nxt < para_end and text[nxt].isspace():
            nxt += 1
        return True, nxt
    nxt = end
    while nxt < para_end and text[nxt].isspace():
        nxt += 1
    if nxt >= para_end:
        return True, para_end
    if nxt == end:  # no whitespace after: 3.50, U.S.A., "e.g.,"
        return False, nxt
    head = nxt
    while head < para_end and text[head] in _OPENERS:
        head += 1
    if head >= para_end or not _can_start_sentence(text[head]):
        return False, nxt
    if term.group() == "." and _word_before(text, term.start()) in _NON_FINAL_ABBREVIATIONS:
        return False, nxt
    if term.group() == "." and len(_word_before(text, term.start())) == 1 and _starts_word(text, term.start() - 1):
        return False, nxt  # an initial: J. R. R. Tolkien (not the end of "?c=d.")
    if term.group() == "." and _INITIALISM.fullmatch(_word_before(text, term.start())):
        # "the U.S. Navy", "U.K. Parliament": one sentence. "...in the U.S. Then" merges two, which a
        # listener does not notice; a break inside a name they do.
        return False, nxt
    return True, nxt


_INITIALISM = re.compile(r"(?:[^\W\d_]\.)+[^\W\d_]")  # u.s, u.s.a, e.u (the last dot is the terminator)


def _starts_word(text: str, pos: int) -> bool:
    """Whether text[pos] begins a word (after whitespace, an opening mark, or the text's start)."""
    return pos == 0 or text[pos - 1].isspace() or text[pos - 1] in _OPENERS


def _can_start_sentence(char: str) -> bool:
    # upper case, a digit, or a letter of a script without case (CJK, Arabic, ...)
    return char.isupper() or char.isdigit() or (char.isalpha() and not char.islower())


#: The longest word ``_word_before`` looks at (abbreviations are short; "a.a.a.a..." stays linear).
_WORD_LOOKBACK = 24


def _word_before(text: str, pos: int) -> str:
    start = pos
    floor = max(pos - _WORD_LOOKBACK, 0)
    while start > floor and (text[start - 1].isalpha() or text[start - 1] == "."):
        start -= 1
    return text[start:pos].lower()


def _sentences(text: str, start: int, end: int) -> list[tuple[int, int]]:
    """Spans of the sentences of the paragraph text[start:end], whitespace trimmed."""
    spans: list[tuple[int, int]] = []
    sent_start = start
    for term in _TERMINATOR.finditer(text, start, end):
        boundary, nxt = _is_boundary(text, term, end)
        if boundary:
            spans.append((sent_start, term.end()))
            sent_start = nxt
    if sent_start < end:
        spans.append((sent_start, end))
    return [s for s in (_trim(text, a, b) for a, b in spans) if s[1] > s[0]]


def _trim(text: str, start: int, end: int) -> tuple[int, int]:
    while start < end and text[start].isspace():
        start += 1
    while end > start and text[end - 1].isspace():
        end -= 1
    return start, end


# --- over-long sentences --------------------------------------------------------------------------

#: Clause breaks, strongest first: where a long sentence may be cut (the cut is after the match).
#: A comma that opens a relative clause ("the committee, which had met") cuts a subject from its
#: parenthetical: weaker than other commas, and a space before "and"/"but" is stronger than a
#: bare space.
_CLAUSE_BREAKS = (
    re.compile(r"[;:]\s+"),
    re.compile(r"\s+[—–]\s*|—"),
    re.compile(r",\s+(?!(?:which|who|whom|whose|where|when|although|though)\b)", re.IGNORECASE),
    re.compile(r"\s+(?=(?:and|but|or|nor|yet|so|because|while|whereas)\s)", re.IGNORECASE),
    re.compile(r",\s+"),
    re.compile(r"\s+"),
)
_OPEN = "([{«“‘"
_CLOSE = ")]}»”’"
#: A piece shorter than this is a "tiny tail": cuts that leave one are avoided where others exist.
MIN_PIECE_CHARS = 12
#: Balanced splitting looks at stretches of at most this many pieces at once (linear on any text).
_STRETCH_PIECES = 8


def _split_long(text: str, start: int, end: int, max_chars: int) -> list[tuple[int, int]]:
    """Cut text[start:end] into pieces of at most ``max_chars``, each cut at the strongest clause
    break that keeps the pieces balanced (as equal as the breaks allow, no tiny tails), outside
    brackets and quotes where a break outside them exists.

    Linear: a very long run is first cut greedily into stretches of a few pieces' length (each cut
    looks only at the next stretch), and each stretch is then split by bisection."""
    if end - start <= max_chars:
        return [(start, end)]
    pieces: list[tuple[int, int]] = []
    stretch = max_chars * _STRETCH_PIECES
    while end - start > stretch:  # a paragraph-long "sentence": stretches first
        cut = _best_cut(text, start, min(end, start + stretch), _STRETCH_PIECES // 2, _STRETCH_PIECES, max_chars, greedy=True)
        cut = cut or start + max_chars
        pieces.extend(_bisect(text, start, cut, max_chars))
        start, end = _trim(text, cut, end)
    pieces.extend(_bisect(text, start, end, max_chars))
    return [p for p in pieces if p[1] > p[0]]


def _bisect(text: str, start: int, end: int, max_chars: int) -> list[tuple[int, int]]:
    start, end = _trim(text, start, end)
    length = end - start
    if length <= max_chars:
        return [(start, end)]
    fewest = -(-length // max_chars)  # pieces needed at least; one or two more if breaks are few
    cut = None
    for outside in (True, False):  # a piece more, before a cut inside brackets or quotes
        for n in range(fewest, fewest + 3):
            if (cut := _best_cut(text, start, end, n // 2, n - n // 2, max_chars, outside=outside)) is not None:
                break
        if cut is not None:
            break
    if cut is None:  # one unbroken run of characters (a URL, say): cut at the limit
        cut = start + max_chars
    return _bisect(text, start, cut, max_chars) + _bisect(text, cut, end, max_chars)


def _best_cut(
    text: str,
    start: int,
    end: int,
    left: int,
    right: int,
    max_chars: int,
    greedy: bool = False,
    outside: bool | None = None,
) -> int | None:
    """Where to cut text[start:end] into ``left`` then ``right`` pieces' worth: the strongest break
    whose sides fit their pieces (and are no tiny tails), outside brackets and quotes if possible,
    nearest the balanced point (``greedy``: the latest whose left side fits; ``outside``: only
    outside brackets and quotes (True), anywhere (False), outside first (None)). None: no break fits."""
    length = end - start
    target = start + length * left // (left + right)
    depth = _nesting(text, start, end)
    for outside_only in (True, False) if outside is None else (outside,):
        for pattern in _CLAUSE_BREAKS:
            fits = []
            for m in pattern.finditer(text, start, end):
                cut = m.end()
                if not start < m.start() or cut >= end:
                    continue
                if outside_only and depth[m.start() - start]:
                    continue
                a, b = cut - start, end - cut
                if a > left * max_chars or (not greedy and b > right * max_chars):
                    continue
                if min(a, b) < min(MIN_PIECE_CHARS, max_chars // 4):
                    continue
                fits.append(cut)
            if fits:
                return fits[-1] if greedy else min(fits, key=lambda c: abs(c - target))
    return None


def _nesting(text: str, start: int, end: int) -> bytearray:
    """For each character of text[start:end]: inside brackets or quotes (1) or not (0). Straight
    double quotes toggle; an apostrophe is never a quote."""
    out = bytearray(end - start)
    level, quoted = 0, False
    for i in range(start, end):
        ch = text[i]
        if ch in _OPEN:
            level += 1
        elif ch in _CLOSE:
            level = max(level - 1, 0)
        elif ch == '"':
            quoted = not quoted
        out[i - start] = 1 if (level or quoted) else 0
    return out


# --- spoken text ----------------------------------------------------------------------------------

_MD_INLINE = [
    (re.compile(r"!\[([^\]]*)\]\([^)]*\)"), r"\1"),  # images -> alt text
    (re.compile(r"\[([^\]]+)\]\([^)]*\)"), r"\1"),  # links -> their text
    # inline HTML: tags and comments only ("if a < b and c > d" is prose)
    (re.compile(r"</?[A-Za-z][A-Za-z0-9-]*(?:\s[^<>\n]*)?/?>|<!--.*?-->"), ""),
    (re.compile(r"(?m)^\s{0,3}>\s?"), ""),  # block quotes
    (re.compile(r"(\*\*|\*|~~|`+)(?=\S)(.+?)(?<=\S)\1"), r"\2"),  # emphasis, code
]
#: Emphasis with underscores, as in CommonMark: not inside a word ("my_file_name" keeps them).
_MD_UNDERSCORES = re.compile(r"(?<![^\W_])(__|_)(?=\S)(.+?)(?<=\S)\1(?![^\W_])")
_MD_INLINE.append((_MD_UNDERSCORES, r"\2"))
#: Emphasis in what is said, for voices that can stress it (eSpeak NG, via SSML): Markdown's
#: *...*, _..._, **...**, __...__ become these marks around the words (private-use characters, never
#: in a text as written: models that cannot stress words get them removed, see ``plain``).
EMPHASIS_OPEN, EMPHASIS_CLOSE = "\ue000", "\ue001"
_MD_EMPHASIS = [re.compile(r"(\*\*|\*)(?=\S)(.+?)(?<=\S)\1"), _MD_UNDERSCORES]


def plain(said: str) -> str:
    """What is said without its emphasis marks."""
    return said.replace(EMPHASIS_OPEN, "").replace(EMPHASIS_CLOSE, "") if EMPHASIS_OPEN in said else said


#: Characters nobody can hear: C0/C1 controls but whitespace, zero-width and direction marks, the BOM,
#: surrogates. They are dropped from what is spoken (the original text keeps them).
_INVISIBLE = re.compile(
    "[\x00-\x08\x0e-\x1f\x7f-\x9f\u200b-\u200f\u202a-\u202e\u2060-\u2064\ufeff\ud800-\udfff]"
)
#: Something to say: a letter or a digit of any script.
_SPEAKABLE = re.compile(r"[^\W_]")


def spoken(text: str, markdown: bool = True, emphasis: bool = False) -> str:
    """What is said of ``text``: Markdown markup and invisible characters out, whitespace collapsed;
    empty if nothing in it can be said (only punctuation, say). ``emphasis``: Markdown emphasis as
    EMPHASIS_OPEN/CLOSE marks around its words."""
    if markdown:
        if emphasis:
            for pattern in _MD_EMPHASIS:
                text = pattern.sub(lambda m: f"{EMPHASIS_OPEN}{m[2]}{EMPHASIS_CLOSE}", text)
        for pattern, repl in _MD_INLINE:
            text = pattern.sub(repl, text)
    text = " ".join(_INVISIBLE.sub("", text).split())
    return text if _SPEAKABLE.search(text) else ""


# --- the plan -------------------------------------------------------------------------------------


def plan_text(text: str, *, markdown: bool = True, max_chars: int = 300) -> Plan:
    """Segment ``text`` into sentences grouped into paragraphs and chapters."""
    return plan_blocks(text, _blocks(text, markdown), markdown=markdown, max_chars=max_chars)


def plan_blocks(text: str, blocks: list[Block], *, markdown: bool = False, max_chars: int = 300) -> Plan:
    """Segment ``text`` whose paragraphs and headings are known (a book's structure, jobs/books.py):
    every heading block starts a chapter titled by it, every scene block ends a scene."""
    if max_chars < 20:
        raise ValueError("max_chars must be at least 20")
    plan = Plan()
    paragraph = -1
    for block in blocks:
        if block.scene:
            _end_previous(plan, Pause.SCENE)
            continue
        parts = _split_at_pauses(text, block.start, block.end)
        if block.heading:
            title = spoken(" ".join(text[a:b] for a, b, _ in parts), markdown)
            if not title:
                continue
            _end_previous(plan, Pause.CHAPTER)
            paragraph += 1
            plan.chapters.append(Chapter(len(plan.chapters), title, len(plan.segments)))
            pieces = [pair for a, b, ms in parts for pair in _with_last(_split_long(text, a, b, max_chars), ms)]
        else:
            pieces = [
                pair
                for a, b, ms in parts
                for pair in _with_last(
                    [q for s in _sentences(text, a, b) for q in _split_long(text, *s, max_chars)], ms
                )
            ]
            # nothing to say in a piece: its pause, if any, still follows what was said before
            pieces = [(p if p is None or spoken(text[p[0] : p[1]], markdown) else None, ms) for p, ms in pieces]
            pieces = [(p, ms) for p, ms in pieces if p is not None or ms]
            if not any(p is not None for p, _ in pieces):
                _add_pauses(plan, [ms for _, ms in pieces if ms])
                continue
            if not plan.chapters or block.chapter:  # before the first heading, or untitled: no title said
                _end_previous(plan, Pause.CHAPTER)
                plan.chapters.append(Chapter(len(plan.chapters), "", len(plan.segments)))
            _end_previous(plan, Pause.PARAGRAPH)
            paragraph += 1
        chapter = len(plan.chapters) - 1
        for span, ms in pieces:
            if span is not None:
                start, end = span
                written = spoken(text[start:end], markdown)
                stressed = spoken(text[start:end], markdown, emphasis=True)
                plan.segments.append(
                    Segment(
                        index=len(plan.segments),
                        text=written,
                        say=stressed if stressed != written else "",
                        start=start,
                        end=end,
                        chapter=chapter,
                        paragraph=paragraph,
                        heading=block.heading,
                        pause_after=Pause.SENTENCE,
                    )
                )
            if ms:
                _add_pauses(plan, [ms])
    _end_previous(plan, Pause.END, force=True)
    return plan


def _split_at_pauses(text: str, start: int, end: int) -> list[tuple[int, int, int]]:
    """The block's text between ``[pause ...]`` marks: (start, end, the pause after it in ms, or 0)."""
    parts: list[tuple[int, int, int]] = []
    pos = start
    for mark in _PAUSE_MARK.finditer(text, start, end):
        value, unit = float(mark.group(1)), mark.group(2).lower()
        ms = round(value * (1000 if unit == "s" else 1))
        if ms > MAX_PAUSE_MS:
            raise InvalidRequest(
                f"the pause {mark.group(0)!r} at character {mark.start():,} is longer than {MAX_PAUSE_MS // 1000} s"
            )
        parts.append((pos, mark.start(), ms))
        pos = mark.end()
    parts.append((pos, end, 0))
    return parts


def _with_last(spans: list[tuple[int, int]], ms: int) -> list[tuple[tuple[int, int] | None, int]]:
    """Spans paired with the pause after each: ``ms`` after the last (a lone pause if no span)."""
    if not spans:
        return [(None, ms)] if ms else []
    return [(span, 0) for span in spans[:-1]] + [(spans[-1], ms)]


def _add_pauses(plan: Plan, pauses: list[int]) -> None:
    """An explicit pause after the last segment so far (pauses in a row add up)."""
    for ms in pauses:
        if not plan.segments:
            raise InvalidRequest("a [pause] comes before any text: a pause follows what is said")
        last = plan.segments[-1]
        plan.segments[-1] = Segment(**{**asdict(last), "pause_ms": max(last.pause_ms, 0) + ms})


def _end_previous(plan: Plan, pause: Pause, force: bool = False) -> None:
    """Set the pause after the last segment so far (the stronger of what it has and ``pause``)."""
    if not plan.segments:
        return
    order = [Pause.SENTENCE, Pause.PARAGRAPH, Pause.SCENE, Pause.CHAPTER]
    last = plan.segments[-1]
    if force or last.pause_after in order and order.index(pause) > order.index(last.pause_after):
        new = pause
    else:
        return
    plan.segments[-1] = Segment(**{**asdict(last), "pause_after": new})
