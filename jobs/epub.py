"""EPUB 2 and 3 -> a ``Book`` (jobs/books.py): chapters from the table of contents, in reading order.

The reading order is the package's spine; chapters start where the table of contents points (the
EPUB 3 navigation document, else the EPUB 2 NCX; neither: one chapter per spine document, titled by
its first heading). Nested entries are chapters of their own; an entry pointing into a document
(``ch1.xhtml#part-2``) starts its chapter at that element. What comes before the first entry
(cover, title page) is "unlisted" matter; landmarks (EPUB 3), the guide (EPUB 2), ``epub:type`` on
the chapter's section and well-known titles say which chapters are cover, title page, copyright,
contents or index (skipped unless chosen). Footnote markers and the notes themselves, images, page
breaks and hidden text are dropped; an image's alt text is read only when asked for.

An EPUB is a zip of XML from whoever uploads it, so nothing is trusted: members are read with their
sizes checked against the declared ones and the limits (total, per member, compression ratio: zip
bombs), names that climb out of the archive or are absolute are refused, XML with entity
declarations is refused before it is parsed (entity expansion; lxml then runs without DTDs, the
network or huge trees), and encrypted content (Adobe ADEPT, Apple FairPlay, Readium LCP, or any
encryption that is not font obfuscation) is refused as DRM-protected. Every refusal is a
``BookError`` that says what was wrong.

lxml (BSD) parses; ebooklib, the usual EPUB library, is AGPL and does not fit this project.
"""

from __future__ import annotations

import codecs
import contextlib
import io
import posixpath
import re
import zipfile
import zlib
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

from lxml import etree, html

from jobs.books import SCENE_BREAK, Book, BookChapter, BookError

_NS = {
    "c": "urn:oasis:names:tc:opendocument:xmlns:container",
    "opf": "http://www.idpf.org/2007/opf",
    "dc": "http://purl.org/dc/elements/1.1/",
    "ncx": "http://www.daisy.org/z3986/2005/ncx/",
    "enc": "http://www.w3.org/2001/04/xmlenc#",
}
#: Encryption that is not DRM: font obfuscation (IDPF and Adobe), allowed in any DRM-free book.
_FONT_OBFUSCATION = frozenset({"http://www.idpf.org/2008/embedding", "http://ns.adobe.com/pdf/enc#RC"})
#: Members that only DRM schemes put there (Adobe ADEPT, Apple FairPlay, Readium LCP).
_DRM_MEMBERS = ("META-INF/rights.xml", "META-INF/sinf.xml", "META-INF/license.lcpl")
_CONTENT_TYPES = frozenset({"application/xhtml+xml", "text/html", "application/x-dtbook+xml"})
_COVER_TYPES = frozenset({"image/jpeg", "image/png"})


@dataclass(frozen=True, slots=True)
class EpubLimits:
    """What an uploaded EPUB may unpack to (fleet/settings.py ``epub_*``)."""

    max_members: int = 10_000
    max_total_bytes: int = 256 * 1024 * 1024
    max_member_bytes: int = 64 * 1024 * 1024
    #: Uncompressed/compressed; only members over 1 MiB are held to it (small XML compresses well).
    max_ratio: int = 200
    max_cover_bytes: int = 2 * 1024 * 1024

    @classmethod
    def from_settings(cls, settings) -> EpubLimits:
        unpacked = settings.epub_max_unpacked_bytes
        return cls(
            max_members=settings.epub_max_files,
            max_total_bytes=unpacked,
            max_member_bytes=min(unpacked, 64 * 1024 * 1024),
            max_ratio=settings.epub_max_ratio,
            max_cover_bytes=settings.max_cover_bytes,
        )


