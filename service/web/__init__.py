"""The web page for people planning a run: static files served at `/`, shipped in the package.

The page (plain JS and SVG, no build step) calls the REST API from the browser; it never
estimates anything itself.
"""

from __future__ import annotations

from importlib import resources

from fastapi import FastAPI
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

STATIC_PACKAGE = "service.web"
STATIC_DIRECTORY = "static"
# The page's assets; the page itself is at `/`, so no catch-all shadows routes added later.
ASSETS_PATH = "/web"


def _index_html() -> str:
    return (
        resources.files(STATIC_PACKAGE)
        .joinpath(STATIC_DIRECTORY, "index.html")
        .read_text(encoding="utf-8")
    )


def mount_web(app: FastAPI) -> None:
    """Serve the page at `/` and its assets under `/web/`."""
    page = _index_html()

    async def index() -> HTMLResponse:
        return HTMLResponse(page, headers={"Cache-Control": "no-cache"})

    app.add_api_route("/", index, methods=["GET"], include_in_schema=False)
    app.mount(
        ASSETS_PATH,
        StaticFiles(packages=[(STATIC_PACKAGE, STATIC_DIRECTORY)]),
        name="web",
    )
