"""Pronunciation lexicons: words or patterns -> what the voice says instead, before synthesis.

An entry is a whole word or phrase (``match``, case-insensitive unless ``case_sensitive``) or an RE2
pattern (``regex``), and its replacement (``say``, literal text). A job's lexicon is its own entries
followed by those of the tenant's named lexicons it lists; where two match at one place, the first
listed wins (leftmost-first alternation). Entries are compiled into one RE2 pattern: RE2 runs in
linear time whatever the pattern, so a tenant's regex cannot stall a worker (Python's ``re``
backtracks: ``(a+)+$`` on a long line never ends). google-re2 is BSD.

The plan keeps each segment's text as written (captions and the manifest quote it) and what is said
where it differs (``Segment.say``); the plan's ``lexicon`` says how often each entry was applied.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass

import re2

from jobs.errors import InvalidRequest

#: Limits (a lexicon's entries, a job's in all, the length of a pattern or replacement).
MAX_ENTRIES = 1000
MAX_JOB_ENTRIES = 2000
MAX_PATTERN_CHARS = 200
MAX_SAY_CHARS = 200
MAX_LEXICONS = 100
NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")
_PHONEME_CHARS = re.compile(r"[ -Z\\^-~]+")  # printable ASCII but [ and ]
_SURROGATE = re.compile("[\ud800-\udfff]")  # JSON may carry one alone; nothing can encode it


@dataclass(frozen=True, slots=True)
class Entry:
    #: What is said instead: words, or (``phonemes``) a phoneme string for families that read them.
    say: str | None = None
    match: str | None = None
    regex: str | None = None
    case_sensitive: bool = False
    phonemes: str | None = None

    @property
    def replacement(self) -> str:
        return f"[[{self.phonemes}]]" if self.phonemes is not None else self.say

    def pattern(self) -> str:
        if self.regex is not None:
            return self.regex
        body = re.escape(self.match)  # RE2 reads Python's escapes
        # whole words: a boundary where the phrase starts or ends with a word character
        left = r"\b" if re.match(r"\w", self.match) else ""
        right = r"\b" if re.search(r"\w$", self.match) else ""
        return f"{left}{body}{right}"

    def key(self) -> str:
        return f"regex {self.regex!r}" if self.regex is not None else f"{self.match!r}"


def entries_from(raw, where: str = "lexicon") -> list[Entry]:
    """Validated entries from JSON-like dicts; every problem is a 422 that names the entry."""
    if not isinstance(raw, list):
        raise InvalidRequest(f"{where}: a list of entries ({{\"match\": ..., \"say\": ...}} or {{\"regex\": ..., \"say\": ...}})")
    if len(raw) > MAX_ENTRIES:
        raise InvalidRequest(f"{where}: {len(raw):,} entries; at most {MAX_ENTRIES:,}")
    out = []
    for i, item in enumerate(raw):
        at = f"{where} entry {i + 1}"
        if not isinstance(item, dict) or set(item) - {"match", "regex", "say", "phonemes", "case_sensitive"}:
            raise InvalidRequest(f"{at}: an object with match or regex, say or phonemes, and optionally case_sensitive")
        match, regex, say, phonemes = item.get("match"), item.get("regex"), item.get("say"), item.get("phonemes")
        if (match is None) == (regex is None):
            raise InvalidRequest(f"{at}: give either match (a word or phrase) or regex, not both or neither")
        text = match if match is not None else regex
        if not isinstance(text, str) or not text.strip():
            raise InvalidRequest(f"{at}: match/regex is empty")
        for field, value in (("match/regex", text), ("say", say), ("phonemes", phonemes)):
            if isinstance(value, str) and _SURROGATE.search(value):
                raise InvalidRequest(f"{at}: {field} is not valid Unicode (a lone surrogate)")
        if len(text) > MAX_PATTERN_CHARS:
            raise InvalidRequest(f"{at}: match/regex has {len(text)} characters; at most {MAX_PATTERN_CHARS}")
        if (say is None) == (phonemes is None):
            raise InvalidRequest(f"{at}: give either say (words) or phonemes, not both or neither")
        if say is not None and (not isinstance(say, str) or len(say) > MAX_SAY_CHARS):
            raise InvalidRequest(f"{at}: say is the text to say instead (at most {MAX_SAY_CHARS} characters)")
        if phonemes is not None and not (
            isinstance(phonemes, str) and 0 < len(phonemes) <= MAX_SAY_CHARS and _PHONEME_CHARS.fullmatch(phonemes)
        ):
            raise InvalidRequest(
                f"{at}: phonemes are eSpeak NG mnemonics (printable ASCII without [ and ], at most {MAX_SAY_CHARS})"
            )
        case = item.get("case_sensitive", False)
        if not isinstance(case, bool):
            raise InvalidRequest(f"{at}: case_sensitive is true or false")
        entry = Entry(say=say, match=match, regex=regex, case_sensitive=case, phonemes=phonemes)
        try:
            compiled = re2.compile(entry.pattern())
        except re2.error as exc:
            raise InvalidRequest(f"{at}: regex {regex!r} is not valid RE2: {exc}") from None
        if compiled.search(""):
            raise InvalidRequest(f"{at}: regex {regex!r} matches empty text")
        if compiled.groupindex:  # the job's pattern names a group per entry: a name of its own clashes
            raise InvalidRequest(f"{at}: regex {regex!r} names a group; use (...) or (?:...)")
        out.append(entry)
    return out


class Lexicon:
    """A job's entries in order, compiled once."""

    def __init__(self, entries: list[Entry]) -> None:
        if len(entries) > MAX_JOB_ENTRIES:
            raise InvalidRequest(f"the job's lexicons hold {len(entries):,} entries; at most {MAX_JOB_ENTRIES:,}")
        self.entries = entries
        self.counts = [0] * len(entries)
        parts = [f"(?P<e{i}>{'' if e.case_sensitive else '(?i)'}{e.pattern()})" for i, e in enumerate(entries)]
        self._pattern = re2.compile("|".join(parts)) if parts else None

    def __bool__(self) -> bool:
        return bool(self.entries)

    def apply(self, text: str) -> str:
        """``text`` with every entry applied (what the voice says)."""
        if self._pattern is None:
            return text

        def replace(m) -> str:
            index = next(int(k[1:]) for k, v in m.groupdict().items() if v is not None)
            self.counts[index] += 1
            return self.entries[index].replacement

        return self._pattern.sub(replace, text)

    def report(self) -> list[dict]:
        """Each entry and how often it was applied (for the plan and the manifest)."""
        return [{**{k: v for k, v in asdict(e).items() if v is not None}, "applied": n} for e, n in zip(self.entries, self.counts, strict=True)]


