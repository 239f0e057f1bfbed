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
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.store.migrate import upgrade

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


@pytest.fixture(scope="session")
def service_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Base URL of the real service, serving on 127.0.0.1 with a temporary SQLite store."""
    database_url = f"sqlite:///{tmp_path_factory.mktemp('web-store') / 'vramcast.db'}"
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
