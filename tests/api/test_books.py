"""Books through the API, in-process: an EPUB as a multipart upload or a JSON source, chapter
selections, text files, the contents listing, and every refusal with its status, writing nothing."""

from __future__ import annotations

import base64

import pytest

from fleet.names import Names
from jobs.segmentation import Plan
from jobs.store import JobStore
from testing.epubkit import sample_book
from tests.jobs.test_epub import BODY, _with

EPUB = sample_book(3)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


async def plan_of(a, job_id: str) -> Plan:
    store = JobStore.for_settings(a.redis, a.settings)
    return await store.plan(job_id)


def test_an_epub_upload_is_narrated_by_chapter_with_the_books_tags(api):
    async def scenario(a):
        r = await a.client.post(
            "/v1/jobs",
            files={"file": ("novel.epub", EPUB, "application/epub+zip")},
            data={"format": "m4b", "seed": "7", "chapter_files": "true"},
        )
        assert r.status_code == 202, r.text
        job = await a.redis.hgetall(Names("t").job(r.json()["id"]))
        return r.json(), job, await plan_of(a, r.json()["id"])

    body, job, plan = api(scenario)
    assert [c.title for c in plan.chapters] == BODY and body["chapters"] == 5
    assert (job[b"title"], job[b"author"], job[b"language"], job[b"cover"]) == (
        b"A Test Book", b"Ada Writer", b"eng", b"image/png"
    )  # fmt: skip
    assert (job[b"seed"], job[b"chapter_files"]) == (b"7", b"1")  # form strings read as their fields' types


def test_a_json_source_and_a_chapter_selection(api):
    async def scenario(a):
        r = await a.client.post(
            "/v1/jobs",
            json={
                "source": {"kind": "epub", "data": b64(EPUB), "name": "novel.epub"},
                "chapters": [7, "Chapter 1: The Ship"],
            },
        )
        assert r.status_code == 202, r.text
        form = await a.client.post(
            "/v1/jobs",
            files={"file": ("novel.epub", EPUB, "application/epub+zip")},
            data={"chapters": "2, Part Two"},
        )
        assert form.status_code == 202, form.text
        return await plan_of(a, r.json()["id"]), await plan_of(a, form.json()["id"])

    plan, form_plan = api(scenario)
    assert [c.title for c in plan.chapters] == ["Chapter 1: The Ship", "Chapter 3: Home"]
    assert [c.title for c in form_plan.chapters] == ["Copyright", "Part Two"]  # skipped matter, when named


def test_text_and_markdown_files_are_uploaded_the_same_way(api):
    async def scenario(a):
        md = await a.client.post(
            "/v1/jobs",
            files={"file": ("book.md", b"# One\n\nHello there.\n\n# Two\n\nBye.", "text/markdown")},
        )
        txt = await a.client.post(
            "/v1/jobs",
            files={
                "file": (
                    "notes.txt",
                    "\ufeffCaf\u00e9 society.\n\n# Not a heading here.".encode(),
                    "text/plain",
                )
            },
        )
        src = await a.client.post(
            "/v1/jobs", json={"source": {"kind": "markdown", "data": b64(b"# Only\n\nText.")}}
        )
        assert md.status_code == txt.status_code == src.status_code == 202, (md.text, txt.text, src.text)
        return [await plan_of(a, r.json()["id"]) for r in (md, txt, src)]

    md, txt, src = api(scenario)
    assert [c.title for c in md.chapters] == ["One", "Two"]
    assert [s.text for s in txt.segments] == [
        "Café society.",
        "# Not a heading here.",
    ]  # plain text: no markup
    assert [c.title for c in txt.chapters] == [""]
    assert [c.title for c in src.chapters] == ["Only"]