def read_epub(data: bytes, limits: EpubLimits = EpubLimits(), *, alt_text: bool = False) -> Book:
    """The book in ``data`` (an EPUB file's bytes), or a ``BookError`` saying why it cannot be read."""
    archive = _Archive(data, limits)
    archive.refuse_drm()
    opf_path = archive.rootfile()
    package = _Package(archive, opf_path)
    toc = package.table_of_contents()
    walker = _Walker(archive, package, toc, alt_text=alt_text)
    chapters = walker.chapters()
    if not any(c.paragraphs for c in chapters):
        raise BookError("the EPUB has no text to narrate (its documents hold no paragraphs)")
    return Book(
        title=package.title,
        author=package.author,
        language=package.language,
        cover=package.cover(limits.max_cover_bytes),
        chapters=tuple(chapters),
    )


# --- the archive -----------------------------------------------------------------------------------


def _safe_name(name: str) -> bool:
    if not name or "\x00" in name or "\\" in name or name.startswith("/") or re.match(r"^[A-Za-z]:", name):
        return False
    return ".." not in name.split("/")


class _Archive:
    def __init__(self, data: bytes, limits: EpubLimits) -> None:
        self.limits = limits
        try:
            self.zip = zipfile.ZipFile(io.BytesIO(data))
            infos = self.zip.infolist()
        except (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, EOFError):
            raise BookError("not an EPUB: the file is not a zip archive") from None
        if len(infos) > limits.max_members:
            raise BookError(f"the EPUB has {len(infos):,} files; at most {limits.max_members:,} are read")
        total = 0
        self.infos: dict[str, zipfile.ZipInfo] = {}
        for info in infos:
            if not _safe_name(info.filename):
                raise BookError(
                    f"the EPUB holds an unsafe file name {info.filename[:200]!r} (absolute, or climbing out with ..)"
                )
            if info.flag_bits & 0x1:
                raise BookError(f"the EPUB's file {info.filename[:200]!r} is password-encrypted")
            size = info.file_size
            if size > limits.max_member_bytes:
                raise BookError(
                    f"the EPUB's file {info.filename[:200]!r} unpacks to {size:,} bytes; at most "
                    f"{limits.max_member_bytes:,} are read (a zip bomb?)"
                )
            if size > 1024 * 1024 and size > limits.max_ratio * max(info.compress_size, 1):
                raise BookError(
                    f"the EPUB's file {info.filename[:200]!r} is compressed {size // max(info.compress_size, 1):,} "
                    f"to 1 (at most {limits.max_ratio} to 1: a zip bomb?)"
                )
            total += size
            if not info.is_dir():
                self.infos[info.filename] = info
        if total > limits.max_total_bytes:
            raise BookError(
                f"the EPUB unpacks to {total:,} bytes; at most {limits.max_total_bytes:,} are read (a zip bomb?)"
            )
        self._read_total = 0

    def has(self, name: str) -> bool:
        return name in self.infos

    def read(self, name: str) -> bytes:
        info = self.infos.get(name)
        if info is None:
            raise BookError(f"the EPUB names a file it does not hold: {name[:200]!r}")
        try:
            with self.zip.open(info) as member:
                data = member.read(info.file_size + 1)
        except (zipfile.BadZipFile, zlib.error, OSError, EOFError, ValueError, NotImplementedError) as exc:
            raise BookError(f"the EPUB's file {name[:200]!r} cannot be unpacked: {exc}") from None
        if len(data) > info.file_size:  # a header that lies about the size
            raise BookError(
                f"the EPUB's file {name[:200]!r} is larger than its zip header says (a zip bomb?)"
            )
        self._read_total += len(data)
        if self._read_total > self.limits.max_total_bytes:
            raise BookError(
                f"the EPUB unpacks to more than {self.limits.max_total_bytes:,} bytes (a zip bomb?)"
            )
        return data

    def xml(self, name: str) -> etree._Element:
        return parse_xml(self.read(name), name)

    def refuse_drm(self) -> None:
        for member in _DRM_MEMBERS:
            if self.has(member):
                raise BookError(
                    f"the EPUB is DRM-protected ({member} is there): only DRM-free books can be read"
                )
        if not self.has("META-INF/encryption.xml"):
            return
        root = self.xml("META-INF/encryption.xml")
        for method in root.iter(f"{{{_NS['enc']}}}EncryptionMethod"):
            algorithm = method.get("Algorithm", "")
            if algorithm not in _FONT_OBFUSCATION:
                raise BookError(
                    "the EPUB is DRM-protected (its META-INF/encryption.xml encrypts content with "
                    f"{algorithm[:100] or 'an unnamed algorithm'}): only DRM-free books can be read"
                )

    def rootfile(self) -> str:
        if not self.has("META-INF/container.xml"):
            raise BookError("not an EPUB: META-INF/container.xml is missing")
        root = self.xml("META-INF/container.xml")
        for rootfile in root.iter(f"{{{_NS['c']}}}rootfile"):
            path = rootfile.get("full-path", "")
            if rootfile.get("media-type", "application/oebps-package+xml") == "application/oebps-package+xml":
                if not _safe_name(path) or not self.has(path):
                    raise BookError(f"the EPUB's package document {path[:200]!r} is missing")
                return path
        raise BookError("not an EPUB: META-INF/container.xml names no package document")


