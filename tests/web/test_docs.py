"""The interactive API docs in Chromium with every request off the loopback blocked: /docs
(Swagger UI) lists the API's operations and sends a request, /redoc (ReDoc) renders them."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest

from tests.web.pages import DESKTOP

LOOPBACK = {"127.0.0.1", "localhost", "[::1]", "::1"}


class OfflinePage:
    """A page whose requests off the loopback are aborted, as on a cluster with no internet."""

    def __init__(self, page: Any) -> None:
        self.page = page
        self.blocked: list[str] = []
        self.errors: list[str] = []
        page.route("**/*", self._route)
        page.on("pageerror", lambda error: self.errors.append(str(error)))

    def _route(self, route: Any) -> None:
        url = route.request.url
        if urlsplit(url).scheme in ("http", "https") and urlsplit(url).hostname not in LOOPBACK:
            self.blocked.append(url)
            route.abort()
        else:
            route.continue_()


@pytest.fixture
def offline(browser: Any) -> Iterator[OfflinePage]:
    context = browser.new_context(viewport=DESKTOP)
    page = context.new_page()
    page.set_default_timeout(20_000)
    opened = OfflinePage(page)
    yield opened
    context.close()
    assert not opened.errors, f"the page raised: {opened.errors}"
    assert not opened.blocked, f"the page asked for off-loopback URLs: {opened.blocked}"


def test_swagger_ui_renders_and_sends_a_request_offline(
    offline: OfflinePage, service_url: str
) -> None:
    page = offline.page
    page.goto(f"{service_url}/docs")
    page.wait_for_selector(".opblock-summary-path", timeout=20_000)
    paths = set(page.locator(".opblock-summary-path").all_inner_texts())
    assert {"/v1/estimates", "/v1/fit-checks", "/v1/gpus", "/livez"} <= {
        p.replace("\u200b", "") for p in paths
    }

    livez = page.locator("#operations-operations-livez_livez_get")
    livez.locator(".opblock-summary").click()
    livez.locator(".try-out__btn").click()
    livez.locator(".execute").click()
    status = livez.locator(".live-responses-table .response .response-col_status")
    status.first.wait_for(timeout=20_000)
    assert status.first.inner_text().strip() == "200"
    body = livez.locator(".live-responses-table .response-col_description pre").first
    assert '"status": "ok"' in body.inner_text()


def test_redoc_renders_offline(offline: OfflinePage, service_url: str) -> None:
    page = offline.page
    page.goto(f"{service_url}/redoc")
    heading = page.get_by_role("heading", name="Estimate a job's peak GPU memory")
    heading.first.wait_for(timeout=20_000)
    text = page.locator("body").inner_text()
    for summary in (
        "Check a job against GPU types",
        "Upload a measured peak",
        "List the catalog's GPUs",
    ):
        assert summary in text
