"""The web page at / and the API docs: served by the app, with nothing loaded from another host (they
must work on a machine without internet). The page's behaviour in a browser: tests/integration/test_web_page.py."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

from jobs.encoding import format_names


class References(HTMLParser):
    """Every URL an HTML document makes the browser load: src, href, spec-url (ReDoc)."""

    def __init__(self) -> None:
        super().__init__()
        self.urls: list[str] = []
        self.tags: list[tuple[str, dict]] = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.tags.append((tag, attrs))
        for name in ("src", "href", "spec-url"):
            if attrs.get(name):
                self.urls.append(attrs[name])


def references(html: str) -> References:
    parser = References()
    parser.feed(html)
    return parser


def absolute(url: str) -> str:
    return url if url.startswith("/") else f"/{url}"


def test_the_page_and_its_files_come_from_the_app(api):
    async def scenario(a):
        page = await a.client.get("/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        csp = page.headers["content-security-policy"]
        assert "default-src 'self'" in csp and "object-src 'none'" in csp
        refs = references(page.text)
        assert {"static/app.js", "static/style.css"} <= set(refs.urls), refs.urls
        scripts = [attrs for tag, attrs in refs.tags if tag == "script"]
        assert scripts == [{"type": "module", "src": "static/app.js"}]  # no inline script (the CSP forbids it)
        # every output format is offered (one list: jobs/encoding.py), MP3 first chosen
        offered = re.findall(r'<option value="([^"]+)"( selected)?>', page.text)
        assert [name for name, _ in offered] == list(format_names())
        assert [name for name, selected in offered if selected] == ["mp3"]
        assert "<!-- FORMATS -->" not in page.text
        bodies = {"/": page.text}
        for url in ("static/app.js", "static/style.css"):
            response = await a.client.get(absolute(url))
            assert response.status_code == 200 and response.content, url
            bodies[url] = response.text
        assert (await a.client.get("/static/app.js")).headers["content-type"].startswith("text/javascript")
        assert (await a.client.get("/static/style.css")).headers["content-type"].startswith("text/css")
        for body in bodies.values():
            _no_other_host(body)
        assert not [u for u in refs.urls if u.startswith("//")], refs.urls
        head = await a.client.head("/")
        assert head.status_code == 200
        assert (await a.client.get("/static/nothing.js")).status_code == 404
        post = await a.client.post("/static/app.js")
        assert post.status_code == 405 and post.headers["allow"] == "GET, HEAD"  # a mount's methods too

    api(scenario)


def _no_other_host(html: str) -> None:
    assert not re.search(r"https?://", html), re.findall(r"https?://\S+", html)


def test_docs_and_redoc_load_only_the_apps_own_assets(api):
    async def scenario(a):
        for path, wanted in (
            ("/docs", {"/docs-assets/swagger-ui-bundle.js", "/docs-assets/swagger-ui.css"}),
            ("/redoc", {"/docs-assets/redoc.standalone.js", "/openapi.json"}),
        ):
            page = await a.client.get(path)
            assert page.status_code == 200 and page.headers["content-type"].startswith("text/html"), path
            assert page.headers["content-security-policy"] == "img-src 'self' data:", path  # (ReDoc's CDN logo)
            _no_other_host(page.text)
            urls = set(references(page.text).urls)
            assert wanted <= urls, (path, urls)
            for url in urls:
                assert url.startswith("/"), (path, url)
                asset = await a.client.get(url)
                assert asset.status_code == 200 and len(asset.content) > 100, (path, url, asset.status_code)
        swagger = (await a.client.get("/docs")).text
        assert "url: '/openapi.json'" in swagger and '"validatorUrl": null' in swagger
        # Swagger UI 5 (OpenAPI 3.1 documents; version 4 cannot render them)
        bundle = (await a.client.get("/docs-assets/swagger-ui-bundle.js")).text
        assert re.search(r'"5\.\d+\.\d+"', bundle)
        spec = (await a.client.get("/openapi.json")).json()
        assert spec["openapi"].startswith("3.1") and "/v1/jobs" in spec["paths"]
        assert not {"/", "/docs", "/redoc"} & set(spec["paths"])  # the pages are not API routes
        assert (await a.client.get("/docs/oauth2-redirect")).status_code == 200

    api(scenario)


def test_every_operation_has_an_id_of_its_own_the_same_in_every_process():
    """Generated clients name their methods by operationId: an id given twice, or one that changes
    between processes (GET and HEAD on one route took the name of whichever a set listed first), breaks
    them. The document is built in two processes whose string hashes order {"GET", "HEAD"} apart."""
    script = "import json; from api.app import create_app; print(json.dumps(create_app().openapi()))"
    specs = []
    for seed in ("1", "3"):
        built = subprocess.run(
            [sys.executable, "-W", "error", "-c", script],  # FastAPI warns of a duplicate id
            env={**os.environ, "PYTHONHASHSEED": seed},
            cwd=Path(__file__).parents[2],
            capture_output=True,
            text=True,
        )
        assert built.returncode == 0, built.stderr[-2000:]
        specs.append(json.loads(built.stdout))
    operations = [(method, op["operationId"]) for item in specs[0]["paths"].values() for method, op in item.items()]
    ids = [operation_id for _, operation_id in operations]
    assert len(set(ids)) == len(ids) > 20
    assert all(operation_id.endswith(f"_{method}") for method, operation_id in operations)
    gets = {path for path, item in specs[0]["paths"].items() if "get" in item}
    assert {path for path in gets if "head" in specs[0]["paths"][path]} == gets  # every GET answers HEAD
    assert specs[0] == specs[1]
