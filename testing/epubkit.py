"""EPUB files for tests and benches: well-formed EPUB 2 (NCX) and EPUB 3 (navigation document) books
with the parts a reader must handle, and hostile ones.

``build_epub`` writes a zip exactly as the EPUB Open Container Format lays it out (an uncompressed
``mimetype`` first, META-INF/container.xml, a package document, the table of contents, XHTML
documents). pandoc, where installed, makes the independent ones (tests/jobs/test_epub.py).
"""

from __future__ import annotations

import io
import zipfile
from dataclasses import dataclass, field
from html import escape


@dataclass
class Doc:
    """A content document: ``body`` is XHTML inside <body>; ``toc``: (title, fragment or None, depth)
    entries of the table of contents pointing into it."""

    name: str
    body: str
    toc: list[tuple[str, str | None, int]] = field(default_factory=list)
    linear: bool = True
    epub_type: str = ""


def xhtml(body: str, title: str = "", epub_type: str = "", epub3: bool = True) -> str:
    doctype = (
        "<!DOCTYPE html>"
        if epub3
        else (
            '<!DOCTYPE html PUBLIC "-//W3C//DTD XHTML 1.1//EN" "http://www.w3.org/TR/xhtml11/DTD/xhtml11.dtd">'
        )
    )
    kind = f' epub:type="{epub_type}"' if epub_type else ""
    return (
        f'<?xml version="1.0" encoding="UTF-8"?>\n{doctype}\n'
        '<html xmlns="http://www.w3.org/1999/xhtml" xmlns:epub="http://www.idpf.org/2007/ops">\n'
        f"<head><title>{escape(title)}</title></head>\n<body{kind}>\n{body}\n</body>\n</html>\n"
    )


def build_epub(
    docs: list[Doc],
    *,
    version: int = 3,
    title: str = "A Test Book",
    author: str = "Ada Writer",
    language: str = "en",
    cover: bytes | None = None,
    landmarks: list[tuple[str, str]] | None = None,
    guide: list[tuple[str, str]] | None = None,
    extra: dict[str, bytes] | None = None,
    spine: bool = True,
) -> bytes:
    """An EPUB ``version`` (2: NCX, 3: nav document and NCX-free) of ``docs`` in spine order;
    ``landmarks`` (EPUB 3) / ``guide`` (EPUB 2): (type, document name); ``extra``: more members."""
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr(zipfile.ZipInfo("mimetype"), "application/epub+zip", compress_type=zipfile.ZIP_STORED)
        z.writestr(
            "META-INF/container.xml",
            '<?xml version="1.0"?>\n<container version="1.0" xmlns="urn:oasis:names:tc:opendocument:xmlns:container">'
            '<rootfiles><rootfile full-path="OEBPS/content.opf" media-type="application/oebps-package+xml"/>'
            "</rootfiles></container>",
        )
        items, refs = [], []
        for i, doc in enumerate(docs):
            items.append(f'<item id="d{i}" href="text/{doc.name}" media-type="application/xhtml+xml"/>')
            linear = "" if doc.linear else ' linear="no"'
            refs.append(f'<itemref idref="d{i}"{linear}/>')
            z.writestr(f"OEBPS/text/{doc.name}", xhtml(doc.body, doc.name, doc.epub_type, version == 3))
        meta = ""
        if cover is not None:
            props = ' properties="cover-image"' if version == 3 else ""
            items.append(f'<item id="cover-img" href="images/cover.png" media-type="image/png"{props}/>')
            meta = '<meta name="cover" content="cover-img"/>' if version == 2 else ""
            z.writestr("OEBPS/images/cover.png", cover)
        entries = [
            (t, f"text/{d.name}" + (f"#{frag}" if frag else ""), depth)
            for d in docs
            for t, frag, depth in d.toc
        ]
        if version == 3:
            items.append(
                '<item id="nav" href="nav.xhtml" media-type="application/xhtml+xml" properties="nav"/>'
            )
            z.writestr("OEBPS/nav.xhtml", _nav(entries, landmarks or []))
            toc_attr = ""
        else:
            items.append('<item id="ncx" href="toc.ncx" media-type="application/x-dtbncx+xml"/>')
            z.writestr("OEBPS/toc.ncx", _ncx(entries, title))
            toc_attr = ' toc="ncx"'
        guide_xml = ""
        if guide:
            guide_xml = (
                "<guide>"
                + "".join(f'<reference type="{t}" title="{t}" href="text/{name}"/>' for t, name in guide)
                + "</guide>"
            )
        spine_xml = f"<spine{toc_attr}>{''.join(refs)}</spine>" if spine else ""
        z.writestr(
            "OEBPS/content.opf",
            f'<?xml version="1.0" encoding="UTF-8"?>\n<package xmlns="http://www.idpf.org/2007/opf" version="{version}.0" '
            'unique-identifier="id"><metadata xmlns:dc="http://purl.org/dc/elements/1.1/" '
            'xmlns:opf="http://www.idpf.org/2007/opf">'
            f'<dc:identifier id="id">urn:uuid:00000000-0000-4000-8000-000000000000</dc:identifier>'
            f"<dc:title>{escape(title)}</dc:title><dc:creator>{escape(author)}</dc:creator>"
            f"<dc:language>{language}</dc:language>{meta}</metadata>"
            f"<manifest>{''.join(items)}</manifest>{spine_xml}{guide_xml}</package>",
        )
        for name, data in (extra or {}).items():
            z.writestr(name, data)
    return out.getvalue()


