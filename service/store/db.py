"""Engines and sessions from a database URL: embedded SQLite by default, or PostgreSQL.

The service's engines (`create_engine_from_url(url, timeouts=...)`) never wait on the database
without a bound: a database that hangs (a stopped server, a lost host) costs a request a few
seconds and a 503, never a request that does not answer. On PostgreSQL every wait for the
server's answer (a statement, a commit, the pool's ping) has a deadline kept on the client
(`StoreTimeouts.answer_s`): the server's own timeouts cannot end a wait on a server that does
not run, and TCP keepalives cannot either when the server's kernel still acknowledges the
packets. A connection whose wait ran out is closed and dropped from the pool; the engine's
`StoreGuard` then remembers for a moment that the store did not answer, so that the requests
behind it fail at once instead of each waiting its own deadline.

A database that answers but refuses writes (read-only, disk full) is told apart from one that
cannot be reached (`write_refusal`), and `write_check` says cheaply, without writing, whether
a write would be refused now.
"""

from __future__ import annotations

import math
import os
import sqlite3
import threading
import time
import weakref
from collections.abc import Callable, Generator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import psycopg
from psycopg import errors as pg_errors
from psycopg.pq import TransactionStatus
from sqlalchemy import Connection, Engine, create_engine, event, text
from sqlalchemy.engine import URL, Dialect, make_url
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError
from sqlalchemy.orm import Session, sessionmaker

DATABASE_URL_ENV = "VRAMCAST_DATABASE_URL"
DEFAULT_DATABASE_URL = "sqlite:///./var/vramcast.db"
# Seconds to wait for a PostgreSQL connection: a request with the database down must fail
# fast (a 503 with Retry-After) instead of hanging until the client gives up. 2 is libpq's
# and psycopg's floor (a smaller value is taken as 2).
POSTGRES_CONNECT_TIMEOUT_S = 2
# Seconds the service waits for one answer of PostgreSQL (a statement, a commit, a ping):
# with the pool's wait and a connection's timeout, a request that needs the store answers
# within 5 s even when the database hangs. A statement of the service takes milliseconds; the
# largest of a refit (a partition's top-k at 1M ratios) 0.3-0.8 s (docs/calibration.md).
STORE_ANSWER_S = 2.0
# The server cancels a statement at this share of the client's deadline, so that a slow
# statement on a server that runs ends with its own error and keeps its connection.
SERVER_STATEMENT_SHARE = 0.75
# Milliseconds a statement waits for a lock (the refit's advisory lock, a row another
# transaction holds): the service's transactions hold locks for milliseconds.
POSTGRES_LOCK_TIMEOUT_MS = 1000
# Milliseconds a session may stay idle inside a transaction before the server ends it: a
# client that hung (or a replica that was stopped) mid-transaction releases its locks.
POSTGRES_IDLE_IN_TRANSACTION_MS = 30_000
# TCP keepalives and the user timeout end a connection whose host is gone (a partition, a
# lost VM) within seconds instead of the kernel's two hours; they do not help against a server
# whose kernel still answers (a stopped process): the client deadline above does.
TCP_KEEPALIVES_IDLE_S = 5
TCP_KEEPALIVES_INTERVAL_S = 2
TCP_KEEPALIVES_COUNT = 3
TCP_USER_TIMEOUT_MS = 5000
# Seconds a request waits for a pooled connection when every one is in use.
POOL_CHECKOUT_S = 2.0
# Seconds after the store did not answer during which new connections are not tried and a
# wait is cut to `PROBE_ANSWER_S`: requests queued behind a hung database fail at once.
UNREACHABLE_HOLD_S = 2.0
# A wait while the store is held unreachable: long enough for a server that came back (its
# answers take milliseconds), short enough that a still-hung one costs little.
PROBE_ANSWER_S = 0.25
# Seconds a write the store refused (read-only, disk full) keeps it reported as refusing
# writes (`StoreGuard.refusal`), unless a write succeeds: disk full shows only on a write.
WRITE_REFUSAL_MEMORY_S = 30.0

