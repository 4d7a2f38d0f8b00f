"""The web page at ``/`` (plain HTML and JavaScript modules from api/static, no build step) and the
API's docs (``/docs``, ``/redoc``) with their assets served by the app itself: nothing the browser
loads comes from another host, so both work on a machine without internet.

The docs' assets are Swagger UI 5 and ReDoc 2 as the fastapi-offline package (MIT) ships them; the
pages are FastAPI's own (``get_swagger_ui_html``, ``get_redoc_html``) pointed at them, the recipe of
FastAPI's "Custom Docs UI Static Assets" (the app is made with ``docs_url=None, redoc_url=None``).
"""

from __future__ import annotations

from functools import cache
from html import escape
from importlib.resources import files
from pathlib import Path

from fastapi import APIRouter, FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

from jobs.encoding import format_names

STATIC = Path(__file__).with_name("static")
#: Swagger UI's and ReDoc's files (swagger-ui-bundle.js, swagger-ui.css, redoc.standalone.js, favicon.png).
DOCS_ASSETS = Path(str(files("fastapi_offline") / "static"))
STATIC_URL, DOCS_ASSETS_URL = "/static", "/docs-assets"
#: The output format the page offers first: MP3 plays in every browser and is small.
DEFAULT_FORMAT = "mp3"
#: The docs' pages load images from the app alone: ReDoc's sidebar shows a logo from its maker's CDN
#: (an <img> it hides when that fails); this way the browser never asks another host for it.
DOCS_CSP = "img-src 'self' data:"
#: The page's own policy: its scripts, styles and requests are the app's alone. Media may come from
#: elsewhere: a finished file in S3 is a redirect to a presigned URL.
PAGE_CSP = (
    "default-src 'self'; img-src 'self' data:; media-src 'self' https: http:; object-src 'none'; "
    "base-uri 'none'; frame-ancestors 'none'; form-action 'self'"
)

router = APIRouter(include_in_schema=False)


@cache
def _page() -> str:
    """index.html with the output formats filled in (jobs/encoding.py keeps their one list)."""
    options = "\n".join(
        f'<option value="{escape(name)}"{" selected" if name == DEFAULT_FORMAT else ""}>{escape(name)}</option>'
        for name in format_names()
    )
    return (STATIC / "index.html").read_text(encoding="utf-8").replace("<!-- FORMATS -->", options)


@router.api_route("/", methods=["GET", "HEAD"])
async def page() -> HTMLResponse:
    headers = {"Content-Security-Policy": PAGE_CSP, "Cache-Control": "no-cache"}
    return HTMLResponse(_page(), headers=headers)


@router.api_route("/docs", methods=["GET", "HEAD"])
async def swagger_ui(request: Request) -> HTMLResponse:
    app, root = request.app, request.scope.get("root_path", "")
    page = get_swagger_ui_html(
        openapi_url=f"{root}{app.openapi_url}",
        title=f"{app.title} - Swagger UI",
        oauth2_redirect_url=f"{root}{app.swagger_ui_oauth2_redirect_url}",
        swagger_js_url=f"{root}{DOCS_ASSETS_URL}/swagger-ui-bundle.js",
        swagger_css_url=f"{root}{DOCS_ASSETS_URL}/swagger-ui.css",
        swagger_favicon_url=f"{root}{DOCS_ASSETS_URL}/favicon.png",
        # no badge from the online validator (another host)
        swagger_ui_parameters={**(app.swagger_ui_parameters or {}), "validatorUrl": None},
    )
    page.headers["Content-Security-Policy"] = DOCS_CSP
    return page


@router.api_route("/docs/oauth2-redirect", methods=["GET", "HEAD"])
async def swagger_ui_redirect() -> HTMLResponse:
    return get_swagger_ui_oauth2_redirect_html()


@router.api_route("/redoc", methods=["GET", "HEAD"])
async def redoc(request: Request) -> HTMLResponse:
    app, root = request.app, request.scope.get("root_path", "")
    page = get_redoc_html(
        openapi_url=f"{root}{app.openapi_url}",
        title=f"{app.title} - ReDoc",
        redoc_js_url=f"{root}{DOCS_ASSETS_URL}/redoc.standalone.js",
        redoc_favicon_url=f"{root}{DOCS_ASSETS_URL}/favicon.png",
        with_google_fonts=False,
    )
    page.headers["Content-Security-Policy"] = DOCS_CSP
    return page


def install(app: FastAPI) -> None:
    """The page, the docs and their files on ``app`` (made with ``docs_url=None, redoc_url=None``)."""
    app.include_router(router)
    app.mount(STATIC_URL, StaticFiles(directory=STATIC), name="static")
    app.mount(DOCS_ASSETS_URL, StaticFiles(directory=DOCS_ASSETS), name="docs-assets")