def _nav(entries: list[tuple[str, str, int]], landmarks: list[tuple[str, str]]) -> str:
    html, depth = [], -1
    for title, href, d in entries:
        if d > depth:
            html.append("<ol>" * (d - depth))
        else:
            html.append("</li>" + "</ol></li>" * (depth - d))
        html.append(f'<li><a href="{href}">{escape(title)}</a>')
        depth = d
    html.append("</li>" + "</ol></li>" * depth + "</ol>" if entries else "")
    marks = "".join(f'<li><a epub:type="{t}" href="text/{name}">{t}</a></li>' for t, name in landmarks)
    body = f'<nav epub:type="toc" id="toc"><h1>Contents</h1>{"".join(html)}</nav>'
    if marks:
        body += f'<nav epub:type="landmarks" hidden=""><ol>{marks}</ol></nav>'
    return xhtml(body, "Contents")


def _ncx(entries: list[tuple[str, str, int]], title: str) -> str:
    points, depth = [], -1
    for n, (t, href, d) in enumerate(entries):
        points.append("</navPoint>" * (depth - d + 1) if d <= depth else "")
        points.append(
            f'<navPoint id="n{n}" playOrder="{n + 1}"><navLabel><text>{escape(t)}</text></navLabel>'
            f'<content src="{href}"/>'
        )
        depth = d
    points.append("</navPoint>" * (depth + 1))
    return (
        '<?xml version="1.0" encoding="UTF-8"?>\n<ncx xmlns="http://www.daisy.org/z3986/2005/ncx/" version="2005-1">'
        f"<head/><docTitle><text>{escape(title)}</text></docTitle><navMap>{''.join(points)}</navMap></ncx>"
    )


def png(width: int = 4, height: int = 4) -> bytes:
    """A real PNG (red), for covers."""
    import struct
    import zlib

    raw = b"".join(b"\x00" + b"\xff\x00\x00" * width for _ in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data))
            + kind
            + data
            + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
        )

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(raw))
        + chunk(b"IEND", b"")
    )


def sample_book(version: int = 3, **kwargs) -> bytes:
    """A small novel with what readers trip over: a cover page and a copyright page (front matter),
    a nested table of contents with a chapter starting inside a document, a footnote, an image with
    alt text, an index (back matter)."""
    marker = '<a epub:type="noteref" href="#n1">1</a>' if version == 3 else '<sup><a href="#n1">1</a></sup>'
    note = (
        '<aside epub:type="footnote" id="n1"><p>The note is not read.</p></aside>'
        if version == 3
        else '<div id="n1"><p>1. The note is not read.</p></div>'
    )
    docs = [
        Doc("cover.xhtml", '<div><img src="../images/cover.png" alt="The cover"/></div>'),
        Doc(
            "copyright.xhtml",
            '<section epub:type="copyright-page"><p>Copyright 2026 Ada Writer. All rights reserved.</p></section>',
            toc=[("Copyright", None, 0)],
        ),
        Doc(
            "part1.xhtml",
            "<h1>Part One</h1>"
            '<section id="c1"><h2>Chapter 1: The Ship</h2>'
            f"<p>The U.S. Navy sailed at dawn.{marker} Nobody waved.</p>"
            '<p><img src="../images/map.png" alt="A map of the bay"/></p>'
            "<p>Rain fell on the deck.</p></section>"
            '<section id="c2"><h2>Chapter 2: The Storm</h2><p>The wind rose by noon.</p>'
            f"{note}</section>",
            toc=[("Part One", None, 0), ("Chapter 1: The Ship", "c1", 1), ("Chapter 2: The Storm", "c2", 1)],
        ),
        Doc(
            "part2.xhtml",
            "<h1>Part Two</h1><h2>Chapter 3: Home</h2><p>They came home at last.</p>",
            toc=[("Part Two", None, 0), ("Chapter 3: Home", None, 1)],
        ),
        Doc("index.xhtml", "<h1>Index</h1><p>Navy, 3. Storm, 5.</p>", toc=[("Index", None, 0)]),
    ]
    return build_epub(docs, version=version, cover=png(), **kwargs)