_ENTITY_DECLARATION = re.compile(rb"<!ENTITY", re.IGNORECASE)
_XML_PARSER = etree.XMLParser(
    resolve_entities=False, no_network=True, load_dtd=False, dtd_validation=False, huge_tree=False
)


def _refuse_entities(data: bytes, name: str) -> None:
    text = data
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        text = data.decode("utf-16", "replace").encode()
    if _ENTITY_DECLARATION.search(text):
        raise BookError(
            f"the EPUB's {name[:200]!r} declares XML entities, which are refused (entity expansion)"
        )


def parse_xml(data: bytes, name: str) -> etree._Element:
    """A package-level XML document (container, OPF, NCX, encryption), parsed without trusting it."""
    _refuse_entities(data, name)
    try:
        return etree.fromstring(data, _XML_PARSER)
    except etree.XMLSyntaxError as exc:
        raise BookError(f"the EPUB's {name[:200]!r} is not well-formed XML: {exc}") from None


_XML_ENCODING = re.compile(rb"""^\s*<\?xml[^>]*?encoding\s*=\s*["']([A-Za-z0-9._-]{1,40})["']""")
_META_CHARSET = re.compile(rb"""<meta[^>]*?charset\s*=\s*["']?([A-Za-z0-9._-]{1,40})""", re.IGNORECASE)


def _encoding_of(data: bytes) -> str:
    """A content document's encoding: its byte-order mark; UTF-8 if it reads as UTF-8 (as EPUB
    requires, whatever an old declaration says); else its XML declaration or <meta charset>; else
    UTF-8 (libxml2's HTML parser would guess Latin-1 and garble the text)."""
    if data.startswith(b"\xef\xbb\xbf"):
        return "utf-8"
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        return "utf-16"
    if b"\x00" not in data:  # (UTF-16 without its mark has NULs, which are valid UTF-8)
        with contextlib.suppress(UnicodeDecodeError):
            data.decode("utf-8")
            return "utf-8"
    declared = _XML_ENCODING.match(data) or _META_CHARSET.search(data[:2048])
    if declared:
        with contextlib.suppress(LookupError):
            return codecs.lookup(declared[1].decode("ascii")).name
    return "utf-8"


def parse_html(data: bytes, name: str) -> etree._Element:
    """A content document (XHTML), parsed leniently as reading systems do (named HTML entities)."""
    _refuse_entities(data, name)
    parser = html.HTMLParser(no_network=True, huge_tree=False, encoding=_encoding_of(data))
    try:
        root = html.document_fromstring(data, parser=parser)
    except (etree.ParserError, ValueError) as exc:
        raise BookError(f"the EPUB's {name[:200]!r} cannot be read as XHTML: {exc}") from None
    # past its limits (256 levels of nesting, 10 MB of text in one piece) libxml2 drops the rest of
    # the page without a word: refused, rather than narrated in part
    if limit := next((e for e in parser.error_log if e.type_name == "ERR_RESOURCE_LIMIT"), None):
        raise BookError(f"the EPUB's {name[:200]!r} cannot be read whole ({limit.message.split(',')[0]})")
    return root


