"""Calibration uploads under load: many training nodes upload at once to two uvicorn servers
that share one PostgreSQL database, all on loopback, bounded in count and in time.

Some uploads are sent twice at the same moment, once to each server, with the same
Idempotency-Key and body, as a node's retry after a timeout would be. Afterwards the database
must hold every accepted upload exactly once and no replay. `run()` gives the figures for
`make bench`: uploads per second, latency percentiles, and the servers' CPU time per upload
(which, unlike the first two, other work on the machine does not skew). PostgreSQL comes from
VRAMCAST_BENCH_POSTGRES_URL (default: the local server); a scratch database is created next to
it and dropped at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import secrets
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import httpx
from sqlalchemy import create_engine, func, select
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError
from sqlalchemy.pool import NullPool

from bench.api_bench import _cpu_seconds, _free_port, _server
from service.store.db import create_engine_from_url, create_session_factory
from service.store.keys import KeyScope, create_key
from service.store.migrate import upgrade
from service.store.models import CalibrationUpload

POSTGRES_URL_ENV = "VRAMCAST_BENCH_POSTGRES_URL"
DEFAULT_POSTGRES_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
LOOPBACK = "127.0.0.1"
SERVERS = 2
REQUEST_TIMEOUT_S = 30.0
# Jobs the nodes report, as small models a fleet fine-tunes (each node reports one).
JOBS: tuple[dict[str, Any], ...] = (
    {"model": "Qwen/Qwen2.5-0.5B", "batch_size": 4, "seq_len": 1024},
    {"model": "Qwen/Qwen2.5-1.5B", "batch_size": 2, "seq_len": 2048},
    {"model": "meta-llama/Llama-3.2-1B", "batch_size": 8, "seq_len": 512},
)
GPU = {"name": "NVIDIA H100 80GB HBM3", "memory_total_bytes": 85_520_809_984}


@dataclass(frozen=True, slots=True, kw_only=True)
class Load:
    """How many nodes upload how much, and for how long at most."""

    clients: int = 64
    uploads_per_client: int = 20
    replay_share: float = 0.25  # uploads sent twice at once, once to each server
    deadline_s: float = 120.0  # no new upload starts after this


@dataclass(slots=True, kw_only=True)
class _Tally:
    latencies: list[float] = field(default_factory=list)
    statuses: Counter[int] = field(default_factory=Counter)
    # Idempotency-Key -> the upload ids its answers named, and how many 201s it got.
    ids: dict[str, set[int]] = field(default_factory=dict)
    created: Counter[str] = field(default_factory=Counter)
    replays_sent: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadResult:
    uploads: int  # distinct uploads accepted (each Idempotency-Key answered 201 or 200)
    requests: int  # every request sent, replays included
    replays_sent: int
    replayed: int  # answered 200 with Idempotent-Replayed
    failures: dict[int, int]  # status -> count, for everything not 200 or 201
    stored: int  # rows in the database afterwards
    stored_keys: int  # distinct Idempotency-Keys among them
    created_twice: int  # keys answered 201 more than once
    split_ids: int  # keys whose answers named different upload ids
    unaccepted_stored: int  # rows whose key no answer accepted
    seconds: float
    latencies: list[float]
    server_cpu_s: float | None  # both servers' CPU time during the load (Linux), else None

    @property
    def exactly_once(self) -> bool:
        """Every accepted upload stored once; no replay, and nothing unaccepted, stored."""
        return (
            self.stored == self.uploads == self.stored_keys
            and self.created_twice == 0
            and self.split_ids == 0
            and self.unaccepted_stored == 0
        )

    @property
    def uploads_per_s(self) -> float:
        return self.uploads / self.seconds

    @property
    def server_cpu_ms_per_upload(self) -> float | None:
        """Server CPU per accepted upload: unlike uploads/s, other work on the machine does not
        change it."""
        return None if self.server_cpu_s is None else 1e3 * self.server_cpu_s / self.uploads

    def percentile_ms(self, q: float) -> float:
        ordered = sorted(self.latencies)
        return 1e3 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@contextlib.contextmanager
def scratch_postgres_database(server_url: str) -> Iterator[str]:
    """A new PostgreSQL database on the server at `server_url`; dropped on exit."""
    server = make_url(server_url)
    admin = create_engine(
        server,
        isolation_level="AUTOCOMMIT",
        poolclass=NullPool,
        connect_args={"connect_timeout": 3},
    )
    name = f"vramcast_bench_{os.getpid()}_{secrets.token_hex(4)}"
    try:
        with admin.connect() as connection:
            connection.exec_driver_sql(f'CREATE DATABASE "{name}"')
        yield server.set(database=name).render_as_string(hide_password=False)
    finally:
        with contextlib.suppress(OperationalError), admin.connect() as connection:
            connection.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.dispose()


@dataclass(frozen=True, slots=True)
class Server:
    url: str
    pid: int


@contextlib.contextmanager
def servers(database_url: str, count: int = SERVERS) -> Iterator[list[Server]]:
    """`count` uvicorn server processes on loopback ports, all on `database_url`."""
    with contextlib.ExitStack() as stack:
        started = []
        for _ in range(count):
            port = _free_port()
            process = stack.enter_context(_server(port, database_url))
            started.append(Server(url=f"http://{LOOPBACK}:{port}", pid=process.pid))
        yield started


def _cpu_of(started: list[Server]) -> float | None:
    seconds = [_cpu_seconds(server.pid) for server in started]
    return None if None in seconds else sum(s or 0.0 for s in seconds)


def _upload_key(database_url: str) -> str:
    engine = create_engine_from_url(database_url)
    try:
        with create_session_factory(engine).begin() as session:
            issued = create_key(
                session, scopes=[KeyScope.UPLOAD], name="bench fleet", now=datetime.now(UTC)
            )
            return issued.token
    finally:
        engine.dispose()


async def _node(
    index: int,
    clients: list[httpx.AsyncClient],
    load: Load,
    deadline: float,
    tally: _Tally,
) -> None:
    """One training node: asks for its job's estimate, then uploads its runs' peaks."""
    rng = random.Random(index)
    job = JOBS[index % len(JOBS)]
    estimate = await clients[index % len(clients)].post("/v1/estimates", json=job)
    device = estimate.json()["estimated"]["device_bytes"]
    for run in range(load.uploads_per_client):
        if time.perf_counter() > deadline:
            return
        body = {
            "job": job,
            "gpu": GPU,
            "measured": {"device_bytes": round(device * rng.uniform(0.95, 1.25))},
            "environment": {"torch": "2.5.1+cu124", "cuda": "12.4"},
            "node_id": f"bench-node-{index}",
            "run_id": f"bench-run-{index}-{run}",
        }
        key = str(uuid.uuid4())
        first = (index + run) % len(clients)
        targets = [clients[first]]
        if rng.random() < load.replay_share:
            targets.append(clients[(first + 1) % len(clients)])
            tally.replays_sent += 1
        await asyncio.gather(*(_send(client, body, key, tally) for client in targets))


async def _send(client: httpx.AsyncClient, body: dict[str, Any], key: str, tally: _Tally) -> None:
    started = time.perf_counter()
    response = await client.post("/v1/calibrations", json=body, headers={"Idempotency-Key": key})
    tally.latencies.append(time.perf_counter() - started)
    tally.statuses[response.status_code] += 1
    if response.status_code in (200, 201):
        tally.ids.setdefault(key, set()).add(response.json()["id"])
    if response.status_code == 201:
        tally.created[key] += 1


async def _drive(urls: list[str], token: str, load: Load) -> tuple[_Tally, float]:
    tally = _Tally()
    limits = httpx.Limits(max_connections=load.clients, max_keepalive_connections=load.clients)
    headers = {"Authorization": f"Bearer {token}"}
    async with contextlib.AsyncExitStack() as stack:
        clients = [
            await stack.enter_async_context(
                httpx.AsyncClient(
                    base_url=url, headers=headers, limits=limits, timeout=REQUEST_TIMEOUT_S
                )
            )
            for url in urls
        ]
        started = time.perf_counter()
        deadline = started + load.deadline_s
        await asyncio.gather(
            *(_node(i, clients, load, deadline, tally) for i in range(load.clients))
        )
        seconds = time.perf_counter() - started
    return tally, seconds


def _stored(database_url: str) -> tuple[int, set[str]]:
    engine = create_engine(database_url, poolclass=NullPool)
    try:
        with engine.connect() as connection:
            rows = connection.scalar(select(func.count()).select_from(CalibrationUpload)) or 0
            keys = set(connection.scalars(select(CalibrationUpload.idempotency_key)).all())
    finally:
        engine.dispose()
    return rows, {key for key in keys if key is not None}


def run_load(database_url: str, load: Load = Load()) -> LoadResult:
    """Migrate `database_url`, start the servers on it, run `load`, and count what is stored."""
    upgrade(database_url)
    token = _upload_key(database_url)
    with servers(database_url) as started:
        cpu_before = _cpu_of(started)
        tally, seconds = asyncio.run(_drive([server.url for server in started], token, load))
        cpu_after = _cpu_of(started)
    rows, stored_keys = _stored(database_url)
    return LoadResult(
        uploads=len(tally.ids),
        requests=sum(tally.statuses.values()),
        replays_sent=tally.replays_sent,
        replayed=tally.statuses[200],
        failures={s: n for s, n in sorted(tally.statuses.items()) if s not in (200, 201)},
        stored=rows,
        stored_keys=len(stored_keys),
        created_twice=sum(1 for n in tally.created.values() if n > 1),
        split_ids=sum(1 for ids in tally.ids.values() if len(ids) > 1),
        unaccepted_stored=len(stored_keys - set(tally.ids)),
        seconds=seconds,
        latencies=tally.latencies,
        server_cpu_s=None if cpu_before is None or cpu_after is None else cpu_after - cpu_before,
    )


def run(load: Load = Load()) -> dict[str, Any]:
    """The `make bench` figures, on a scratch database of the local PostgreSQL server."""
    server_url = os.environ.get(POSTGRES_URL_ENV) or DEFAULT_POSTGRES_URL
    with contextlib.ExitStack() as stack:
        try:
            database_url = stack.enter_context(scratch_postgres_database(server_url))
        except OperationalError as error:
            return {"skipped": f"PostgreSQL unreachable at {server_url}: {error.orig}"}
        result = run_load(database_url, load)
    cpu = result.server_cpu_ms_per_upload
    return {
        "setup": f"{load.clients} nodes x {load.uploads_per_client} uploads, {SERVERS} uvicorn "
        f"servers, one PostgreSQL, loopback, {os.cpu_count()} CPUs",
        "uploads/s": round(result.uploads_per_s, 1),
        "p50 ms": round(result.percentile_ms(0.50), 1),
        "p99 ms": round(result.percentile_ms(0.99), 1),
        "server CPU ms/upload": "n/a" if cpu is None else round(cpu, 2),
        "load average": " ".join(f"{value:.1f}" for value in os.getloadavg()),
        "uploads accepted": result.uploads,
        "replays sent / answered": f"{result.replays_sent} / {result.replayed}",
        "rows stored": result.stored,
        "failures": result.failures or "none",
        "exactly once": result.exactly_once,
        "seconds": round(result.seconds, 2),
    }


if __name__ == "__main__":
    for name, value in run().items():
        print(f"{name:<26}{value}")