# Milliseconds a SQLite writer waits for another process's writer before "database is
# locked": those of this process queue on its write lock. With the lock's wait below, a
# request answers within 5 s.
SQLITE_BUSY_TIMEOUT_MS = 1500
# Seconds a transaction waits for this process's SQLite write lock before going on without it
# (then SQLite's busy timeout applies): a bound, so that code that holds a transaction open
# while it begins another on a second connection (a test's outer transaction) never waits
# forever, and a request answers in time. Above any wait a client sees from queued uploads
# (the bench: p99 about 1 s).
SQLITE_WRITE_LOCK_WAIT_S = 3.0
# A SQLite store with fewer free pages under its `max_page_count` than this refuses writes
# soon: an upload adds a few pages (its row, its ratios, their index entries).
SQLITE_MIN_FREE_PAGES = 64
# A SQLite store whose file system has less free space than this refuses writes soon.
SQLITE_MIN_FREE_BYTES = 16 * 1024 * 1024

# SQLite's primary result codes of a write the database refuses (sqlite3.h).
_SQLITE_REFUSALS = {8: "the database is read-only", 13: "the database or its disk is full"}
# PostgreSQL's SQLSTATEs of a write the database refuses (Appendix A of its manual).
_POSTGRES_REFUSALS = {
    "25006": "the database is read-only (a read-only transaction or a standby)",
    "53100": "the database's disk is full",
}


def database_url_from_env(environ: Mapping[str, str] = os.environ) -> str:
    return environ.get(DATABASE_URL_ENV) or DEFAULT_DATABASE_URL


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreTimeouts:
    """How long the service waits on PostgreSQL; SQLite's waits are the module's constants."""

    answer_s: float = STORE_ANSWER_S
    connect_s: int = POSTGRES_CONNECT_TIMEOUT_S
    pool_s: float = POOL_CHECKOUT_S
    hold_s: float = UNREACHABLE_HOLD_S

    def server_options(self) -> str:
        """libpq's `options`: the server's own timeouts, per session."""
        statement_ms = max(1, math.floor(self.answer_s * SERVER_STATEMENT_SHARE * 1000))
        return (
            f"-c statement_timeout={statement_ms} -c lock_timeout={POSTGRES_LOCK_TIMEOUT_MS} "
            f"-c idle_in_transaction_session_timeout={POSTGRES_IDLE_IN_TRANSACTION_MS}"
        )


class StoreGuard:
    """What an engine learnt of its database: whether it stopped answering a moment ago, and
    whether it refused a write lately. Shared by the threads of a process; reads are racy by
    design (a stale read costs one more try or one less)."""

    def __init__(
        self,
        *,
        answer_s: float = STORE_ANSWER_S,
        hold_s: float = UNREACHABLE_HOLD_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.answer_s = answer_s
        self.hold_s = hold_s
        self._clock = clock
        self._held_until = float("-inf")
        self._refused: tuple[str, float] | None = None

    def held(self) -> bool:
        """Whether the store did not answer less than `hold_s` ago."""
        return self._clock() < self._held_until

    def answer_limit(self) -> float:
        """Seconds the next wait for an answer may take."""
        return min(PROBE_ANSWER_S, self.answer_s) if self.held() else self.answer_s

    def unreachable(self) -> None:
        self._held_until = self._clock() + self.hold_s

    def answered(self) -> None:
        self._held_until = float("-inf")

    def refused(self, reason: str) -> None:
        self._refused = (reason, self._clock())

    def wrote(self) -> None:
        self._refused = None

    def refusal(self) -> str | None:
        """Why the store refused a write lately, or None."""
        refused = self._refused
        if refused is None or self._clock() - refused[1] > WRITE_REFUSAL_MEMORY_S:
            return None
        return refused[0]


# Each engine's guard, by its dialect: an engine's `execution_options` copies share it, and it
# outlives `dispose` (which replaces the pool).
_guards: weakref.WeakKeyDictionary[Dialect, StoreGuard] = weakref.WeakKeyDictionary()


def store_guard(engine: Engine) -> StoreGuard:
    """The guard of `engine` (a new one for an engine this module did not make)."""
    guard = _guards.get(engine.dialect)
    if guard is None:
        guard = _guards[engine.dialect] = StoreGuard()
    return guard


def write_refusal(error: BaseException) -> str | None:
    """Why the database refused a write (read-only, full), from its error; None for others."""
    original = error.orig if isinstance(error, DBAPIError) else error
    if isinstance(original, sqlite3.Error):
        code = getattr(original, "sqlite_errorcode", None)
        return None if code is None else _SQLITE_REFUSALS.get(code & 0xFF)
    sqlstate = getattr(original, "sqlstate", None)
    return _POSTGRES_REFUSALS.get(sqlstate) if isinstance(sqlstate, str) else None


def store_unreachable(error: BaseException) -> bool:
    """Whether a database error says the database cannot be reached or did not answer in
    time (not a refused write, not a bug of ours)."""
    if isinstance(error, PoolTimeoutError):
        return True
    if not isinstance(error, DBAPIError) or write_refusal(error) is not None:
        return False
    return isinstance(error, OperationalError) or error.connection_invalidated


RV = TypeVar("RV")


def _counting(gen: Generator[Any, Any, RV], waited: list[bool]) -> Generator[Any, Any, RV]:
    """`gen`, noting in `waited` whether it waited on the socket (psycopg's generators yield
    exactly when they would block): a wait that never reached the server proves nothing."""
    try:
        ready = yield next(gen)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    waited.append(True)
    while True:
        try:
            ready = yield gen.send(ready)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]


