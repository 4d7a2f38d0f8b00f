"""The web page at / in a real browser (Debian's chromium, driven by Playwright) against a real fleet
(API, eSpeak NG speech workers, assembler, finalizer as processes on real Redis), over HTTP: a
3-chapter text submitted from the page, its progress followed to 100 % over SSE, listened to while it
renders, chapter 2 jumped to, the file downloaded, the job deleted; the page by keyboard and on a
phone's width; /docs and /redoc rendered, nothing asked of another host. Screenshots (the page once
its job is done, the docs, any failing test's last view) land in artifacts/ (git-ignored; or
$NARRATE_TEST_ARTIFACTS)."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import time
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import pytest

from models.espeak import unavailable_reason
from testing.fleetkit import BOOK, espeak_fleet, wait_done
from tests.conftest import require, require_module

require_module("playwright", "the web page's browser test drives chromium with Playwright")

from playwright.sync_api import Page, expect, sync_playwright  # noqa: E402

pytestmark = pytest.mark.integration

ROOT = Path(__file__).parents[2]
#: Where the screenshots go (CI keeps the work tree's artifacts/; it is git-ignored).
ARTIFACTS = Path(os.environ.get("NARRATE_TEST_ARTIFACTS", ROOT / "artifacts"))
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
PHONE = {"width": 390, "height": 844}
TITLE = "The Lighthouse, read in a browser"


#: How often each of BOOK's chapters is told: ~1,800 words a chapter, about 25 minutes of speech. One
#: eSpeak NG worker renders ~150x real time on a 2-core machine (measured: 387 segments, 14 minutes, in
#: 6 s), so this takes ~10 s; the page plays its first audio 1-2 s after submitting, and the test needs
#: one second of it heard while the job renders.
TELLINGS = 14


def three_chapters() -> str:
    """BOOK's three chapters (Markdown '# ' headings), each told ``TELLINGS`` times."""
    parts = re.split(r"(?m)^(# .+)$", BOOK)[1:]
    parts[2] = parts[2].replace("The Letter", "The Letter & its 2 < 3 > 1 seals")  # markup characters
    chapters = zip(parts[::2], parts[1::2], strict=True)
    return "\n\n".join(f"{heading}\n\n" + "\n\n".join([body.strip()] * TELLINGS) for heading, body in chapters)


@pytest.fixture(scope="module")
def fleet(redis_url, data_dir, tmp_path_factory):
    require(unavailable_reason() is None, f"eSpeak NG: {unavailable_reason()}")
    with espeak_fleet(redis_url, data_dir, tmp_path_factory.mktemp("web-logs"), "web") as running:
        yield running


@pytest.fixture(scope="module")
def browser():
    require(os.path.exists(CHROMIUM), "Debian's chromium (scripts/test.sh installs it: apt-get install chromium)")
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM,
            args=["--no-sandbox", "--autoplay-policy=no-user-gesture-required", "--mute-audio"],
        )
        yield browser
        browser.close()


class Offline:
    """A page on a phone-sized viewport whose every request is recorded: it must ask the fleet's host
    alone (the page must work on a machine without internet). Recorded, not intercepted: Playwright's
    request interception stalls a media element's streaming request."""

    def __init__(self, browser, base_url: str) -> None:
        self.host = urlparse(base_url).netloc
        self.context = browser.new_context(viewport=PHONE, accept_downloads=True, base_url=base_url)
        self.page: Page = self.context.new_page()
        self.requests: list[str] = []
        self.failed: dict[str, str] = {}  # url -> why ("csp": the page's policy stopped it, never sent)
        self.errors: list[str] = []
        self.page.on("pageerror", lambda error: self.errors.append(str(error)))
        self.page.on("request", lambda request: self.requests.append(request.url))
        self.page.on("requestfailed", lambda request: self.failed.update({request.url: request.failure or ""}))

    @property
    def elsewhere(self) -> list[str]:
        """Requests to another host (data: and blob: URLs are the page's own)."""
        return [u for u in self.requests if urlparse(u).scheme not in ("data", "blob") and urlparse(u).netloc != self.host]

    def screenshot(self, name: str) -> Path:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        path = ARTIFACTS / name
        self.page.screenshot(path=str(path), full_page=True)
        print(f"\nscreenshot: {path}")
        return path

    def close(self) -> None:
        self.context.close()


@pytest.fixture
def offline(browser, fleet, request):
    tab = Offline(browser, fleet.base_url)
    failed = request.session.testsfailed
    yield tab
    if request.session.testsfailed > failed:  # the call failed (its report is in before teardown)
        tab.screenshot(f"{request.node.name}-failed.png")
    tab.close()


def player(page: Page) -> dict:
    return page.evaluate(
        "() => { const a = document.getElementById('player');"
        " return {time: a.currentTime, src: a.currentSrc, paused: a.paused, error: a.error && a.error.code}; }"
    )


