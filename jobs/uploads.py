"""An uploaded file -> what a job narrates: an EPUB's ``Book``, or the text of a .txt or .md file.

The kind comes from what the client says (a JSON ``source.kind``, a part's content type or file
name), checked against the bytes: a zip that is not an EPUB, or an EPUB sent as text, is refused
with the reason. Everything here is CPU work on untrusted bytes: callers run it off the event loop.
"""

from __future__ import annotations

from dataclasses import dataclass

from fleet.settings import Settings
from jobs.books import Book, is_markdown_name, read_text_file
from jobs.epub import EpubLimits, read_epub
from jobs.errors import InvalidRequest, TooLarge, UnsupportedFile

KINDS = ("epub", "text", "markdown")
_EPUB_TYPES = frozenset({"application/epub+zip"})


@dataclass(frozen=True, slots=True)
class Upload:
    data: bytes
    name: str = ""
    #: "epub", "text", "markdown", or "" to tell by the content type and name.
    kind: str = ""
    content_type: str = ""


def kind_of(upload: Upload) -> str:
    """The upload's kind, from what the client says; refuses what cannot be told or read."""
    if upload.kind:
        if upload.kind not in KINDS:
            raise InvalidRequest(f"source kind {upload.kind[:40]!r} is not one of {', '.join(KINDS)}")
        return upload.kind
    media = upload.content_type.split(";")[0].strip().lower()
    name = upload.name.lower()
    if media in _EPUB_TYPES or name.endswith(".epub"):
        return "epub"
    if media in ("text/markdown", "text/x-markdown") or is_markdown_name(name):
        return "markdown"
    if media == "text/plain" or name.endswith(".txt"):
        return "text"
    if upload.data.startswith(b"PK\x03\x04"):
        return "epub"  # told by its bytes: read_epub says if it is not one
    raise UnsupportedFile(
        f"the file {upload.name[:100]!r} ({media or 'no content type'}) is not a kind this service reads: "
        "send an EPUB (.epub), plain text (.txt) or Markdown (.md)"
    )


def read_upload(upload: Upload, settings: Settings, *, alt_text: bool = False) -> Book | tuple[str, bool]:
    """The upload's book (EPUB) or (text, is Markdown)."""
    if len(upload.data) > settings.max_upload_bytes:
        raise TooLarge(
            f"the file has {len(upload.data):,} bytes; this fleet reads files of at most {settings.max_upload_bytes:,}"
        )
    if not upload.data:
        raise InvalidRequest("the file is empty")
    kind = kind_of(upload)
    if kind == "epub":
        return read_epub(upload.data, EpubLimits.from_settings(settings), alt_text=alt_text)
    if upload.data.startswith(b"PK\x03\x04"):
        raise InvalidRequest(
            f"the file {upload.name[:100]!r} is a zip archive, not {kind}: send an EPUB as .epub"
        )
    return read_text_file(upload.data, upload.name), kind == "markdown"