# --- the package document ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Entry:
    """A table of contents entry: its title and where it points (a content document, an element id)."""

    title: str
    path: str
    fragment: str | None


@dataclass(frozen=True, slots=True)
class _Item:
    path: str
    media_type: str
    properties: frozenset[str]


#: ISO 639-1 -> ISO 639-2/T for the languages books come in most (a tag, not a lookup service).
_ISO639_2 = {
    "ar": "ara", "bg": "bul", "ca": "cat", "cs": "ces", "cy": "cym", "da": "dan", "de": "deu", "el": "ell",
    "en": "eng", "eo": "epo", "es": "spa", "et": "est", "eu": "eus", "fa": "fas", "fi": "fin", "fr": "fra",
    "ga": "gle", "gl": "glg", "he": "heb", "hi": "hin", "hr": "hrv", "hu": "hun", "id": "ind", "is": "isl",
    "it": "ita", "ja": "jpn", "ko": "kor", "la": "lat", "lt": "lit", "lv": "lav", "nb": "nob", "nl": "nld",
    "nn": "nno", "no": "nor", "pl": "pol", "pt": "por", "ro": "ron", "ru": "rus", "sk": "slk", "sl": "slv",
    "sr": "srp", "sv": "swe", "th": "tha", "tr": "tur", "uk": "ukr", "vi": "vie", "zh": "zho",
}  # fmt: skip


def iso639_2(code: str) -> str:
    """A BCP 47 language tag's language as ISO 639-2 ("en-GB" -> "eng"); "" if not known."""
    primary = code.strip().split("-")[0].split("_")[0].lower()
    if len(primary) == 3 and primary.isascii() and primary.isalpha():
        return primary
    return _ISO639_2.get(primary, "")


def _text(element: etree._Element | None) -> str:
    return " ".join("".join(element.itertext()).split()) if element is not None else ""