class GuardedConnection(psycopg.Connection[Any]):
    """A psycopg connection whose every wait for the server's answer has a deadline.

    psycopg runs each operation (execute, fetch, commit, rollback, the pool's ping) as a
    generator that `wait` drives on the socket: the one place to bound them all. A wait that
    runs out closes the connection (it is mid-protocol, unusable), so SQLAlchemy drops it.
    """

    guard: StoreGuard | None = None

    def wait(self, gen: Any, interval: float = 0.1, timeout: float | None = None) -> Any:
        guard = self.guard
        if guard is None:
            return super().wait(gen, interval, timeout)
        limit = guard.answer_limit() if timeout is None else min(timeout, guard.answer_limit())
        waited: list[bool] = []
        started = time.monotonic()
        try:
            result = super().wait(_counting(gen, waited), interval, limit)
        except psycopg.OperationalError as error:
            timed_out = (
                time.monotonic() - started >= limit
                and self.info.transaction_status == TransactionStatus.ACTIVE
            )
            if timed_out or self.broken:
                guard.unreachable()
                self.close()
            if timed_out:
                raise pg_errors.ConnectionTimeout(
                    f"the database gave no answer within {limit:g} s"
                ) from error
            raise
        if waited:
            guard.answered()
        return result


def _postgres_connect(guard: StoreGuard) -> Any:
    def connect(_dialect: Any, _record: Any, cargs: Any, cparams: dict[str, Any]) -> Any:
        if guard.held():
            raise pg_errors.ConnectionTimeout(
                f"the database did not answer less than {guard.hold_s:g} s ago; "
                "not connecting again yet"
            )
        try:
            connection = GuardedConnection.connect(*cargs, **cparams)
        except psycopg.OperationalError:
            guard.unreachable()
            raise
        connection.guard = guard
        guard.answered()
        return connection

    return connect


def _note_refusals(guard: StoreGuard) -> Any:
    def handle_error(context: Any) -> None:
        reason = write_refusal(context.original_exception)
        if reason is not None:
            guard.refused(reason)

    return handle_error


def _note_writes(guard: StoreGuard) -> Any:
    def commit(connection: Connection) -> None:
        # Fired before the COMMIT: a refusal at COMMIT (disk full) is noted again after it.
        if not connection.get_execution_options().get(READ_ONLY_OPTION):
            guard.wrote()

    return commit


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
    if not database or database == ":memory:":
        return None
    if database.startswith("file:"):
        path = database.removeprefix("file:").split("?", 1)[0]
        return Path(path) if path and path != ":memory:" else None
    return Path(database)


def _sqlite_read_only_url(url: URL) -> bool:
    """Whether the URL opens the file read-only (`mode=ro`, `immutable=1` of SQLite's URIs)."""
    database = url.database or ""
    query = database.split("?", 1)[1] if "?" in database else ""
    options = dict(part.partition("=")[::2] for part in query.split("&") if part)
    options.update({k: v for k, v in url.query.items() if isinstance(v, str)})
    return options.get("mode") == "ro" or options.get("immutable") == "1"


