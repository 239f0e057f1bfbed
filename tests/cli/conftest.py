"""The store's database fixtures, for `vramcast keys` and `vramcast db`, and the service on
loopback (uvicorn in a thread) for the commands that talk to it."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn

from tests.api.conftest import make_app
from tests.store.conftest import blank_database_url

__all__ = ["blank_database_url", "live_url"]

START_TIMEOUT_S = 30.0


@pytest.fixture(scope="session")
def live_url() -> Iterator[str]:
    """The base URL of the real service, served by uvicorn on a free loopback port."""
    with serving() as url:
        yield url


@contextlib.contextmanager
def serving() -> Iterator[str]:
    """The real service on a free loopback port (uvicorn in a thread), while in the block."""
    config = uvicorn.Config(make_app(), host="127.0.0.1", port=0, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="vramcast-live", daemon=True)
    thread.start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while not server.started:  # set once the socket listens
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the service did not start")
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