class _Package:
    def __init__(self, archive: _Archive, opf_path: str) -> None:
        self.archive = archive
        self.path = opf_path
        self.base = posixpath.dirname(opf_path)
        root = archive.xml(opf_path)
        self.version = root.get("version", "")
        metadata = root.find("opf:metadata", _NS)
        self.items: dict[str, _Item] = {}
        manifest = root.find("opf:manifest", _NS)
        for item in manifest.iter(f"{{{_NS['opf']}}}item") if manifest is not None else ():
            href = item.get("href")
            if not item.get("id") or not href:
                continue
            path = self.resolve(self.base, href)
            if path is None:
                continue
            self.items[item.get("id")] = _Item(
                path, item.get("media-type", ""), frozenset(item.get("properties", "").split())
            )
        spine = root.find("opf:spine", _NS)
        if spine is None or not len(spine.findall("opf:itemref", _NS)):
            raise BookError("the EPUB has no spine: its package document gives no reading order")
        self.spine: list[str] = []  # content documents in reading order (the linear ones)
        for ref in spine.findall("opf:itemref", _NS):
            item = self.items.get(ref.get("idref", ""))
            if item is None or item.media_type not in _CONTENT_TYPES or ref.get("linear", "yes") == "no":
                continue  # non-linear documents (pop-up notes, answers) are not read in order
            if item.path not in self.spine:
                self.spine.append(item.path)
        if not self.spine:
            raise BookError("the EPUB's spine names no content document that can be read")
        self.ncx = self.items.get(spine.get("toc", ""))
        self.guide: dict[str, str] = {}  # path[#fragment] -> type (EPUB 2)
        guide = root.find("opf:guide", _NS)
        for ref in guide.findall("opf:reference", _NS) if guide is not None else ():
            if (path := self.resolve(self.base, ref.get("href", ""), keep_fragment=True)) is not None:
                self.guide[path] = ref.get("type", "").lower().replace("title-page", "titlepage")
        self.title = self._title(metadata)
        self.author = self._author(metadata)
        language = metadata.find("dc:language", _NS) if metadata is not None else None
        self.language = iso639_2(_text(language))
        self._metadata = metadata

    @staticmethod
    def resolve(base: str, href: str, keep_fragment: bool = False) -> str | None:
        """An href of a document in ``base`` as an archive path (None: outside the archive, or a URL)."""
        parts = urlsplit(href)
        if parts.scheme or parts.netloc:
            return None
        path = unquote(parts.path)
        if not path:
            return None
        joined = posixpath.normpath(posixpath.join(base, path)) if base else posixpath.normpath(path)
        if joined.startswith("../") or joined == ".." or joined.startswith("/"):
            raise BookError(f"the EPUB points outside its archive: {href[:200]!r}")
        if keep_fragment and parts.fragment:
            return f"{joined}#{unquote(parts.fragment)}"
        return joined

    def _title(self, metadata) -> str:
        if metadata is None:
            return ""
        return _text(metadata.find("dc:title", _NS))[:500]

    def _author(self, metadata) -> str:
        if metadata is None:
            return ""
        creators = metadata.findall("dc:creator", _NS)
        roles = {}
        for meta in metadata.findall("opf:meta", _NS):  # EPUB 3: <meta refines="#id" property="role">aut
            if meta.get("property") == "role" and (target := meta.get("refines", "")).startswith("#"):
                roles[target[1:]] = _text(meta)
        authors = []
        for creator in creators:
            role = creator.get(f"{{{_NS['opf']}}}role") or roles.get(creator.get("id", ""), "aut")
            if role == "aut" and (name := _text(creator)):
                authors.append(name)
        if not authors and creators:
            authors = [_text(creators[0])]
        return ", ".join(authors)[:500]

    def cover(self, max_bytes: int) -> bytes | None:
        """The cover picture (EPUB 3 ``cover-image``, EPUB 2 ``<meta name="cover">``), if it is a PNG or
        JPEG of at most ``max_bytes``; a book whose cover cannot be used is still read."""
        item = next((i for i in self.items.values() if "cover-image" in i.properties), None)
        if item is None and self._metadata is not None:
            for meta in self._metadata.findall("opf:meta", _NS):
                if meta.get("name") == "cover":
                    item = self.items.get(meta.get("content", ""))
        if item is None or item.media_type not in _COVER_TYPES or not self.archive.has(item.path):
            return None
        if self.archive.infos[item.path].file_size > max_bytes:
            return None
        return self.archive.read(item.path)

    # --- the table of contents ---

    def table_of_contents(self) -> tuple[list[_Entry], dict[str, str]]:
        """(the entries, in document order of the TOC; the matter types landmarks/guide give paths)."""
        matter = dict(self.guide)
        nav = next((i for i in self.items.values() if "nav" in i.properties), None)
        entries: list[_Entry] = []
        if nav is not None and self.archive.has(nav.path):
            entries, landmarks = self._nav(nav.path)
            matter.update(landmarks)
            matter.setdefault(nav.path, "toc")
        if not entries and self.ncx is not None and self.archive.has(self.ncx.path):
            entries = self._ncx(self.ncx.path)
        return [e for e in entries if e.path in self.spine], matter

    def _nav(self, path: str) -> tuple[list[_Entry], dict[str, str]]:
        root = parse_html(self.archive.read(path), path)
        base = posixpath.dirname(path)
        entries: list[_Entry] = []
        landmarks: dict[str, str] = {}
        navs = root.iter("nav")
        toc = None
        for nav in navs:
            types = nav.get("epub:type", "").split()
            if "toc" in types and toc is None:
                toc = nav
            elif "landmarks" in types:
                for a in nav.iter("a"):
                    target = self.resolve(base, a.get("href", ""), keep_fragment=True)
                    if target and (kind := a.get("epub:type", "").split()):
                        landmarks[target] = kind[0].lower()
        if toc is None:
            toc = next(root.iter("nav"), None)
        if toc is None:
            return [], landmarks
        for li in toc.iter("li"):
            label = next((c for c in li if c.tag in ("a", "span")), None)
            if label is None or label.tag != "a" or not label.get("href"):
                continue  # a heading of a group with no target of its own
            target = self.resolve(base, label.get("href"), keep_fragment=True)
            if target:
                entries.append(_entry(_text(label), target))
        return entries, landmarks

    def _ncx(self, path: str) -> list[_Entry]:
        root = self.archive.xml(path)
        base = posixpath.dirname(path)
        entries = []
        nav_map = root.find("ncx:navMap", _NS)
        for point in nav_map.iter(f"{{{_NS['ncx']}}}navPoint") if nav_map is not None else ():
            label = point.find("ncx:navLabel/ncx:text", _NS)
            content = point.find("ncx:content", _NS)
            if content is None or not content.get("src"):
                continue
            target = self.resolve(base, content.get("src"), keep_fragment=True)
            if target:
                entries.append(_entry(_text(label), target))
        return entries