def dumps(entries: list[Entry]) -> str:
    return json.dumps([{k: v for k, v in asdict(e).items() if v is not None} for e in entries], separators=(",", ":"))


def loads(raw: str | bytes) -> list[Entry]:
    return [Entry(**e) for e in json.loads(raw)]


class LexiconStore:
    """A tenant's named lexicons in one Redis hash (fleet/names.py ``lexicons``)."""

    def __init__(self, redis, names) -> None:
        self.redis = redis
        self.names = names

    async def put(self, tenant: str, name: str, entries: list[Entry]) -> bool:
        """Store (replace) a lexicon; True if it is new. At most MAX_LEXICONS a tenant."""
        key = self.names.lexicons(tenant)
        exists = await self.redis.hexists(key, name)
        if not exists and await self.redis.hlen(key) >= MAX_LEXICONS:
            raise InvalidRequest(f"this tenant has {MAX_LEXICONS} lexicons, the most it may keep: delete one first")
        await self.redis.hset(key, name, dumps(entries))
        return not exists

    async def get(self, tenant: str, name: str) -> list[Entry] | None:
        raw = await self.redis.hget(self.names.lexicons(tenant), name)
        return None if raw is None else loads(raw)

    async def delete(self, tenant: str, name: str) -> bool:
        return bool(await self.redis.hdel(self.names.lexicons(tenant), name))

    async def names_and_sizes(self, tenant: str) -> dict[str, int]:
        raw = await self.redis.hgetall(self.names.lexicons(tenant))
        return {k.decode(): len(json.loads(v)) for k, v in sorted(raw.items())}

    async def resolve(self, tenant: str, wanted: list[str]) -> list[Entry]:
        """The entries of the named lexicons, in the order named; an unknown name is a 422."""
        out: list[Entry] = []
        for name in wanted:
            entries = await self.get(tenant, name)
            if entries is None:
                raise InvalidRequest(f"lexicons: no lexicon {name[:63]!r} (PUT /v1/lexicons/{{name}} makes one)")
            out.extend(entries)
        return out
