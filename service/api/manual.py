"""The manual (docs/, built by MkDocs) served at `/manual/`, from the directory `make docs` writes.

The built site is not in the source tree: until it is built, every page under `/manual/`
answers 404 with a problem that says how to build it.
"""

from __future__ import annotations

from http import HTTPStatus
from pathlib import Path

from fastapi import FastAPI
from fastapi.staticfiles import StaticFiles
from starlette.types import Receive, Scope, Send

from service.api import problems

MANUAL_PATH = "/manual"
# Where `make docs` (and the Docker image) writes the built site: beside the web page's files.
DEFAULT_MANUAL_DIR = Path(__file__).resolve().parents[1] / "web" / "manual"
NOT_BUILT = "the manual is not built: run `make docs` (it writes {directory})"


class ManualFiles(StaticFiles):
    """The built site's files (`index.html` for a directory), or a 404 problem naming
    `make docs` while the site is not built; it is looked for on every request, so a site
    built after start-up is served without a restart."""

    def __init__(self, directory: Path) -> None:
        super().__init__(directory=directory, html=True, check_dir=False)
        self.site = directory

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not (self.site / "index.html").is_file():
            detail = NOT_BUILT.format(directory=self.site)
            raise problems.ProblemError(problems.http_problem(HTTPStatus.NOT_FOUND, detail))
        await super().__call__(scope, receive, send)


def mount_manual(app: FastAPI, directory: Path | None) -> None:
    """Serve the built manual in `directory` (default: service/web/manual/) under `/manual/`;
    `/manual` redirects there. Not part of the API's schema."""
    app.mount(MANUAL_PATH, ManualFiles(directory or DEFAULT_MANUAL_DIR), name="manual")
