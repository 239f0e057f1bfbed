"""Concurrent uploads from many nodes against two uvicorn servers sharing one PostgreSQL: every
accepted upload is stored exactly once and no replay is stored (the bench's load, smaller and
untimed; `make bench` reports its throughput)."""

from __future__ import annotations

from bench.store_bench import Load, run_load
from tests.store.conftest import fresh_postgres_database

SMALL_LOAD = Load(clients=12, uploads_per_client=6, replay_share=0.5, deadline_s=120.0)


def test_every_accepted_upload_is_stored_exactly_once() -> None:
    with fresh_postgres_database() as url:
        result = run_load(url, SMALL_LOAD)
    assert result.failures == {}
    assert result.uploads == SMALL_LOAD.clients * SMALL_LOAD.uploads_per_client
    assert result.replays_sent > 0 and result.replayed == result.replays_sent
    assert result.exactly_once, result