def _entry(title: str, target: str) -> _Entry:
    path, _, fragment = target.partition("#")
    return _Entry(title[:500], path, fragment or None)


# --- the content documents ----------------------------------------------------------------------------

_BLOCK_TAGS = frozenset(
    [
        "p",
        "div",
        "section",
        "article",
        "aside",
        "header",
        "footer",
        "main",
        "blockquote",
        "h1",
        "h2",
        "h3",
        "h4",
        "h5",
        "h6",
        "li",
        "ul",
        "ol",
        "dl",
        "dt",
        "dd",
        "figure",
        "figcaption",
        "table",
        "thead",
        "tbody",
        "tfoot",
        "tr",
        "pre",
        "address",
        "hr",
        "body",
        "center",
    ]
)
_HEADINGS = frozenset(["h1", "h2", "h3", "h4", "h5", "h6"])
_SKIPPED_TAGS = frozenset(
    [
        "head",
        "script",
        "style",
        "template",
        "svg",
        "math",
        "audio",
        "video",
        "object",
        "embed",
        "iframe",
        "noscript",
        "input",
        "button",
        "select",
        "textarea",
        "rt",
        "rp",
        "nav",
        "canvas",
        "map",
    ]
)
#: epub:type / role values whose element is not read (notes, their markers, page numbers).
_SKIPPED_TYPES = frozenset(
    [
        "noteref",
        "footnote",
        "footnotes",
        "endnote",
        "endnotes",
        "rearnote",
        "rearnotes",
        "annoref",
        "annotation",
        "pagebreak",
        "page-list",
        "backlink",
        "doc-noteref",
        "doc-footnote",
        "doc-endnote",
        "doc-endnotes",
        "doc-pagebreak",
        "doc-backlink",
    ]
)
#: Classes of note sections where a book has no epub:type (EPUB 2: pandoc, Calibre, InDesign).
_NOTE_CLASSES = frozenset({"footnotes", "endnotes", "footnote", "endnote"})
_NOTE_MARKER = re.compile(r"^\W{0,2}(\d{1,4}|[ivxlc]{1,6}|[*†‡§¶]+)\W{0,2}$", re.IGNORECASE)
#: Matter an element's epub:type (or a landmark) can name: what BookChapter.matter holds.
_MATTER_TYPES = {
    "cover": "cover",
    "titlepage": "titlepage",
    "halftitlepage": "titlepage",
    "copyright-page": "copyright-page",
    "toc": "toc",
    "index": "index",
    "colophon": "colophon",
    "imprint": "imprint",
    "loi": "loi",
    "lot": "lot",
    "landmarks": "landmarks",
}
_MATTER_TITLES = {
    "cover": "cover",
    "title page": "titlepage",
    "copyright": "copyright-page",
    "copyright page": "copyright-page",
    "contents": "toc",
    "table of contents": "toc",
    "index": "index",
    "colophon": "colophon",
}


def _norm(text: str) -> str:
    return "".join(ch for ch in text.casefold() if ch.isalnum())


