"""A store that answers but refuses writes (a read-only SQLite file, a full one, a read-only
PostgreSQL database): uploads get 503 `store-read-only` naming why, /readyz says not ready
(`writes`), and reads and estimates go on. Each mechanism works as root, where file
permissions do not stop a write: SQLite's `mode=ro` URI, its `max_page_count`, PostgreSQL's
`default_transaction_read_only`."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient
from sqlalchemy import Engine, event, text

from service.api.problems import PROBLEM_MEDIA_TYPE, RETRY_AFTER_S, ProblemType
from service.store.db import create_engine_from_url, create_session_factory
from service.store.keys import KeyScope, create_key
from service.store.migrate import upgrade
from tests.api.conftest import SMALL_JOB, make_app
from tests.api.test_calibrations import bearer, estimated_device_bytes, upload_body
from tests.store.conftest import fresh_postgres_database

# Uploads a full SQLite store takes at most before one needs a page it has not got.
MAX_UPLOADS_TO_FILL = 200


def store_with_key(url: str) -> str:
    """Migrate `url` and issue an upload key in it; returns the key's token."""
    upgrade(url)
    engine = create_engine_from_url(url)
    try:
        with create_session_factory(engine).begin() as session:
            scopes = [KeyScope.UPLOAD]
            issued = create_key(
                session, scopes=scopes, name="t", now=datetime.now(UTC), nodes=["node-ro"]
            )
            return issued.token
    finally:
        engine.dispose()


def assert_read_only(response: Any, reason: str) -> None:
    assert response.status_code == 503, response.text
    assert response.headers["content-type"] == PROBLEM_MEDIA_TYPE
    assert response.headers["Retry-After"] == str(RETRY_AFTER_S)
    body = response.json()
    assert body["type"] == ProblemType.STORE_READ_ONLY
    assert reason in body["detail"] and body["retry_after_s"] == RETRY_AFTER_S


def assert_not_ready_for_writes(client: TestClient, reason: str) -> None:
    response = client.get("/readyz")
    assert response.status_code == 503, response.text
    body = response.json()
    assert body["checks"]["database"] is True and body["checks"]["writes"] is False
    assert reason in body["reasons"]["writes"]


def upload(client: TestClient, token: str, run: str) -> Any:
    measured = round(estimated_device_bytes(client) * 1.25)
    body = upload_body(device_bytes=measured, node_id="node-ro", run_id=run)
    return client.post("/v1/calibrations", json=body, headers=bearer(token))


def test_a_read_only_sqlite_file(tmp_path: Path) -> None:
    path = tmp_path / "store.db"
    token = store_with_key(f"sqlite:///{path}")
    app = make_app(database_url=f"sqlite:///file:{path}?mode=ro&uri=true")
    with TestClient(app) as client:
        assert_not_ready_for_writes(client, "read-only")
        assert_read_only(upload(client, token, "run-1"), "read-only")
        assert client.get("/v1/calibrations").status_code == 200
        assert client.get("/v1/factors").json()["state"] == "fresh"
        assert client.post("/v1/estimates", json=SMALL_JOB).status_code == 200


def _capped(engine: Engine) -> None:
    """New connections of `engine` may not grow the file: it is as full as it can be."""

    def cap(dbapi_connection: Any, _record: Any) -> None:
        pages = dbapi_connection.execute("PRAGMA page_count").fetchone()[0]
        dbapi_connection.execute(f"PRAGMA max_page_count={pages}")

    event.listen(engine, "connect", cap)
    engine.dispose()  # the pooled connections reconnect, capped


def test_a_full_sqlite_file(tmp_path: Path) -> None:
    path = tmp_path / "store.db"
    token = store_with_key(f"sqlite:///{path}")
    app = make_app(database_url=f"sqlite:///{path}")
    with TestClient(app) as client:
        assert client.get("/readyz").status_code == 200
        assert upload(client, token, "run-0").status_code == 201
        _capped(app.state.services.engine)
        assert_not_ready_for_writes(client, "full")
        answers = [upload(client, token, f"run-{n}") for n in range(1, MAX_UPLOADS_TO_FILL)]
        statuses = {response.status_code for response in answers}
        assert statuses <= {201, 503}, statuses
        refused = next(response for response in answers if response.status_code == 503)
        assert_read_only(refused, "full")
        assert client.get("/v1/calibrations").status_code == 200


def test_a_read_only_postgresql_database() -> None:
    with fresh_postgres_database() as url:
        token = store_with_key(url)
        engine = create_engine_from_url(url)
        try:
            with engine.begin() as connection:
                name = connection.scalar(text("SELECT current_database()"))
                connection.exec_driver_sql(
                    f'ALTER DATABASE "{name}" SET default_transaction_read_only = on'
                )
        finally:
            engine.dispose()
        app = make_app(database_url=url)
        with TestClient(app) as client:
            assert_not_ready_for_writes(client, "read-only")
            assert_read_only(upload(client, token, "run-1"), "read-only")
            assert client.get("/v1/calibrations").status_code == 200
            assert client.get("/v1/factors").json()["state"] == "fresh"


def test_the_refusal_is_remembered_until_a_write_succeeds(tmp_path: Path) -> None:
    # A refusal that no cheap check sees (a disk that fills): what the refused write said
    # keeps /readyz not ready for writes, until a write goes through.
    path = tmp_path / "store.db"
    token = store_with_key(f"sqlite:///{path}")
    app = make_app(database_url=f"sqlite:///{path}")
    refusing = True

    def refuse(dbapi_connection: Any, _record: Any) -> None:
        if refusing:
            dbapi_connection.execute("PRAGMA query_only=1")

    with TestClient(app) as client:
        engine = app.state.services.engine
        event.listen(engine, "connect", refuse)
        engine.dispose()
        assert_read_only(upload(client, token, "run-1"), "read-only")
        refusing = False
        engine.dispose()
        assert_not_ready_for_writes(client, "read-only")
        assert upload(client, token, "run-2").status_code == 201
        assert client.get("/readyz").status_code == 200
