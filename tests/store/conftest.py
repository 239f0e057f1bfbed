"""Databases for store tests: SQLite and PostgreSQL, each a fresh one, built by the migrations.

PostgreSQL comes from VRAMCAST_TEST_POSTGRES_URL (default: the local server's `test`
database); each test session creates its own database next to it and drops it at the end.
Unreachable, the PostgreSQL tests skip, unless VRAMCAST_REQUIRE_POSTGRES=1 (CI) fails them.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from sqlalchemy import Engine, create_engine
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session
from sqlalchemy.pool import NullPool

from service.store.db import create_engine_from_url
from service.store.migrate import upgrade

POSTGRES_URL_ENV = "VRAMCAST_TEST_POSTGRES_URL"
DEFAULT_POSTGRES_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
REQUIRE_POSTGRES_ENV = "VRAMCAST_REQUIRE_POSTGRES"
BACKENDS = ("sqlite", "postgresql")


@contextmanager
def fresh_postgres_database() -> Iterator[str]:
    """A new, empty PostgreSQL database; dropped on exit."""
    server = make_url(os.environ.get(POSTGRES_URL_ENV) or DEFAULT_POSTGRES_URL)
    admin = create_engine(
        server,
        isolation_level="AUTOCOMMIT",
        poolclass=NullPool,
        connect_args={"connect_timeout": 3},
    )
    try:
        connection = admin.connect()
    except OperationalError as error:
        admin.dispose()
        reason = f"PostgreSQL unreachable at {server.render_as_string()}: {error.orig}"
        if os.environ.get(REQUIRE_POSTGRES_ENV) == "1":
            pytest.fail(f"{reason} ({REQUIRE_POSTGRES_ENV}=1)", pytrace=False)
        pytest.skip(reason)
    name = f"vramcast_test_{os.getpid()}_{secrets.token_hex(4)}"
    try:
        connection.exec_driver_sql(f'CREATE DATABASE "{name}"')
        yield server.set(database=name).render_as_string(hide_password=False)
    finally:
        connection.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        connection.close()
        admin.dispose()


@contextmanager
def fresh_database(backend: str, directory: Path) -> Iterator[str]:
    if backend == "sqlite":
        yield f"sqlite:///{directory / f'vramcast-{secrets.token_hex(4)}.db'}"
    else:
        with fresh_postgres_database() as url:
            yield url


@pytest.fixture(params=BACKENDS)
def blank_database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """An empty database of each backend, for migration tests."""
    with fresh_database(request.param, tmp_path) as url:
        yield url


@pytest.fixture(scope="session", params=BACKENDS)
def database_url(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """A database of each backend, migrated to head once per test session."""
    with fresh_database(request.param, tmp_path_factory.mktemp("db")) as url:
        upgrade(url)
        yield url


@pytest.fixture(scope="session")
def engine(database_url: str) -> Iterator[Engine]:
    engine = create_engine_from_url(database_url)
    yield engine
    engine.dispose()


@pytest.fixture
def session(engine: Engine) -> Iterator[Session]:
    """A session inside a transaction that is rolled back after the test.

    The session's own commits become savepoints, so code under test may commit.
    """
    with engine.connect() as connection:
        transaction = connection.begin()
        session = Session(
            bind=connection, join_transaction_mode="create_savepoint", expire_on_commit=False
        )
        try:
            yield session
        finally:
            session.close()
            transaction.rollback()
