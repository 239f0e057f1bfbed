"""The real service on a loopback port and a headless Chromium to drive the web page.

The service runs in a subprocess (uvicorn, the app factory) on a fresh SQLite store built by
the migrations. The browser is Debian's `chromium` (never one Playwright downloads), started
headless with a fresh profile. Without the browser or Playwright the tests skip, unless
VRAMCAST_REQUIRE_BROWSER=1 (CI) fails them.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from service.store.db import create_engine_from_url, create_session_factory
from service.store.keys import KeyScope, create_key
from service.store.migrate import upgrade
from tests.web.pages import DESKTOP, Driver

REPO_ROOT = Path(__file__).resolve().parents[2]
CHROMIUM_ENV = "VRAMCAST_CHROMIUM"
DEFAULT_CHROMIUM = "/usr/bin/chromium"
REQUIRE_BROWSER_ENV = "VRAMCAST_REQUIRE_BROWSER"
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
]
STARTUP_SECONDS = 30.0


def _unavailable(reason: str) -> None:
    if os.environ.get(REQUIRE_BROWSER_ENV) == "1":
        pytest.fail(f"{reason} ({REQUIRE_BROWSER_ENV}=1)", pytrace=False)
    pytest.skip(reason)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _wait_ready(base_url: str, server: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + STARTUP_SECONDS
    with httpx.Client(base_url=base_url, timeout=2.0) as client:
        while time.monotonic() < deadline:
            if server.poll() is not None:
                raise RuntimeError(f"the service exited with status {server.returncode}")
            try:
                if client.get("/readyz").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
    raise RuntimeError(f"the service did not answer /readyz within {STARTUP_SECONDS:.0f} s")


@contextmanager
def running_service(database_url: str) -> Iterator[str]:
    """The service on a free loopback port, on `database_url` (migrated first); its base URL."""
    upgrade(database_url)
    port = _free_port()
    env = {**os.environ, "VRAMCAST_DATABASE_URL": database_url}
    command = [
        sys.executable,
        "-m",
        "uvicorn",
        "service.api.app:create_app",
        "--factory",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--log-level",
        "warning",
    ]
    server = subprocess.Popen(command, cwd=REPO_ROOT, env=env)
    base_url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(base_url, server)
        yield base_url
    finally:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def issue_key(database_url: str, *scopes: KeyScope, nodes: Sequence[str] = ()) -> str:
    """A new API key's token, stored in the database at `database_url`; an upload key
    uploads for `nodes`."""
    engine = create_engine_from_url(database_url)
    try:
        with create_session_factory(engine).begin() as session:
            issued = create_key(
                session, scopes=scopes, name="web tests", now=datetime.now(UTC), nodes=nodes
            )
            return issued.token
    finally:
        engine.dispose()


@pytest.fixture(scope="session")
def service_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Base URL of the real service, serving on 127.0.0.1 with a temporary SQLite store."""
    database = tmp_path_factory.mktemp("web-store") / "vramcast.db"
    with running_service(f"sqlite:///{database}") as base_url:
        yield base_url


@pytest.fixture(scope="session")
def api(service_url: str) -> Iterator[httpx.Client]:
    """An HTTP client of the same service, for the answers the page must show."""
    with httpx.Client(base_url=service_url, timeout=30.0) as client:
        yield client


@pytest.fixture(scope="session")
def browser() -> Iterator[Any]:
    """Headless Debian Chromium with a fresh profile, driven by Playwright."""
    executable = os.environ.get(CHROMIUM_ENV) or DEFAULT_CHROMIUM
    if shutil.which(executable) is None:
        _unavailable(f"no Chromium at {executable} (apt-get install chromium)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _unavailable("playwright is not installed (pip install -e '.[dev]')")
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(
            executable_path=executable, headless=True, args=CHROMIUM_FLAGS
        )
        try:
            yield launched
        finally:
            launched.close()


@pytest.fixture
def open_page(browser: Any) -> Iterator[Callable[[str], Driver]]:
    """Opens pages, each in a fresh browser context, on a service's base URL; on the way out,
    fails the test if a page raised or fetched anything from another host."""
    opened: list[tuple[Any, Driver]] = []

    def open_one(base_url: str) -> Driver:
        context = browser.new_context(viewport=DESKTOP)
        page = context.new_page()
        page.set_default_timeout(20_000)
        found = Driver(page, base_url)
        opened.append((context, found))
        return found

    yield open_one
    for context, _ in opened:
        context.close()
    for _, found in opened:
        assert not found.errors, f"the page raised: {found.errors}"
        origin = urlsplit(found.base_url).netloc
        outside = [u for u in found.requests if urlsplit(u).netloc != origin]
        assert not outside, f"the page fetched from outside the service: {outside}"


@pytest.fixture
def driver(open_page: Callable[[str], Driver], service_url: str) -> Driver:
    """A page of the shared service."""
    return open_page(service_url)
