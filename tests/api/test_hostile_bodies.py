"""Bodies that once gave a 500: JSON nested past the parser's depth, form fields that look like
numbers, an EPUB whose compressed data is corrupt. Each is a 4xx that says what is wrong, and
nothing is stored."""

from __future__ import annotations

import base64
import io
import zipfile

from testing.epubkit import sample_book

DEEP = "[" * 100_000 + "]" * 100_000
JSON = {"content-type": "application/json"}


def corrupt_deflate(book: bytes, suffix: str) -> bytes:
    """``book`` with the deflated bytes of its member ending in ``suffix`` flipped (header intact)."""
    raw = bytearray(book)
    info = next(i for i in zipfile.ZipFile(io.BytesIO(book)).infolist() if i.filename.endswith(suffix))
    assert info.compress_type == zipfile.ZIP_DEFLATED
    start = info.header_offset + 30 + len(info.filename.encode()) + len(info.extra)
    for k in range(start + 2, start + min(info.compress_size, 40)):
        raw[k] ^= 0xFF
    return bytes(raw)


def test_json_nested_too_deep_is_a_400(api):
    async def scenario(a):
        c = a.client
        out = [await c.post(path, content=DEEP, headers=JSON) for path in ("/v1/jobs", "/v1/books/contents", "/v1/audio/speech")]
        form = await c.post("/v1/jobs", files={"file": ("a.txt", b"Hi.", "text/plain")}, data={"lexicon": DEEP})
        return out, form, await a.keys()

    out, form, keys = api(scenario)
    assert [r.status_code for r in out] == [400, 400, 400]
    assert form.status_code == 422 and "lexicon: a JSON list of entries" in form.json()["detail"]
    assert keys == []


def test_form_fields_that_look_like_numbers(api):
    async def scenario(a):
        c = a.client
        book = {"file": ("b.epub", sample_book(3), "application/epub+zip")}
        superscript = await c.post("/v1/jobs", files=book, data={"chapters": "²"})
        huge = await c.post("/v1/jobs", files=book, data={"chapters": "9" * 5000})
        assert (await c.put("/v1/lexicons/2024", json={"entries": [{"match": "Bob", "say": "Robert"}]})).status_code == 201
        named = await c.post("/v1/jobs", files={"file": ("a.txt", b"Hi Bob.", "text/plain")}, data={"lexicons": "2024"})
        return superscript, huge, named

    superscript, huge, named = api(scenario)
    assert superscript.status_code == 422 and "no chapter '²'" in superscript.json()["detail"]
    assert huge.status_code == 422
    assert named.status_code == 202, named.text  # a lexicon named "2024" is a name, as in JSON


def test_an_epub_with_corrupt_compressed_data_is_a_422(api):
    bad = corrupt_deflate(sample_book(3), ".opf")

    async def scenario(a):
        c = a.client
        source = {"kind": "epub", "data": base64.b64encode(bad).decode()}
        contents = await c.post("/v1/books/contents", json={"source": source})
        job = await c.post("/v1/jobs", files={"file": ("b.epub", bad, "application/epub+zip")})
        return contents, job, await a.keys()

    contents, job, keys = api(scenario)
    for r in (contents, job):
        assert r.status_code == 422 and "cannot be unpacked" in r.json()["detail"], r.text
    assert keys == []
