"""The EPUB reader on books the tests build (EPUB 2 with an NCX, EPUB 3 with a navigation document),
on books pandoc makes (another producer: its own layout, landmarks, notes), and on hostile files."""

from __future__ import annotations

import io
import shutil
import subprocess
import zipfile

import pytest

from fleet.settings import Settings
from jobs.books import BookError, layout, select
from jobs.epub import EpubLimits, iso639_2, read_epub
from jobs.errors import InvalidRequest
from jobs.segmentation import plan_blocks
from jobs.service import JobRequest, from_book, validate
from testing.epubkit import Doc, build_epub, png, sample_book
from tests.conftest import require

BODY = ["Part One", "Chapter 1: The Ship", "Chapter 2: The Storm", "Part Two", "Chapter 3: Home"]


@pytest.mark.parametrize("version", [2, 3])
def test_chapters_come_from_the_table_of_contents_in_reading_order(version):
    book = read_epub(sample_book(version))
    assert (book.title, book.author, book.language, book.cover) == ("A Test Book", "Ada Writer", "eng", png())
    assert [(c.number, c.title, c.matter) for c in book.chapters] == [
        (1, "cover.xhtml", "unlisted"),  # before the first entry
        (2, "Copyright", "copyright-page"),
        (3, "Part One", ""),  # a part: its title alone
        (4, "Chapter 1: The Ship", ""),  # nested, starting at an element inside part1.xhtml
        (5, "Chapter 2: The Storm", ""),
        (6, "Part Two", ""),
        (7, "Chapter 3: Home", ""),  # two entries at one document's start
        (8, "Index", "index"),
    ]
    ship, storm = book.chapters[3], book.chapters[4]
    # the chapter's own heading is not read twice; the footnote marker, the note and the image are out
    assert ship.paragraphs == ("The U.S. Navy sailed at dawn. Nobody waved.", "Rain fell on the deck.")
    assert storm.paragraphs == ("The wind rose by noon.",)
    chosen = select(book, None)
    assert [c.title for c in chosen] == BODY  # front and back matter skipped by default


def test_alt_text_is_read_when_asked():
    ship = read_epub(sample_book(3), alt_text=True).chapters[3]
    assert ship.paragraphs == (
        "The U.S. Navy sailed at dawn. Nobody waved.",
        "A map of the bay",
        "Rain fell on the deck.",
    )


def test_a_selection_names_chapters_by_number_or_title_and_can_take_skipped_matter():
    book = read_epub(sample_book(3))
    assert [c.title for c in select(book, [7, "chapter 1:  the SHIP", 2])] == [
        "Copyright",
        "Chapter 1: The Ship",
        "Chapter 3: Home",
    ]  # book order, whatever the order asked
    with pytest.raises(
        InvalidRequest, match=r"no chapter 9, 'Epilogue' in this book \(8 chapters: 1 'cover.xhtml'"
    ):
        select(book, [9, "Epilogue"])


def test_the_plan_has_the_books_chapters_and_a_job_takes_its_metadata(tmp_path):
    settings = Settings(data_dir=tmp_path, models="tiny")
    request = from_book(JobRequest(text="", format="m4b"), read_epub(sample_book(2)))
    job, plan = validate(request, settings)
    assert [c.title for c in plan.chapters] == BODY
    assert (job.title, job.author, job.language, job.cover) == (
        "A Test Book",
        "Ada Writer",
        "eng",
        "image/png",
    )
    assert [s.text for s in plan.segments if s.chapter == 1] == [
        "Chapter 1: The Ship",
        "The U.S. Navy sailed at dawn.",
        "Nobody waved.",
        "Rain fell on the deck.",
    ]
    # a segment's span quotes the laid-out text
    text, _ = layout(select(read_epub(sample_book(2)), None))
    assert all(text[s.start : s.end] == s.text for s in plan.segments)
    # explicit tags win over the book's; wav carries no cover, so none is taken
    request = from_book(JobRequest(text="", title="Mine", author="Me"), read_epub(sample_book(2)), [4])
    job, plan = validate(request, settings)
    assert (job.title, job.author, job.cover, job.chapters) == ("Mine", "Me", "", 1)