def test_a_book_is_narrated_listened_to_while_it_renders_and_downloaded(fleet, offline, tmp_path):
    page, api = offline.page, fleet.client()
    page.goto("/")
    expect(page.get_by_label("Model")).to_have_value("espeak")
    expect(page.get_by_label("Voice")).to_have_value("en-us")
    page.get_by_label("Text", exact=True).fill(three_chapters())
    page.get_by_label("Title").fill(TITLE)
    page.get_by_label("File format").select_option("flac")  # (the page offers MP3 first; FLAC finishes fastest)
    page.get_by_role("button", name="Narrate").click()
    submitted = time.monotonic()

    heading = page.get_by_role("heading", name=TITLE)
    expect(heading).to_be_focused()  # the job is announced where the keyboard now is
    job_id = parse_qs(urlparse(page.url).fragment)["job"][0]
    view = api.get(f"/v1/jobs/{job_id}").json()
    assert view["chapters"] == 3 and view["title"] == TITLE and view["format"] == "flac"
    chapters = page.get_by_role("navigation", name="Chapters").get_by_role("button")
    expect(chapters).to_have_count(3)

    # listen while it renders: the player is on the live stream, and its clock moves while the API
    # still says the job is running
    page.evaluate("() => { document.getElementById('player').play(); }")
    heard, percents, status = [], set(), "queued"  # heard: currentTime read while the job still renders
    deadline = time.monotonic() + 40
    while time.monotonic() < deadline:
        now = player(page)
        status = api.get(f"/v1/jobs/{job_id}").json()["status"]  # read after the time: it was rendering then
        percents.add(page.evaluate("() => document.getElementById('progress').value"))
        assert now["error"] is None, now
        if status not in ("queued", "running"):
            break
        if now["time"] > 0:
            heard.append(now["time"])
        if heard and heard[-1] - heard[0] >= 1.0:
            break
        page.wait_for_timeout(200)
    assert heard and heard[-1] - heard[0] >= 1.0, f"currentTime did not advance while rendering: {heard} ({status})"
    print(f"\nheard {heard[0]:.2f}-{heard[-1]:.2f} s while rendering, {time.monotonic() - submitted:.1f} s after submitting")
    assert urlparse(player(page)["src"]).path == f"/v1/jobs/{job_id}/stream"
    assert any(0 < p < 100 for p in percents), percents  # progress arrived step by step

    # jump to chapter 2: the stream from chapter 2 on, playing
    chapters.nth(1).click()
    expect(chapters.nth(1)).to_have_attribute("aria-current", "true")
    # Chromium picks the new source on a task of its own after `src` is set: wait for currentSrc
    page.wait_for_function(
        "() => new URL(document.getElementById('player').currentSrc || location.href).searchParams.get('chapter') === '2'",
        timeout=10_000,
    )
    src = urlparse(player(page)["src"])
    assert src.path == f"/v1/jobs/{job_id}/stream" and parse_qs(src.query)["chapter"] == ["2"], src
    page.wait_for_function("() => document.getElementById('player').currentTime > 1.0", timeout=30_000)
    assert parse_qs(urlparse(player(page)["src"]).query)["chapter"] == ["2"]

    # progress reaches 100 %, the job is done, the file downloads
    expect(page.locator("#progress-percent")).to_have_text("100 %", timeout=90_000)
    expect(page.get_by_label("Progress")).to_have_attribute("value", "100")
    expect(page.locator("#job-status")).to_have_text("Done", timeout=60_000)
    print(f"done {time.monotonic() - submitted:.1f} s after submitting")
    link = page.get_by_role("link", name="Download the audiobook (FLAC)")
    expect(link).to_be_visible()
    # titles, once done, as written (the chapters track escapes "&" and ">" as WebVTT asks)
    expect(chapters.nth(1)).to_have_text("2. Chapter Two: The Letter & its 2 < 3 > 1 seals")
    assert player(page)["error"] is None
    offline.screenshot("web-page.png")
    with page.expect_download() as download:
        link.click()
    saved = tmp_path / download.value.suggested_filename
    download.value.save_as(saved)
    assert saved.suffix == ".flac" and saved.name.startswith("The_Lighthouse")
    served = api.get(f"/v1/jobs/{job_id}/audio", follow_redirects=True)
    assert served.status_code == 200 and served.headers["content-type"] == "audio/flac"
    assert hashlib.sha256(saved.read_bytes()).digest() == hashlib.sha256(served.content).digest()
    assert saved.stat().st_size > 100_000  # minutes of speech

    # the job list has it; deleting it there deletes it in the API
    item = page.locator("#job-list > li").filter(has_text=TITLE)
    expect(item).to_contain_text("Done")
    page.once("dialog", lambda dialog: dialog.accept())
    item.get_by_role("button", name="Delete").click()
    expect(page.get_by_role("status").filter(has_text=f"Deleted “{TITLE}”.")).to_be_visible()
    expect(item).to_have_count(0)
    assert api.get(f"/v1/jobs/{job_id}").status_code == 404
    assert not offline.elsewhere and not offline.errors, (offline.elsewhere, offline.errors)
    api.close()


