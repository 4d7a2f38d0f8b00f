"""A book as users bring it: chapters with titles, paragraphs, and the package's metadata.

``Book`` is what an EPUB reader (jobs/epub.py) gives: every chapter the table of contents names, in
reading order, each marked with the front or back matter it is (cover, copyright page, contents,
index...; "" for the body). A job narrates a selection of them (``select``: the body by default, or
chapters named by number or title) laid out as a text with known paragraphs and headings
(``layout``), which jobs/segmentation.py plans like any other text.

Also here: uploads of plain text and Markdown files (``read_text_file``).
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass, field

from jobs.errors import InvalidRequest
from jobs.segmentation import Block, spoken

#: Matter a job leaves out unless its ``chapters`` selection names it.
SKIPPED_MATTER = frozenset(
    {
        "cover",
        "titlepage",
        "copyright-page",
        "toc",
        "index",
        "colophon",
        "landmarks",
        "loi",
        "lot",
        "imprint",
        "unlisted",
    }
)
#: A paragraph that is a scene break (an EPUB's <hr>): a scene pause, nothing said.
SCENE_BREAK = "* * *"
#: How a selection quotes the chapters it could not find (at most this many of the book's titles).
_LISTED_TITLES = 12


class BookError(InvalidRequest):
    """The book cannot be read (not an EPUB, hostile, DRM-protected, no reading order): a 422."""


@dataclass(frozen=True, slots=True)
class BookChapter:
    #: 1-based, as ``chapters`` selections and the contents listing number them.
    number: int
    title: str
    paragraphs: tuple[str, ...]
    #: "" for the body; else the front/back matter it is (SKIPPED_MATTER names those left out).
    matter: str = ""

    @property
    def skipped_by_default(self) -> bool:
        return self.matter in SKIPPED_MATTER

    @property
    def chars(self) -> int:
        return sum(len(p) for p in self.paragraphs if p != SCENE_BREAK)


@dataclass(frozen=True, slots=True)
class Book:
    title: str = ""
    author: str = ""
    #: ISO 639-2 (three letters), or "" if the book does not say or the code is not known.
    language: str = ""
    #: The cover picture's bytes (PNG or JPEG), if the book has one.
    cover: bytes | None = None
    chapters: tuple[BookChapter, ...] = field(default_factory=tuple)

    def contents(self) -> list[dict]:
        """The chapters as a listing (for ``chapters`` selections)."""
        return [
            {
                "number": c.number,
                "title": c.title,
                "matter": c.matter,
                "narrated_by_default": not c.skipped_by_default,
                "chars": c.chars,
            }
            for c in self.chapters
        ]


def select(book: Book, wanted: list[int | str] | None) -> list[BookChapter]:
    """The chapters a job narrates: ``wanted`` (numbers from 1, or titles, case and spacing aside) in
    book order, or every chapter that is not skipped matter."""
    if not wanted:
        chosen = [c for c in book.chapters if not c.skipped_by_default]
        if not any(c.paragraphs for c in chosen):
            raise InvalidRequest("the book has no text to narrate outside its front and back matter")
        return chosen
    by_title: dict[str, list[BookChapter]] = {}
    for c in book.chapters:
        by_title.setdefault(_title_key(c.title), []).append(c)
    numbers: set[int] = set()
    missing: list[str] = []
    for item in wanted:
        if isinstance(item, bool) or not isinstance(item, int | str):
            raise InvalidRequest(f"chapters: {item!r} is neither a chapter number nor a title")
        if isinstance(item, int):
            if not 1 <= item <= len(book.chapters):
                missing.append(str(item))
            else:
                numbers.add(item)
        elif found := by_title.get(_title_key(item)):
            numbers.update(c.number for c in found)
        else:
            missing.append(repr(item[:80]))
    if missing:
        titles = ", ".join(f"{c.number} {c.title!r}" for c in book.chapters[:_LISTED_TITLES])
        more = (
            f" and {len(book.chapters) - _LISTED_TITLES} more" if len(book.chapters) > _LISTED_TITLES else ""
        )
        raise InvalidRequest(
            f"chapters: no chapter {', '.join(missing)} in this book ({len(book.chapters)} chapters: {titles}{more})"
        )
    chosen = [c for c in book.chapters if c.number in numbers]
    if not any(c.paragraphs or c.title for c in chosen):
        raise InvalidRequest("the chapters chosen have no text to narrate")
    return chosen


def _title_key(title: str) -> str:
    return " ".join(unicodedata.normalize("NFKC", title).casefold().split())


def layout(chapters: list[BookChapter]) -> tuple[str, list[Block]]:
    """The chapters as one text (its title, then its paragraphs, blank lines between) and its blocks:
    each title a heading (it starts a chapter), each paragraph a paragraph."""
    parts: list[str] = []
    blocks: list[Block] = []
    pos = 0

    def add(text: str, heading: bool, starts_chapter: bool = False) -> None:
        nonlocal pos
        if parts:
            parts.append("\n\n")
            pos += 2
        parts.append(text)
        scene = text == SCENE_BREAK
        end = pos if scene else pos + len(text)
        blocks.append(Block(pos, end, heading and not scene, scene=scene, chapter=starts_chapter and not scene))
        pos += len(text)

    for chapter in chapters:
        # a title with nothing to say ("", "✦", "* * *") still ends the chapter before: its first
        # paragraph starts an untitled one
        titled = chapter.title != SCENE_BREAK and bool(spoken(chapter.title, markdown=False))
        if titled:
            add(chapter.title, heading=True)
        for n, paragraph in enumerate(chapter.paragraphs):
            add(paragraph, heading=False, starts_chapter=not titled and n == 0)
    return "".join(parts), blocks


# --- text files ------------------------------------------------------------------------------------

_MARKDOWN_NAME = re.compile(r"\.(md|markdown|mdown|mkd)$", re.IGNORECASE)


def is_markdown_name(name: str) -> bool:
    return bool(_MARKDOWN_NAME.search(name or ""))


def text_encoding(data: bytes) -> str:
    """A text file's encoding: UTF-16 with its byte-order mark, else UTF-8 (a BOM allowed)."""
    return "utf-16" if data.startswith((b"\xff\xfe", b"\xfe\xff")) else "utf-8-sig"


def read_text_file(data: bytes, name: str = "") -> str:
    """An uploaded .txt or .md file's text: UTF-8 (a BOM is allowed, so is UTF-16 with its BOM)."""
    what = f"{name!r} " if name else ""
    try:
        text = data.decode(text_encoding(data))
    except UnicodeDecodeError as exc:
        raise InvalidRequest(
            f"the file {what}is not UTF-8 text (byte {exc.start:,} cannot be read); save it as UTF-8"
        ) from None
    if "\x00" in text:
        raise InvalidRequest(f"the file {what}is not text (it holds NUL characters)")
    return text
