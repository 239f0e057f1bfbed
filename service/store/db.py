"""Engines and sessions from a database URL: embedded SQLite by default, or PostgreSQL."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import URL, make_url
from sqlalchemy.orm import Session, sessionmaker

DATABASE_URL_ENV = "VRAMCAST_DATABASE_URL"
DEFAULT_DATABASE_URL = "sqlite:///./var/vramcast.db"
# Seconds to wait for a PostgreSQL connection: a request with the database down must fail
# fast (a 503 with Retry-After) instead of hanging until the client gives up.
POSTGRES_CONNECT_TIMEOUT_S = 3
# Milliseconds a SQLite writer waits for another to finish before "database is locked".
SQLITE_BUSY_TIMEOUT_MS = 5000


def database_url_from_env(environ: Mapping[str, str] = os.environ) -> str:
    return environ.get(DATABASE_URL_ENV) or DEFAULT_DATABASE_URL


def _sqlite_on_connect(dbapi_connection: Any, _record: Any) -> None:
    # Let SQLAlchemy emit BEGIN itself: pysqlite's own transaction handling breaks
    # SAVEPOINT and transactional DDL (SQLAlchemy's pysqlite "serializable" recipe).
    dbapi_connection.isolation_level = None
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute("PRAGMA journal_mode=WAL")  # readers do not block the writer
        cursor.execute("PRAGMA synchronous=NORMAL")  # durable at checkpoints; safe with WAL
        cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
    finally:
        cursor.close()


def _sqlite_begin(connection: Any) -> None:
    # IMMEDIATE takes the write lock at BEGIN: a transaction that reads and then writes
    # (the idempotency check, then the insert) waits for the lock instead of failing with
    # SQLITE_BUSY when another writer committed in between.
    connection.exec_driver_sql("BEGIN IMMEDIATE")


def _sqlite_file(url: URL) -> Path | None:
    database = url.database
    if not database or database == ":memory:" or database.startswith("file:"):
        return None
    return Path(database)


def create_engine_from_url(url: str | URL, **kwargs: Any) -> Engine:
    """An engine for `url`; SQLite gets its pragmas and its directory, PostgreSQL a timeout."""
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        path = _sqlite_file(parsed)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
        connect_args = {"check_same_thread": False, **kwargs.pop("connect_args", {})}
        engine = create_engine(parsed, connect_args=connect_args, **kwargs)
        event.listen(engine, "connect", _sqlite_on_connect)
        event.listen(engine, "begin", _sqlite_begin)
        return engine
    connect_args = {"connect_timeout": POSTGRES_CONNECT_TIMEOUT_S, **kwargs.pop("connect_args", {})}
    kwargs.setdefault("pool_pre_ping", True)  # a replica outlives database restarts
    return create_engine(parsed, connect_args=connect_args, **kwargs)


def create_session_factory(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)
