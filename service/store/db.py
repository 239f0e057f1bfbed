"""Engines and sessions from a database URL: embedded SQLite by default, or PostgreSQL."""

from __future__ import annotations

import os
import threading
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
# Milliseconds a SQLite writer waits for another to finish before "database is locked": only
# writers of other processes wait this way, those of this process queue on its write lock.
SQLITE_BUSY_TIMEOUT_MS = 5000
# Seconds a transaction waits for this process's SQLite write lock before going on without it
# (then SQLite's busy timeout applies): a bound, so that code that holds a transaction open
# while it begins another on a second connection (a test's outer transaction) never waits
# forever. Above any wait a client sees from queued uploads (the bench: p99 about 1 s).
SQLITE_WRITE_LOCK_WAIT_S = 30.0


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


class SqliteWriteLock:
    """Serialises one process's transactions on a SQLite file, in the order they come.

    SQLite lets one writer in at a time; the others poll with growing sleeps until the busy
    timeout, and under many concurrent uploads some run out of it (a 503 the client must
    retry). Held from BEGIN to COMMIT or ROLLBACK, this lock makes them queue in the process
    instead, each waiting only for the transactions ahead of it. Any thread may release it
    (a request's session can be closed by another worker thread than the one that began it).
    """

    def __init__(self, wait_s: float = SQLITE_WRITE_LOCK_WAIT_S) -> None:
        self._lock = threading.Lock()
        self._wait_s = wait_s

    def acquire(self, connection: Any) -> None:
        # Held by the connection, not the thread: a request's transaction begins in one worker
        # thread (a dependency) and ends in another (the route), and the first thread may
        # meanwhile begin another request's transaction, which must wait like any other.
        if self._lock.acquire(timeout=self._wait_s):
            connection.info["sqlite_write_lock"] = self

    def release(self, connection: Any) -> None:
        if connection.info.pop("sqlite_write_lock", None) is self:
            self._lock.release()


# The execution option of connections that only read (see `read_only_sessions`).
READ_ONLY_OPTION = "vramcast_read_only"


def _sqlite_begin(lock: SqliteWriteLock) -> Any:
    def begin(connection: Any) -> None:
        if connection.get_execution_options().get(READ_ONLY_OPTION):
            connection.exec_driver_sql("BEGIN")
            return
        # IMMEDIATE takes the write lock at BEGIN: a transaction that reads and then writes
        # (the idempotency check, then the insert) waits for the lock instead of failing
        # with SQLITE_BUSY when another writer committed in between.
        lock.acquire(connection)
        try:
            connection.exec_driver_sql("BEGIN IMMEDIATE")
        except BaseException:
            lock.release(connection)
            raise

    return begin


def _sqlite_end(lock: SqliteWriteLock) -> Any:
    def end(connection: Any, *_args: Any) -> None:
        # Fired just before the COMMIT (or ROLLBACK) runs: the next transaction's BEGIN
        # IMMEDIATE may wait that long on SQLite's busy handler, well within its timeout.
        lock.release(connection)

    return end


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
        lock = SqliteWriteLock()
        event.listen(engine, "begin", _sqlite_begin(lock))
        event.listen(engine, "commit", _sqlite_end(lock))
        event.listen(engine, "rollback", _sqlite_end(lock))
        return engine
    connect_args = {"connect_timeout": POSTGRES_CONNECT_TIMEOUT_S, **kwargs.pop("connect_args", {})}
    kwargs.setdefault("pool_pre_ping", True)  # a replica outlives database restarts
    return create_engine(parsed, connect_args=connect_args, **kwargs)


def create_session_factory(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)


def read_only_sessions(sessions: sessionmaker[Session]) -> sessionmaker[Session]:
    """Sessions on the same engine that only read: on SQLite their transactions begin
    DEFERRED, neither taking nor waiting for the write lock (WAL lets them read while another
    connection writes). Writing through them on SQLite may fail with "database is locked"."""
    engine = sessions.kw["bind"]
    return sessionmaker(
        engine.execution_options(**{READ_ONLY_OPTION: True}), expire_on_commit=False
    )