def test_a_book_without_a_table_of_contents_has_a_chapter_per_document():
    docs = [
        Doc("a.xhtml", "<h1>Alpha</h1><p>First words.</p>"),
        Doc("b.xhtml", "<h2>Beta</h2><p>Second words.</p>"),
    ]
    book = read_epub(build_epub(docs, version=2))
    assert [(c.title, c.paragraphs, c.matter) for c in book.chapters] == [
        ("Alpha", ("First words.",), ""),
        ("Beta", ("Second words.",), ""),
    ]


def test_named_entities_hidden_text_page_numbers_and_non_linear_documents():
    docs = [
        Doc(
            "a.xhtml",
            '<h1>One</h1><p>Caf&eacute;&nbsp;society.<span epub:type="pagebreak" id="p7">7</span> Then '
            '<span style="display: none">hidden</span>more.</p><p hidden="">gone</p>',
            toc=[("One", None, 0)],
        ),
        Doc("notes.xhtml", "<p>A pop-up note.</p>", linear=False),
    ]
    book = read_epub(build_epub(docs, version=2))
    assert [c.paragraphs for c in book.chapters] == [("Café society. Then more.",)]


def _epub_of_pages(pages: list[bytes]) -> bytes:
    """An EPUB 3 whose content documents are these bytes as they are (no declaration added)."""
    items = "".join(f'<item id="p{i}" href="p{i}.xhtml" media-type="application/xhtml+xml"/>' for i in range(len(pages)))
    spine = "".join(f'<itemref idref="p{i}"/>' for i in range(len(pages)))
    opf = (
        '<?xml version="1.0" encoding="UTF-8"?><package xmlns="http://www.idpf.org/2007/opf" version="3.0">'
        '<metadata xmlns:dc="http://purl.org/dc/elements/1.1/"><dc:title>B</dc:title></metadata>'
        f"<manifest>{items}</manifest><spine>{spine}</spine></package>"
    )
    container = (
        '<container xmlns="urn:oasis:names:tc:opendocument:xmlns:container" version="1.0"><rootfiles>'
        '<rootfile full-path="content.opf" media-type="application/oebps-package+xml"/></rootfiles></container>'
    )
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        z.writestr("mimetype", "application/epub+zip")
        z.writestr("META-INF/container.xml", container)
        z.writestr("content.opf", opf)
        for i, page in enumerate(pages):
            z.writestr(f"p{i}.xhtml", page)
    return out.getvalue()


def test_a_pages_encoding_is_its_declaration_else_utf_8():
    said, latin = "Café “déjà vu” — naïve.", "Café déjà vu, naïve."

    def page(text: str, head: str = "", before: str = "") -> str:
        return f'{before}<html xmlns="http://www.w3.org/1999/xhtml"><head>{head}<title>T</title></head><body><p>{text}</p></body></html>'

    pages = [
        page(said, before="<!DOCTYPE html>\n").encode("utf-8"),  # nothing declared: UTF-8, as EPUB says
        page(latin, before='<?xml version="1.0" encoding="iso-8859-1"?>').encode("latin-1"),
        page(said, head='<meta charset="windows-1252"/>').encode("cp1252"),
        page(said).encode("utf-16"),  # with its byte-order mark
        page(said, before='<?xml version="1.0" encoding="iso-8859-1"?>').encode("utf-8"),  # a stale declaration
    ]
    assert [c.paragraphs for c in read_epub(_epub_of_pages(pages)).chapters] == [(said,), (latin,), (said,), (said,), (said,)]


def test_a_first_entry_at_an_anchor_makes_one_chapter_and_a_chapter_1_is_no_title_page():
    docs = [
        Doc("a.xhtml", '<section id="s1"><h1>1</h1><p>The night was cold.</p></section>', toc=[("1", "s1", 0)]),
        Doc("b.xhtml", "<h1>2</h1><p>Morning came slowly.</p>", toc=[("2", None, 0)]),
    ]
    book = read_epub(build_epub(docs, title="Sea Stories, Volume 1"))
    assert [(c.number, c.title, c.paragraphs, c.matter) for c in book.chapters] == [
        (1, "1", ("The night was cold.",), ""),
        (2, "2", ("Morning came slowly.",), ""),
    ]
    assert [c.title for c in select(book, None)] == ["1", "2"]
    # a title page is still one: the book's title, and more after it
    title_page = Doc("t.xhtml", "<p>by Ada Writer</p>", toc=[("Sea Stories, Volume 1: Tales", None, 0)])
    book = read_epub(build_epub([title_page, *docs], title="Sea Stories, Volume 1"))
    assert [c.matter for c in book.chapters] == ["titlepage", "", ""]