def _skipped(element: etree._Element, alt_text: bool) -> bool:
    tag = element.tag if isinstance(element.tag, str) else ""
    if tag in _SKIPPED_TAGS:
        return True
    types = set(element.get("epub:type", "").split()) | set(element.get("role", "").split())
    if types & _SKIPPED_TYPES:
        return True
    if element.get("hidden") is not None or element.get("aria-hidden", "").lower() == "true":
        return True
    if "display:none" in element.get("style", "").replace(" ", "").lower():
        return True
    if set(element.get("class", "").split()) & _NOTE_CLASSES:
        return True
    return tag in ("sup", "a") and _is_note_marker(element)


def _is_note_marker(element: etree._Element) -> bool:
    """A footnote marker without epub:type: a superscript or an in-book link whose text is a number or
    a symbol (``<sup><a href="#fn3">3</a></sup>``, ``<a href="notes.xhtml#n3"><sup>[3]</sup></a>``)."""
    text = " ".join("".join(element.itertext()).split())
    if not text or not _NOTE_MARKER.match(text):
        return False
    if element.tag == "sup":
        return True
    href = element.get("href", "")
    return "#" in href and not urlsplit(href).scheme


class _Walker:
    """Walks the spine's documents in order, cutting chapters where the table of contents points."""

    def __init__(self, archive: _Archive, package: _Package, toc, *, alt_text: bool) -> None:
        self.archive = archive
        self.package = package
        self.entries, self.matter = toc
        self.alt_text = alt_text
        self._chapters: list[dict] = []
        self._paragraph: list[str] = []
        self._paragraph_heading = False
        self._notes: set[str] = set()  # "path#id" of the notes that dropped markers point to

    def chapters(self) -> list[BookChapter]:
        by_path: dict[str, list[_Entry]] = {}
        for entry in self.entries:
            by_path.setdefault(entry.path, []).append(entry)
        for path in self.package.spine:
            root = parse_html(self.archive.read(path), path)
            ids = {el.get("id") for el in root.iter() if isinstance(el.tag, str) and el.get("id")}
            here = by_path.get(path, [])
            # entries pointing at the document, or at an element it does not have, start with it
            at_start = [e for e in here if e.fragment is None or e.fragment not in ids]
            anchors: dict[str, list[_Entry]] = {}
            for e in here:
                if e.fragment is not None and e.fragment in ids:
                    anchors.setdefault(e.fragment, []).append(e)
            if at_start:
                self._start(at_start, path, root.find("body"))
            elif not self.entries or not self._chapters:
                self._start_unlisted(root, path)  # no TOC: each document; else: before the first entry
            body = root.find("body")
            self._walk(body if body is not None else root, path, anchors)
            self._flush()
        return self._finish()

    # --- chapters ---

    def _start(self, entries: list[_Entry], path: str, element) -> None:
        """Chapters begin here (several entries at one place: all but the last are titles alone)."""
        self._flush()
        for entry in entries:
            matter = self.matter.get(f"{path}#{entry.fragment}" if entry.fragment else path, "")
            if not matter and entry.fragment is None:
                matter = self.matter.get(path, "")
            matter = (
                matter
                or _element_matter(element)
                or _MATTER_TITLES.get(" ".join(entry.title.casefold().split()), "")
            )
            self._chapters.append(
                {"title": entry.title, "paragraphs": [], "matter": _MATTER_TYPES.get(matter, ""), "path": path}
            )

    def _start_unlisted(self, root, path: str) -> None:
        self._flush()
        matter = _MATTER_TYPES.get(self.matter.get(path, ""), "") or _element_matter(root.find("body"))
        title = _text(next(root.iter(*_HEADINGS), None)) or _text(root.find(".//title"))
        if self.entries:  # before the table of contents' first entry: cover, title page, ...
            matter = matter or "unlisted"
        self._chapters.append({"title": title[:500], "paragraphs": [], "matter": matter, "path": path})

    # --- text ---

    def _walk(self, element, path: str, anchors: dict[str, list[_Entry]]) -> None:
        if not isinstance(element.tag, str):
            return  # a comment or processing instruction (its tail is read by the parent)
        tag = element.tag
        if (eid := element.get("id")) and eid in anchors:
            self._start(anchors.pop(eid), path, element)
        if tag == "img":
            if self.alt_text and (alt := " ".join(element.get("alt", "").split())):
                self._flush()
                self._paragraph.append(alt)
                self._flush()
            return
        if eid and f"{path}#{eid}" in self._notes:
            return  # the note a dropped marker points to (EPUB 2 books mark notes no other way)
        if tag == "hr" and not _skipped(element, self.alt_text):
            self._flush()
            chapter = self._chapters[-1] if self._chapters else None
            if chapter is not None and chapter["paragraphs"] and chapter["paragraphs"][-1] != SCENE_BREAK:
                chapter["paragraphs"].append(SCENE_BREAK)  # a scene break (a pause), never at a chapter's start
            return
        if _skipped(element, self.alt_text):
            if tag in ("a", "sup"):
                for a in element.iter("a"):
                    target = self.package.resolve(
                        posixpath.dirname(path), a.get("href", ""), keep_fragment=True
                    )
                    if target and "#" in target:
                        self._notes.add(target)
                    elif a.get("href", "").startswith("#"):
                        self._notes.add(f"{path}{a.get('href')}")
            return
        block = tag in _BLOCK_TAGS
        if block:
            self._flush()
            self._paragraph_heading = tag in _HEADINGS
        if tag == "br":
            self._paragraph.append(" ")
        if element.text:
            self._paragraph.append(element.text)
        for child in element:
            self._walk(child, path, anchors)
            if child.tail:
                self._paragraph.append(child.tail)
        if block:
            self._flush()

    def _flush(self) -> None:
        text = " ".join("".join(self._paragraph).split())
        heading = self._paragraph_heading
        self._paragraph = []
        self._paragraph_heading = False
        if not text or not any(ch.isalnum() for ch in text):
            return
        if not self._chapters:
            self._chapters.append({"title": "", "paragraphs": [], "matter": "unlisted", "path": ""})
        chapter = self._chapters[-1]
        if heading and not chapter["paragraphs"] and any(_same_title(text, t) for t in self._just_started()):
            return  # the chapter's own heading: its title is spoken once, as the chapter's heading
        chapter["paragraphs"].append(text)

    def _just_started(self):
        """The titles of the chapters at the end that have no text yet (entries starting together,
        such as "Part Two" and its "Chapter 3")."""
        for chapter in reversed(self._chapters):
            if chapter["paragraphs"]:
                return
            yield chapter["title"]

    def _finish(self) -> list[BookChapter]:
        out: list[BookChapter] = []
        for c, after in zip(self._chapters, [*self._chapters[1:], None], strict=True):
            if not c["title"] and not c["paragraphs"]:
                continue
            if c["matter"] == "unlisted" and not c["paragraphs"] and after and after["path"] == c["path"]:
                continue  # nothing before the first entry, an anchor further in the same document
            out.append(BookChapter(len(out) + 1, c["title"], tuple(c["paragraphs"]), c["matter"]))
        # a title page (EPUB 2 books rarely mark it): the book's title as a short first chapter
        first = next((i for i, c in enumerate(out) if not c.matter), None)
        if first is not None and _titles_the_book(out[first].title, self.package.title) and out[first].chars < 300:
            c = out[first]
            out[first] = BookChapter(c.number, c.title, c.paragraphs, "titlepage")
        return out


def _element_matter(element) -> str:
    """The matter an element (or its section/body ancestors) says it is (epub:type)."""
    while element is not None and isinstance(element.tag, str):
        for kind in element.get("epub:type", "").split():
            if kind.lower() in _MATTER_TYPES:
                return kind.lower()
        element = element.getparent()
    return ""


def _titles_the_book(heading: str, book_title: str) -> bool:
    """A title page's heading: the book's title, perhaps with more after it (not a chapter "1" of
    "Sea Stories, Volume 1")."""
    a, b = _norm(heading), _norm(book_title)
    return bool(b) and a.startswith(b)


def _same_title(heading: str, title: str) -> bool:
    a, b = _norm(heading), _norm(title)
    return bool(a and b) and (a == b or a.endswith(b) or b.endswith(a))
