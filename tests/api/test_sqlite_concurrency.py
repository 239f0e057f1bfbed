"""The embedded SQLite store under concurrent uploads: one uvicorn server on a SQLite file,
clients uploading at once on loopback. Every upload is created (201) on the first try, none is
answered 503, and each is stored exactly once with its ratio (the bench's fleet, smaller)."""

from __future__ import annotations

from pathlib import Path

from bench.store_bench import Fleet, run_sqlite_fleet

SMALL_FLEET = Fleet(uploads=480, clients=16, nodes=60, window=100, deadline_s=300.0)


def test_concurrent_uploads_to_sqlite_are_all_created_once(tmp_path: Path) -> None:
    result = run_sqlite_fleet(SMALL_FLEET, directory=str(tmp_path))
    assert result.statuses == {201: SMALL_FLEET.uploads}
    assert result.stored == result.stored_keys == SMALL_FLEET.uploads
    assert result.ratios == SMALL_FLEET.uploads  # one measured level each
    assert result.exactly_once