def test_a_job_open_longer_than_its_links_live_still_downloads(browser, redis_url, data_dir, tmp_path_factory):
    """Signed links live NARRATE_LINK_TTL_S (5 s here): the page asks for new ones before they run
    out, so the download works though the job was opened longer ago than that (a book done an hour
    after it was opened, a tab left open: the links it had were 401s)."""
    require(unavailable_reason() is None, f"eSpeak NG: {unavailable_reason()}")
    logs = tmp_path_factory.mktemp("web-ttl-logs")
    with espeak_fleet(redis_url, data_dir, logs, "webttl", link_ttl_s=5) as short, short.client() as http:
        job = http.post("/v1/jobs", json={"text": "A short book. It is done soon.", "format": "wav"}).json()
        wait_done(http, job["id"])
        tab = Offline(browser, short.base_url)
        try:
            tab.page.goto(f"/#job={job['id']}")
            link = tab.page.get_by_role("link", name="Download the audiobook (WAV)")
            expect(link).to_be_visible()
            first = link.get_attribute("href")
            time.sleep(7)  # the links it opened with have run out
            assert link.get_attribute("href") != first
            with tab.page.expect_download() as download:
                link.click()
            assert download.value.failure() is None and download.value.path().stat().st_size > 44
        finally:
            tab.close()


def test_the_page_works_by_keyboard_and_fits_a_phone(fleet, offline):
    page = offline.page
    page.goto("/")
    expect(page.get_by_label("Model")).to_have_value("espeak")
    # every control has a name (a label, or aria-label / aria-labelledby)
    unnamed = page.evaluate(
        """() => [...document.querySelectorAll('input, select, textarea, button, audio')]
             .filter(e => !(e.labels && e.labels.length) && !e.getAttribute('aria-label')
                          && !e.getAttribute('aria-labelledby') && !e.textContent.trim())
             .map(e => e.outerHTML.slice(0, 80))"""
    )
    assert unnamed == []
    # Tab reaches the form's controls in order, each with a visible focus ring
    reached, rings = [], set()
    for _ in range(20):
        page.keyboard.press("Tab")
        focused = page.evaluate(
            "() => { const e = document.activeElement; const s = getComputedStyle(e);"
            " return [e.id || e.name || e.tagName, s.outlineStyle, parseFloat(s.outlineWidth)]; }"
        )
        reached.append(focused[0])
        if focused[1] != "none" and focused[2] >= 2:
            rings.add(focused[0])
        if focused[0] == "submit":
            break
    order = ["source", "text", "title", "model", "voice", "format", "submit"]
    assert [r for r in reached if r in order] == order, reached
    assert set(order) <= rings, (reached, rings)
    # submitting nothing says what is missing, on the field, where the keyboard is
    page.keyboard.press("Enter")
    text = page.get_by_label("Text", exact=True)
    expect(text).to_be_focused()
    expect(text).to_have_attribute("aria-invalid", "true")
    expect(page.locator("#text-error")).to_have_text("Paste the text to narrate.")
    # the file choice replaces the text box
    page.get_by_label("Upload a file").check()
    expect(page.get_by_label("File", exact=True)).to_be_visible()
    expect(text).to_be_hidden()
    # a phone's width: nothing wider than the screen
    width = page.evaluate("() => document.documentElement.scrollWidth")
    assert width <= PHONE["width"], width
    # a key typed in is kept in this browser and sent as the Bearer header
    page.locator("summary", has_text="API key").click()
    page.get_by_label("API key", exact=True).fill("nk_test")
    with page.expect_request(lambda r: "/v1/models" in r.url) as sent:
        page.get_by_role("button", name="Save key").click()
    assert sent.value.headers.get("authorization") == "Bearer nk_test"
    assert page.evaluate("() => localStorage.getItem('narrate.apiKey')") == "nk_test"
    page.get_by_role("button", name="Forget key").click()
    assert page.evaluate("() => localStorage.getItem('narrate.apiKey')") is None
    assert not offline.elsewhere and not offline.errors, (offline.elsewhere, offline.errors)


def test_docs_and_redoc_render_without_internet(fleet, offline):
    page = offline.page
    page.goto("/docs")
    expect(page.locator(".swagger-ui .info .title")).to_contain_text("Narration fleet", timeout=20_000)
    expect(page.locator(".opblock-summary-path", has_text="/v1/jobs").first).to_be_visible()
    offline.screenshot("docs.png")
    page.goto("/redoc")
    expect(page.get_by_role("heading", name=re.compile("Narration fleet"))).to_be_visible(timeout=20_000)
    # ReDoc's sidebar has an <img> of its maker's logo from a CDN: the docs' CSP stops it in the browser
    blocked = [u for u in offline.elsewhere if "csp" in offline.failed.get(u, "").lower()]
    assert offline.requests and offline.elsewhere == blocked, (offline.elsewhere, offline.failed)
