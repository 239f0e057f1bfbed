"""Read keys through the app's cache: a key the store verified is taken for `KEY_RECHECK_S`
without asking it (a revocation takes effect within that), and while the store cannot be
reached for `KEY_OUTAGE_GRACE_S` (an unknown key then: 503, not 401)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import replace
from datetime import UTC, datetime

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy.engine import make_url

from service.api.auth import KEY_OUTAGE_GRACE_S, KEY_RECHECK_S, KeyCache
from service.api.problems import ProblemType
from service.store.keys import KeyScope, revoke_key
from service.store.migrate import upgrade
from tests.api.conftest import issue_key, make_app
from tests.api.test_calibrations import bearer
from tests.api.test_store_down import LOOPBACK, Proxy
from tests.store.conftest import fresh_postgres_database


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def with_clock(app: FastAPI) -> Clock:
    clock = Clock()
    services = app.state.services
    app.state.services = replace(services, keys=KeyCache(clock=clock))
    return clock


def status_of(client: TestClient, token: str) -> tuple[int, str]:
    response = client.get("/v1/factors", headers=bearer(token))
    kind = response.json().get("type", "") if response.status_code >= 400 else ""
    return response.status_code, kind


def test_a_revoked_key_stops_working_within_the_recheck_time() -> None:
    app = make_app(require_read_key=True)
    clock = with_clock(app)
    with TestClient(app) as client:
        token = issue_key(app, KeyScope.READ)
        assert status_of(client, token) == (200, "")
        with app.state.services.sessions.begin() as session:
            revoke_key(session, token.split("_")[1], now=datetime.now(UTC))
        clock.now += KEY_RECHECK_S / 2
        assert status_of(client, token) == (200, "")  # the cache's answer, within the time
        clock.now += KEY_RECHECK_S
        assert status_of(client, token) == (401, ProblemType.UNAUTHORIZED)
        assert status_of(client, token) == (401, ProblemType.UNAUTHORIZED)


def test_a_key_revoked_through_the_api_stops_working_here_at_once() -> None:
    app = make_app(require_read_key=True)
    with_clock(app)  # no time passes: only the revocation can drop the cached key
    with TestClient(app) as client:
        token = issue_key(app, KeyScope.READ)
        admin = issue_key(app, KeyScope.ADMIN)
        assert status_of(client, token) == (200, "")
        response = client.delete(f"/v1/keys/{token.split('_')[1]}", headers=bearer(admin))
        assert response.status_code == 200, response.text
        assert status_of(client, token) == (401, ProblemType.UNAUTHORIZED)


def test_an_upload_key_is_not_a_read_key_from_the_cache_either() -> None:
    app = make_app(require_read_key=True)
    with TestClient(app) as client:
        token = issue_key(app, KeyScope.UPLOAD)
        assert status_of(client, token) == (403, ProblemType.FORBIDDEN)
        assert status_of(client, token) == (403, ProblemType.FORBIDDEN)


@pytest.fixture
def proxied_app() -> Iterator[tuple[FastAPI, Proxy]]:
    with fresh_postgres_database() as url:
        upgrade(url)
        parsed = make_url(url)
        proxy = Proxy((parsed.host or LOOPBACK, parsed.port or 5432))
        try:
            proxied = parsed.set(host=LOOPBACK, port=proxy.port)
            url = proxied.render_as_string(hide_password=False)
            yield make_app(database_url=url, require_read_key=True), proxy
        finally:
            proxy.cut()


def test_a_verified_key_outlasts_an_outage_for_a_bounded_time(
    proxied_app: tuple[FastAPI, Proxy],
) -> None:
    app, proxy = proxied_app
    clock = with_clock(app)
    with TestClient(app) as client:
        token = issue_key(app, KeyScope.READ)
        unknown = issue_key(app, KeyScope.READ)  # valid, but never seen by the cache
        assert status_of(client, token) == (200, "")
        proxy.cut()
        clock.now += KEY_RECHECK_S + 1  # the store is asked, and cannot answer
        assert status_of(client, token) == (200, "")
        assert status_of(client, unknown) == (503, ProblemType.STORE_UNAVAILABLE)
        clock.now += KEY_OUTAGE_GRACE_S
        assert status_of(client, token) == (503, ProblemType.STORE_UNAVAILABLE)
        restore(proxy)
        assert wait_for_ok(client, token) == (200, "")


# Seconds to wait for the proxy's port to be free again, and for the store to answer again
# (the engine's guard does not connect for 2 s after the store did not answer).
RECOVERY_S = 10.0


def restore(proxy: Proxy) -> None:
    deadline = time.monotonic() + RECOVERY_S
    while True:
        try:
            proxy.restore()
            return
        except OSError:  # the cut listener is still closing
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def wait_for_ok(client: TestClient, token: str) -> tuple[int, str]:
    deadline = time.monotonic() + RECOVERY_S
    while (found := status_of(client, token))[0] != 200 and time.monotonic() < deadline:
        time.sleep(0.1)
    return found