def test_the_contents_listing_numbers_chapters_as_selections_take_them(api):
    async def scenario(a):
        form = await a.client.post(
            "/v1/books/contents", files={"file": ("novel.epub", EPUB, "application/epub+zip")}
        )
        js = await a.client.post("/v1/books/contents", json={"source": {"kind": "epub", "data": b64(EPUB)}})
        return form, js, await a.keys()

    form, js, keys = api(scenario)
    assert form.status_code == js.status_code == 200 and form.json() == js.json()
    listing = form.json()
    assert (listing["title"], listing["author"], listing["language"], listing["cover"]) == (
        "A Test Book",
        "Ada Writer",
        "eng",
        True,
    )
    assert [(c["number"], c["title"], c["narrated_by_default"]) for c in listing["chapters"]][1:4] == [
        (2, "Copyright", False),
        (3, "Part One", True),
        (4, "Chapter 1: The Ship", True),
    ]
    assert keys == []  # nothing stored


@pytest.mark.parametrize(
    ("send", "status", "says"),
    [
        (dict(files={"file": ("novel.epub", b"PK\x03\x04 not really", "application/epub+zip")}), 422, "not a zip archive"),
        (dict(files={"file": ("x.epub", _with(EPUB, add={"../up.xhtml": b"x"}), "application/epub+zip")}), 422, "unsafe file name"),
        (dict(files={"file": ("x.epub", _with(EPUB, add={"META-INF/rights.xml": b"<r/>"}), "application/epub+zip")}), 422, "DRM-protected"),
        (dict(files={"file": ("x.epub", EPUB, "application/epub+zip")}, data={"chapters": "99"}), 422, "no chapter 99 in this book"),
        (dict(files={"file": ("scan.pdf", b"%PDF-1.7", "application/pdf")}), 415, "send an EPUB (.epub), plain text (.txt) or Markdown (.md)"),
        (dict(files={"file": ("latin1.txt", "caf\u00e9".encode("latin-1"), "text/plain")}), 422, "is not UTF-8 text"),
        (dict(files={"file": ("book.txt", b"PK\x03\x04zip", "text/plain")}), 422, "is a zip archive, not text"),
        (dict(files={"file": ("a.md", b"# A\n\nHi.", "text/markdown")}, data={"chapters": "1"}), 422, "only a book (an EPUB) has chapters"),
        (dict(files={"upload": ("a.md", b"# A\n\nHi.", "text/markdown")}), 422, "name it 'file'"),
        (dict(data={"title": "no file"}, files={}), 422, "needs a file part named 'file'"),
        (dict(json={"text": "Hi.", "source": {"kind": "text", "data": b64(b"Hi.")}}), 422, "send either text or a source"),
        (dict(json={"title": "nothing"}), 422, "send either text or a source"),
        (dict(json={"source": {"kind": "epub", "data": "!!"}}), 422, "source.data is not base64"),
        (dict(json={"text": "Hi.", "chapters": [1]}), 422, "only a book"),
        (dict(files={"file": ("big.txt", b"a" * 3000, "text/plain")}), 413, "at most 2,048"),
        (dict(content=b"x", headers={"content-type": "application/epub+zip"}), 415, "application/json or multipart/form-data"),
    ],
    ids=["not-zip", "traversal", "drm", "bad-chapter", "pdf", "latin1", "zip-as-text", "chapters-of-text",
         "wrong-part", "no-file", "text-and-source", "neither", "bad-base64", "chapters-without-book", "too-big",
         "raw-epub-body"],
)  # fmt: skip
def test_a_refused_upload_says_why_and_writes_nothing(api, send, status, says):
    async def scenario(a):
        if "data" in send and not send.get("files"):  # a form with no file part: multipart all the same
            r = await a.client.post("/v1/jobs", files={"title": (None, "no file")})
        else:
            r = await a.client.post("/v1/jobs", **send)
        return r, await a.keys()

    r, keys = api(scenario, max_upload_bytes=2048 if status == 413 else 32 * 1024 * 1024)
    assert r.status_code == status and says in r.json()["detail"], r.text
    assert keys == []