def test_a_chapter_with_no_title_to_say_keeps_its_mark():
    docs = [
        Doc("a.xhtml", "<h1>One</h1><p>First text.</p>", toc=[("One", None, 0)]),
        Doc("b.xhtml", "<p>Second text.</p>", toc=[("\u2726", None, 0)]),
        Doc("c.xhtml", "<h1>Three</h1><p>Third text.</p>", toc=[("Three", None, 0)]),
        Doc("d.xhtml", "<p>Fourth text.</p>", toc=[("* * *", None, 0)]),
    ]
    plan = plan_blocks(*layout(select(read_epub(build_epub(docs)), None)))
    assert [(c.title, c.first_segment) for c in plan.chapters] == [("One", 0), ("", 2), ("Three", 3), ("", 5)]
    assert [s.text for s in plan.segments] == ["One", "First text.", "Second text.", "Three", "Third text.", "Fourth text."]
    assert [s.pause_after.value for s in plan.segments][1:3] == ["chapter", "chapter"]


def test_iso_639_2_from_bcp_47():
    assert [iso639_2(c) for c in ("en-GB", "de", "fra", "pt_BR", "xx", "")] == [
        "eng",
        "deu",
        "fra",
        "por",
        "",
        "",
    ]


# --- pandoc's books ---------------------------------------------------------------------------------

PANDOC_MD = """---
title: The Pandoc Book
author: Pat Doc
lang: de-DE
---

# The Beginning

It was a dark night.[^1] The U.S. Navy sailed.

![A ship at sea](ship.png)

## A Section

More text here.

# The End

Goodbye now.

[^1]: A footnote that is not read.
"""


@pytest.mark.parametrize("target", ["epub2", "epub3"])
def test_pandocs_epubs(tmp_path, target):
    """pandoc (Debian's; scripts/test.sh installs it) writes EPUBs its own way: a title page, a cover
    page, landmarks (EPUB 3), notes at the end with or without epub:type."""
    require(shutil.which("pandoc") is not None, "pandoc (scripts/test.sh installs it)")
    (tmp_path / "book.md").write_text(PANDOC_MD)
    (tmp_path / "ship.png").write_bytes(png())
    subprocess.run(
        ["pandoc", "book.md", "-t", target, "-o", "book.epub", "--epub-cover-image=ship.png"],
        cwd=tmp_path, check=True, capture_output=True,
    )  # fmt: skip
    book = read_epub((tmp_path / "book.epub").read_bytes())
    assert (book.title, book.author, book.language, book.cover) == (
        "The Pandoc Book",
        "Pat Doc",
        "deu",
        png(),
    )
    chosen = select(book, None)
    assert [(c.title, c.paragraphs) for c in chosen] == [
        (
            "The Beginning",
            ("It was a dark night. The U.S. Navy sailed.",)
            + (("A ship at sea",) if target == "epub2" else ()),
        ),
        ("A Section", ("More text here.",)),
        ("The End", ("Goodbye now.",)),
    ]  # EPUB 2's figure caption is text on the page; EPUB 3's is aria-hidden (it repeats the alt text)
    assert all(c.skipped_by_default for c in book.chapters if c not in chosen)  # cover, title page


# --- hostile files ----------------------------------------------------------------------------------


def _zip(members: dict[str, bytes]) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in members.items():
            z.writestr(name, data)
    return out.getvalue()


def _with(book: bytes, replace: dict[str, bytes] | None = None, add: dict[str, bytes] | None = None) -> bytes:
    with zipfile.ZipFile(io.BytesIO(book)) as z:
        members = {i.filename: z.read(i) for i in z.infolist()}
    members.update(replace or {})
    members.update(add or {})
    return _zip(members)


