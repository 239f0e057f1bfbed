"""With the database down, estimates and fit-checks keep answering from the cached factors (or
none) and say which; uploads and listings get 503 with Retry-After.

Down is played three ways, none touching the machine's PostgreSQL server: a closed port, a
proxy in front of a test database that is cut, and a port that accepts but never answers.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy.engine import make_url

from service.api.problems import PROBLEM_MEDIA_TYPE, RETRY_AFTER_S, ProblemType
from service.core.calibration import MIN_NODES
from service.store.db import POSTGRES_CONNECT_TIMEOUT_S
from service.store.keys import KeyScope
from service.store.migrate import upgrade
from tests.api.conftest import SMALL_JOB, issue_key, make_app
from tests.api.test_calibrations import (
    bearer,
    estimated_device_bytes,
    reloaded_factors,
    upload_body,
    upload_fleet,
)
from tests.store.conftest import fresh_postgres_database

LOOPBACK = "127.0.0.1"
# An estimate answers in milliseconds; one that waited on the database would take the
# connection timeout (seconds).
FAST_S = 1.0


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind((LOOPBACK, 0))
        port: int = probe.getsockname()[1]
        return port


def postgres_url(port: int) -> str:
    return f"postgresql+psycopg://vramcast@{LOOPBACK}:{port}/vramcast"


class Proxy:
    """Forwards a loopback port to a database server; `cut` drops the port and every open
    connection, as a database that went away would, and `restore` brings the port back."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.port = free_port()
        self._sockets: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self.restore()

    def restore(self) -> None:
        listener = socket.create_server((LOOPBACK, self.port))
        listener.settimeout(0.05)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def cut(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()
        with self._lock:
            for sock in self._sockets:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()
            self._sockets.clear()

    def _accept(self, listener: socket.socket) -> None:
        while self._listener is listener:
            try:
                client, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            server = socket.create_connection(self.target)
            with self._lock:
                self._sockets |= {client, server}
            for source, sink in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                sink.sendall(data)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)


def assert_unavailable(response: Any) -> None:
    assert response.status_code == 503, response.text
    assert response.headers["content-type"] == PROBLEM_MEDIA_TYPE
    assert response.headers["Retry-After"] == str(RETRY_AFTER_S)
    body = response.json()
    assert body["type"] == ProblemType.STORE_UNAVAILABLE
    assert body["retry_after_s"] == RETRY_AFTER_S


def timed_post(client: TestClient, path: str, body: dict[str, Any]) -> tuple[float, Any]:
    started = time.perf_counter()
    response = client.post(path, json=body)
    return time.perf_counter() - started, response


def wait_for_state(client: TestClient, state: str) -> dict[str, Any]:
    deadline = time.monotonic() + 10.0
    while True:
        table: dict[str, Any] = client.get("/v1/factors").json()
        if table["state"] == state or time.monotonic() > deadline:
            return table
        time.sleep(0.05)


def test_a_store_never_reached_leaves_estimates_uncalibrated_and_says_so() -> None:
    app = make_app(database_url=postgres_url(free_port()))
    with TestClient(app) as client:
        estimate = client.post("/v1/estimates", json={**SMALL_JOB, "gpu": "L4"})
        assert estimate.status_code == 200, estimate.text
        calibration = estimate.json()["calibration"]
        assert calibration["state"] == "none" and calibration["applied"] is False
        fit = client.post("/v1/fit-checks", json={"job": SMALL_JOB, "gpus": ["L4"]})
        assert fit.status_code == 200 and fit.json()["job"]["calibration"]["state"] == "none"
        batch = client.post("/v1/estimates:batch", json={"jobs": [SMALL_JOB]})
        assert batch.json()["results"][0]["estimate"]["calibration"]["state"] == "none"

        factors = client.get("/v1/factors").json()
        assert factors["state"] == "none" and factors["factors"] == []
        assert factors["error"].startswith("calibration store unavailable")

        upload = upload_body(device_bytes=10**10)
        assert_unavailable(client.post("/v1/calibrations", json=upload, headers=bearer("vck_a_b")))
        assert_unavailable(client.get("/v1/calibrations"))
        assert client.get("/readyz").status_code == 503


@pytest.fixture
def proxied_store() -> Iterator[tuple[FastAPI, Proxy]]:
    """An app on a fresh PostgreSQL database reached through a proxy the test can cut."""
    with fresh_postgres_database() as url:
        upgrade(url)
        parsed = make_url(url)
        proxy = Proxy((parsed.host or LOOPBACK, parsed.port or 5432))
        try:
            proxied = parsed.set(host=LOOPBACK, port=proxy.port)
            yield make_app(database_url=proxied.render_as_string(hide_password=False)), proxy
        finally:
            proxy.cut()


def test_a_store_that_goes_down_leaves_the_last_factors_in_use(
    proxied_store: tuple[FastAPI, Proxy],
) -> None:
    app, proxy = proxied_store
    with TestClient(app) as client:
        token = issue_key(app, KeyScope.UPLOAD)
        estimate = estimated_device_bytes(client)
        upload_fleet(client, app, {f"node-{i}": [1.25] for i in range(MIN_NODES)}, estimate)
        fresh = reloaded_factors(client, app)
        assert fresh["state"] == "fresh" and fresh["factors"]

        proxy.cut()
        app.state.services.factor_cache.invalidate()  # reload now rather than after the TTL
        stale = wait_for_state(client, "stale")
        assert stale["state"] == "stale" and stale["factors"] == fresh["factors"]
        assert stale["error"].startswith("calibration store unavailable")

        elapsed, response = timed_post(client, "/v1/estimates", SMALL_JOB)
        assert response.status_code == 200 and elapsed < FAST_S
        calibration = response.json()["calibration"]
        assert calibration["state"] == "stale" and calibration["applied"] is True
        assert calibration["factor"] == pytest.approx(1.25, rel=1e-6)
        fit = client.post("/v1/fit-checks", json={"job": SMALL_JOB, "gpus": ["L4"]}).json()
        assert fit["job"]["calibration"] == calibration

        body = upload_body(device_bytes=round(estimate * 1.25), node_id="node-late")
        assert_unavailable(client.post("/v1/calibrations", json=body, headers=bearer(token)))
        assert_unavailable(client.get("/v1/calibrations"))

        proxy.restore()
        app.state.services.factor_cache.invalidate()
        assert wait_for_state(client, "fresh")["state"] == "fresh"
        stored = client.post("/v1/calibrations", json=body, headers=bearer(token))
        assert stored.status_code == 201, stored.text


def test_a_store_that_hangs_never_holds_an_estimate() -> None:
    # Accepts connections (the kernel completes the handshake) and never answers.
    with socket.create_server((LOOPBACK, 0), backlog=64) as silent:
        app = make_app(database_url=postgres_url(silent.getsockname()[1]))
        with TestClient(app) as client:
            for _ in range(3):
                elapsed, response = timed_post(client, "/v1/estimates", SMALL_JOB)
                assert response.status_code == 200 and elapsed < FAST_S
                assert response.json()["calibration"]["state"] == "none"
                time.sleep(0.5)
            upload = upload_body(device_bytes=10**10)
            started = time.perf_counter()
            response = client.post("/v1/calibrations", json=upload, headers=bearer("vck_a_b"))
            assert_unavailable(response)
            # The upload waited for the connection timeout, not longer.
            assert time.perf_counter() - started < POSTGRES_CONNECT_TIMEOUT_S + 2
