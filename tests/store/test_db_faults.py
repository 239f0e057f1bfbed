"""How the store tells a refused write from a database that cannot be reached, on the drivers'
own errors, and how its guard holds a database that stopped answering."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import psycopg.errors as pg
import pytest
from sqlalchemy.exc import DBAPIError

from service.store.db import (
    PROBE_ANSWER_S,
    StoreGuard,
    store_unreachable,
    write_refusal,
)


def wrapped(error: Exception) -> DBAPIError:
    """`error` as SQLAlchemy raises it."""
    base = sqlite3.Error if isinstance(error, sqlite3.Error) else pg.Error
    return DBAPIError.instance("INSERT ...", None, error, base)


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (pg.ReadOnlySqlTransaction(), "read-only"),
        (pg.DiskFull(), "disk is full"),
    ],
)
def test_postgresql_refusals_are_not_unreachable(error: Exception, reason: str) -> None:
    found = wrapped(error)
    assert reason in (write_refusal(found) or "")
    assert not store_unreachable(found)


def test_a_lost_postgresql_is_unreachable() -> None:
    for error in (pg.ConnectionTimeout(), pg.OperationalError("server closed the connection")):
        found = wrapped(error)
        assert write_refusal(found) is None and store_unreachable(found)
    assert not store_unreachable(wrapped(pg.UniqueViolation()))


def test_sqlite_refusals_come_from_the_database_itself(tmp_path: Path) -> None:
    path = tmp_path / "store.db"
    with sqlite3.connect(path) as setup:
        setup.execute("CREATE TABLE t (v BLOB)")
    read_only = sqlite3.connect(path)
    read_only.execute("PRAGMA query_only=1")
    with pytest.raises(sqlite3.OperationalError) as refused:
        read_only.execute("INSERT INTO t VALUES (x'00')")
    read_only.close()
    assert write_refusal(wrapped(refused.value)) == "the database is read-only"
    assert not store_unreachable(wrapped(refused.value))
    full = sqlite3.connect(path)
    pages = full.execute("PRAGMA page_count").fetchone()[0]
    full.execute(f"PRAGMA max_page_count={pages}")
    with pytest.raises(sqlite3.OperationalError) as no_room:
        full.execute("INSERT INTO t VALUES (zeroblob(1000000))")
    full.close()
    assert write_refusal(wrapped(no_room.value)) == "the database or its disk is full"
    locked = wrapped(sqlite3.OperationalError("database is locked"))
    assert write_refusal(locked) is None and store_unreachable(locked)


def test_the_guard_holds_a_silent_database_for_a_moment() -> None:
    now = [0.0]
    guard = StoreGuard(answer_s=2.0, hold_s=2.0, clock=lambda: now[0])
    assert not guard.held() and guard.answer_limit() == 2.0
    guard.unreachable()
    assert guard.held() and guard.answer_limit() == PROBE_ANSWER_S
    now[0] += 2.5
    assert not guard.held() and guard.answer_limit() == 2.0
    guard.unreachable()
    guard.answered()
    assert not guard.held()