LAUGHS = (
    b'<?xml version="1.0"?><!DOCTYPE lolz [<!ENTITY lol "lol"><!ENTITY lol2 "&lol;&lol;&lol;&lol;&lol;">'
    b'<!ENTITY lol3 "&lol2;&lol2;&lol2;&lol2;&lol2;">]><package xmlns="http://www.idpf.org/2007/opf">'
    b"<metadata><title>&lol3;</title></metadata></package>"
)
AES = (
    b'<encryption xmlns="urn:oasis:names:tc:opendocument:xmlns:container" xmlns:enc="http://www.w3.org/2001/04/xmlenc#">'
    b'<enc:EncryptedData><enc:EncryptionMethod Algorithm="http://www.w3.org/2001/04/xmlenc#aes128-cbc"/>'
    b'<enc:CipherData><enc:CipherReference URI="OEBPS/text/part1.xhtml"/></enc:CipherData></enc:EncryptedData></encryption>'
)
FONTS_ONLY = AES.replace(
    b"http://www.w3.org/2001/04/xmlenc#aes128-cbc", b"http://www.idpf.org/2008/embedding"
)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: b"not a zip at all", "not a zip archive"),
        (lambda: _zip({"mimetype": b"application/epub+zip"}), "container.xml is missing"),
        (lambda: _with(sample_book(3), add={"../../evil.xhtml": b"x"}), "unsafe file name '../../evil.xhtml'"),
        (lambda: _with(sample_book(3), add={"/etc/passwd": b"x"}), "unsafe file name"),
        (lambda: _with(sample_book(3), replace={"OEBPS/content.opf": LAUGHS}), "declares XML entities"),
        (lambda: _with(sample_book(3), add={"META-INF/encryption.xml": AES}), "DRM-protected"),
        (lambda: _with(sample_book(3), add={"META-INF/rights.xml": b"<rights/>"}), "DRM-protected"),
        (lambda: build_epub([Doc("a.xhtml", "<p>Hi.</p>")], spine=False), "no spine"),
        (lambda: _with(sample_book(3), add={"OEBPS/zeros.bin": bytes(8 * 1024 * 1024)}), "compressed"),
        (
            lambda: _with(sample_book(2), replace={"OEBPS/content.opf": _traversing_opf()}),
            "points outside its archive",
        ),
        (
            lambda: build_epub([Doc("a.xhtml", "<p>Hi.</p>" + "<span>" * 300 + "Deep.<p>After.</p>")]),
            r"'OEBPS/text/a.xhtml' cannot be read whole \(Excessive depth in document: 256",
        ),
    ],
    ids=["not-zip", "no-container", "dotdot", "absolute", "entities", "drm-encryption", "drm-adobe", "no-spine",
         "ratio-bomb", "href-traversal", "too-deep"],
)  # fmt: skip
def test_hostile_epubs_are_refused_with_the_reason(make, message):
    with pytest.raises(BookError, match=message):
        read_epub(make())


def test_size_limits_hold_the_unpacked_total_and_each_file():
    book = sample_book(3)
    with pytest.raises(BookError, match="unpacks to"):
        read_epub(book, EpubLimits(max_total_bytes=2000))
    big = _with(book, add={"OEBPS/big.bin": bytes(range(256)) * 8192})  # 2 MiB, barely compressible
    with pytest.raises(BookError, match="unpacks to 2,097,152 bytes; at most 1,048,576"):
        read_epub(big, EpubLimits(max_member_bytes=1024 * 1024))
    with pytest.raises(BookError, match="at most 5 are read"):
        read_epub(book, EpubLimits(max_members=5))


def test_font_obfuscation_is_not_drm():
    book = read_epub(_with(sample_book(3), add={"META-INF/encryption.xml": FONTS_ONLY}))
    assert len(select(book, None)) == 5


def _traversing_opf() -> bytes:
    with zipfile.ZipFile(io.BytesIO(sample_book(2))) as z:
        opf = z.read("OEBPS/content.opf")
    return opf.replace(b'href="text/part2.xhtml"', b'href="../../../etc/passwd"')


def test_a_book_plans_like_text_with_known_blocks():
    text, blocks = layout(select(read_epub(sample_book(3)), [4]))
    plan = plan_blocks(text, blocks)
    assert [(c.title, c.first_segment) for c in plan.chapters] == [("Chapter 1: The Ship", 0)]
    assert [s.heading for s in plan.segments] == [True, False, False, False]