def _postgres_connect_args(timeouts: StoreTimeouts, given: Mapping[str, Any]) -> dict[str, Any]:
    options = timeouts.server_options()
    if given.get("options"):
        options = f"{options} {given['options']}"  # the URL's own settings win (they come last)
    return {
        "connect_timeout": timeouts.connect_s,
        "keepalives": 1,
        "keepalives_idle": TCP_KEEPALIVES_IDLE_S,
        "keepalives_interval": TCP_KEEPALIVES_INTERVAL_S,
        "keepalives_count": TCP_KEEPALIVES_COUNT,
        "tcp_user_timeout": TCP_USER_TIMEOUT_MS,
        **given,
        "options": options,
    }


def create_engine_from_url(
    url: str | URL, *, timeouts: StoreTimeouts | None = None, **kwargs: Any
) -> Engine:
    """An engine for `url`; SQLite gets its pragmas and its directory, PostgreSQL a connect
    timeout, and with `timeouts` (the service's engines) every wait bounded."""
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        path = _sqlite_file(parsed)
        if path is not None and not _sqlite_read_only_url(parsed):
            path.parent.mkdir(parents=True, exist_ok=True)
        connect_args = {"check_same_thread": False, **kwargs.pop("connect_args", {})}
        engine = create_engine(parsed, connect_args=connect_args, **kwargs)
        event.listen(engine, "connect", _sqlite_on_connect)
        lock = SqliteWriteLock()
        event.listen(engine, "begin", _sqlite_begin(lock))
        event.listen(engine, "commit", _sqlite_end(lock))
        event.listen(engine, "rollback", _sqlite_end(lock))
        _watch(engine, StoreGuard())
        return engine
    given = kwargs.pop("connect_args", {})
    kwargs.setdefault("pool_pre_ping", True)  # a replica outlives database restarts
    if timeouts is None:
        connect_args = {"connect_timeout": POSTGRES_CONNECT_TIMEOUT_S, **given}
        engine = create_engine(parsed, connect_args=connect_args, **kwargs)
        _watch(engine, StoreGuard())
        return engine
    kwargs.setdefault("pool_timeout", timeouts.pool_s)
    engine = create_engine(parsed, connect_args=_postgres_connect_args(timeouts, given), **kwargs)
    guard = StoreGuard(answer_s=timeouts.answer_s, hold_s=timeouts.hold_s)
    event.listen(engine, "do_connect", _postgres_connect(guard))
    _watch(engine, guard)
    return engine


def _watch(engine: Engine, guard: StoreGuard) -> None:
    _guards[engine.dialect] = guard
    event.listen(engine, "handle_error", _note_refusals(guard))
    event.listen(engine, "commit", _note_writes(guard))


def write_check(connection: Connection) -> str | None:
    """Why a write to the store would be refused now, or None; reads only what the database
    and its file system say (one round trip on PostgreSQL, pragmas and a `statvfs` on SQLite),
    and what a refused write taught the engine's guard in the last seconds."""
    refusal = store_guard(connection.engine).refusal()
    if refusal is not None:
        return refusal
    if connection.dialect.name == "postgresql":
        # On for `default_transaction_read_only`, `SET SESSION CHARACTERISTICS` and standbys.
        if connection.scalar(text("SELECT current_setting('transaction_read_only')")) == "on":
            return _POSTGRES_REFUSALS["25006"]
        return None
    return _sqlite_write_check(connection)


def _sqlite_write_check(connection: Connection) -> str | None:
    url = connection.engine.url
    if _sqlite_read_only_url(url) or connection.exec_driver_sql("PRAGMA query_only").scalar():
        return _SQLITE_REFUSALS[8]
    pages = connection.exec_driver_sql("PRAGMA page_count").scalar() or 0
    most = connection.exec_driver_sql("PRAGMA max_page_count").scalar() or 0
    unused = connection.exec_driver_sql("PRAGMA freelist_count").scalar() or 0
    if most - pages + unused < SQLITE_MIN_FREE_PAGES:
        return _SQLITE_REFUSALS[13]
    path = _sqlite_file(url)
    if path is None:
        return None
    try:
        stats = os.statvfs(path.parent)
    except OSError:
        return None
    if stats.f_flag & os.ST_RDONLY:
        return "the database's file system is mounted read-only"
    if stats.f_bavail * stats.f_frsize < SQLITE_MIN_FREE_BYTES:
        return _SQLITE_REFUSALS[13]
    return None


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
