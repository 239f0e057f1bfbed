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
from service.calibration.factors import FACTOR_TTL_S, REFRESH_TICK_S
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
    servers: int = SERVERS


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
            # One key for the whole fleet: these benches count uploads, not votes.
            issued = create_key(
                session,
                scopes=[KeyScope.UPLOAD],
                name="bench fleet",
                now=datetime.now(UTC),
                nodes=["*"],
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
    with servers(database_url, load.servers) as started:
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
    """The `make bench` figures: the two-server load and the stored ratios' scale on a scratch
    database of the local PostgreSQL server, and the embedded SQLite store's fleet."""
    figures = {f"two servers: {k}": v for k, v in run_two_servers(load).items()}
    figures.update(fleet_figures(run_sqlite_fleet()))
    figures.update(scale_figures(os.environ.get(POSTGRES_URL_ENV) or DEFAULT_POSTGRES_URL))
    return figures


def run_two_servers(load: Load = Load()) -> dict[str, Any]:
    """Two servers on one PostgreSQL database: throughput, latency, exactly once."""
    server_url = os.environ.get(POSTGRES_URL_ENV) or DEFAULT_POSTGRES_URL
    with contextlib.ExitStack() as stack:
        try:
            database_url = stack.enter_context(scratch_postgres_database(server_url))
        except OperationalError as error:
            return {"skipped": f"PostgreSQL unreachable at {server_url}: {error.orig}"}
        result = run_load(database_url, load)
    cpu = result.server_cpu_ms_per_upload
    return {
        "setup": f"{load.clients} nodes x {load.uploads_per_client} uploads, "
        f"{load.servers} uvicorn servers, one PostgreSQL, loopback, {os.cpu_count()} CPUs",
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


# --- The embedded SQLite store under a fleet's uploads --------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Fleet:
    """Uploads from many nodes through a few concurrent clients to one server on SQLite."""

    uploads: int = 20_000
    clients: int = 16
    nodes: int = 60
    window: int = 2_000  # the first and the last this many uploads are compared
    deadline_s: float = 1_200.0  # no new upload starts after this


@dataclass(frozen=True, slots=True, kw_only=True)
class FleetResult:
    fleet: Fleet
    statuses: dict[int, int]  # status -> count, every request
    finished_at: list[float]  # seconds from the start at which each 201 came back, in order
    stored: int  # uploads in the database afterwards
    stored_keys: int  # distinct Idempotency-Keys among them
    ratios: int  # ratios in the database afterwards
    latencies: list[float]

    @property
    def created(self) -> int:
        return self.statuses.get(201, 0)

    def rate(self, first: bool) -> float:
        """Uploads per second over the first (or last) `window` uploads created."""
        times = self.finished_at
        window = min(self.fleet.window, len(times) - 1)
        if window < 1:
            return 0.0
        span = times[window] - times[0] if first else times[-1] - times[-1 - window]
        return window / span if span > 0 else float("inf")

    @property
    def exactly_once(self) -> bool:
        return self.stored == self.stored_keys == self.created


async def _fleet_client(
    client: httpx.AsyncClient,
    fleet: Fleet,
    counter: Iterator[int],
    devices: dict[str, int],
    started: float,
    tally: dict[str, Any],
) -> None:
    for index in counter:
        if time.perf_counter() - started > fleet.deadline_s:
            return
        node = index % fleet.nodes
        job = JOBS[node % len(JOBS)]
        rng = random.Random(index)
        body = {
            "job": job,
            "gpu": GPU,
            "measured": {"device_bytes": round(devices[job["model"]] * rng.uniform(0.95, 1.25))},
            "environment": {"torch": "2.5.1+cu124", "cuda": "12.4"},
            "node_id": f"fleet-node-{node}",
            "run_id": f"fleet-run-{index}",
        }
        sent = time.perf_counter()
        response = await client.post(
            "/v1/calibrations", json=body, headers={"Idempotency-Key": f"fleet-{index}"}
        )
        done = time.perf_counter()
        tally["latencies"].append(done - sent)
        tally["statuses"][response.status_code] += 1
        if response.status_code == 201:
            tally["finished_at"].append(done - started)


async def _drive_fleet(url: str, token: str, fleet: Fleet) -> dict[str, Any]:
    tally: dict[str, Any] = {"latencies": [], "statuses": Counter(), "finished_at": []}
    limits = httpx.Limits(max_connections=fleet.clients, max_keepalive_connections=fleet.clients)
    headers = {"Authorization": f"Bearer {token}"}
    async with httpx.AsyncClient(
        base_url=url, headers=headers, limits=limits, timeout=REQUEST_TIMEOUT_S
    ) as client:
        devices = {}
        for job in JOBS:
            estimate = await client.post("/v1/estimates", json=job)
            devices[job["model"]] = estimate.json()["estimated"]["device_bytes"]
        counter = iter(range(fleet.uploads))  # shared: each client takes the next upload
        started = time.perf_counter()
        await asyncio.gather(
            *(
                _fleet_client(client, fleet, counter, devices, started, tally)
                for _ in range(fleet.clients)
            )
        )
    tally["finished_at"].sort()
    return tally


def run_sqlite_fleet(fleet: Fleet = Fleet(), directory: str | None = None) -> FleetResult:
    """`fleet` against one server on a fresh SQLite file (in `directory`, or a temporary one)."""
    import tempfile

    from service.store.models import CalibrationRatio

    with tempfile.TemporaryDirectory(dir=directory) as scratch:
        database_url = f"sqlite:///{scratch}/fleet.db"
        upgrade(database_url)
        token = _upload_key(database_url)
        with servers(database_url, 1) as started:
            tally = asyncio.run(_drive_fleet(started[0].url, token, fleet))
        engine = create_engine(database_url, poolclass=NullPool)
        try:
            with engine.connect() as connection:
                stored = connection.scalar(select(func.count()).select_from(CalibrationUpload))
                keys = connection.scalar(
                    select(func.count(CalibrationUpload.idempotency_key.distinct()))
                )
                ratios = connection.scalar(select(func.count()).select_from(CalibrationRatio))
        finally:
            engine.dispose()
    return FleetResult(
        fleet=fleet,
        statuses=dict(sorted(tally["statuses"].items())),
        finished_at=tally["finished_at"],
        stored=stored or 0,
        stored_keys=keys or 0,
        ratios=ratios or 0,
        latencies=tally["latencies"],
    )


# Targets the fleet figures are printed next to.
FLEET_RATE_KEPT = 2 / 3  # the last window's rate over the first's, at least
SCALE_P99_GROWTH = 2.0  # upload p99 at the largest size over the smallest's, at most
SCALE_PICKUP_S = 10.0  # from an upload to every replica serving its factors, at most


def fleet_figures(result: FleetResult) -> dict[str, Any]:
    fleet = result.fleet
    first, last = result.rate(first=True), result.rate(first=False)
    ordered = sorted(result.latencies)
    p99 = 1e3 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] if ordered else 0.0
    failures = {s: n for s, n in result.statuses.items() if s != 201}
    kept = last / first if first else 0.0
    return {
        "sqlite fleet: setup": f"{fleet.uploads} uploads, {fleet.clients} concurrent clients, "
        f"{fleet.nodes} nodes, 1 uvicorn server, loopback",
        "sqlite fleet: created (target: all)": f"{result.created} of {fleet.uploads}",
        "sqlite fleet: 503s (target: 0)": result.statuses.get(503, 0),
        "sqlite fleet: other failures": failures or "none",
        "sqlite fleet: stored exactly once": result.exactly_once,
        f"sqlite fleet: first {fleet.window} uploads/s": round(first, 1),
        f"sqlite fleet: last {fleet.window} uploads/s": round(last, 1),
        f"sqlite fleet: last/first (target >= {FLEET_RATE_KEPT:.2f})": round(kept, 2),
        "sqlite fleet: upload p99 ms": round(p99, 1),
        "sqlite fleet: load average": " ".join(f"{v:.1f}" for v in os.getloadavg()),
    }


# --- Uploads and factor loads over many stored ratios (PostgreSQL) --------------------------

SCALE_SIZES = (10_000, 100_000, 1_000_000)  # stored ratios
SCALE_MODELS = 30
SCALE_NODES = 60
SCALE_UPLOADS = 300  # uploads timed at each size
SCALE_THREADS = 8  # concurrent uploaders
SCALE_VERSION = "bench-scale"
SCALE_ENVIRONMENT = {"torch": "2.5.1+cu124", "cuda": "12.4"}
_LEVELS = ("allocated", "reserved", "device")  # three ratios per synthetic upload


def _stand_in_estimate(job: Any) -> Any:
    """An estimate read off the job (the store's cost is timed, not the estimator's)."""
    from service.core.result import Estimate, ParamCounts, Phase

    gib = 2**30
    allocated = int(job["estimate_gib"] * gib)
    return Estimate(
        allocated_bytes=allocated,
        reserved_bytes=allocated * 11 // 10,
        device_bytes=allocated * 12 // 10,
        device_bytes_upper=allocated * 14 // 10,
        components={},
        overheads={},
        peak_step=1,
        peak_phase=Phase.BACKWARD_START,
        phases=(),
        params=ParamCounts(total=1, trainable=1),
        upper_margin=0.15,
        assumptions=(),
        warnings=(),
        estimator_version=SCALE_VERSION,
    )


# A node's key: its id and its prefix (the voter of its ratios).
NodeKey = tuple[int, str]


def _bulk_insert(database_url: str, keys: list[NodeKey], count: int) -> None:
    """`count` synthetic uploads with three ratios each, by COPY (psycopg's), then vacuumed;
    node i's uploads with `keys[i]`."""
    import json

    from service.calibration.factors import environment_key

    rng = random.Random(count)
    now = datetime.now(UTC).isoformat()
    environment = json.dumps(SCALE_ENVIRONMENT)
    key = environment_key(SCALE_ENVIRONMENT)
    engine = create_engine(database_url, poolclass=NullPool)
    try:
        raw = engine.raw_connection()
        try:
            connection = raw.driver_connection
            assert connection is not None
            with connection.cursor() as cursor:
                cursor.execute("SELECT coalesce(max(id), 0) + 1 FROM calibration_upload")
                first_id = int(cursor.fetchone()[0])
                cursor.execute("SELECT coalesce(max(id), 0) + 1 FROM calibration_ratio")
                first_ratio_id = int(cursor.fetchone()[0])
                uploads = [
                    (
                        f"bench/model-{rng.randrange(SCALE_MODELS)}",
                        rng.randrange(SCALE_NODES),
                        "oom" if rng.random() < 0.05 else "completed",
                    )
                    for _ in range(count)
                ]
                base = 10 * 2**30
                with cursor.copy(
                    "COPY calibration_upload (id, received_at, api_key_id, request_hash, model,"
                    " method, job, gpu_name, gpu_memory_total_bytes, measured_allocated_bytes,"
                    " measured_reserved_bytes, measured_device_bytes, outcome, environment,"
                    " node_id, run_id) FROM STDIN"
                ) as copy:
                    for upload_id, (model, node, outcome) in enumerate(uploads, first_id):
                        copy.write_row(
                            (
                                upload_id,
                                now,
                                keys[node][0],
                                "0" * 64,
                                model,
                                "lora",
                                "{}",
                                GPU["name"],
                                GPU["memory_total_bytes"],
                                base,
                                base * 11 // 10,
                                base * 12 // 10,
                                outcome,
                                environment,
                                f"scale-node-{node}",
                                f"scale-run-{upload_id}",
                            )
                        )
                with cursor.copy(
                    "COPY calibration_ratio (id, upload_id, estimator_version, level,"
                    " estimated_bytes, ratio, method, model, voter, gpu_name, environment_key,"
                    " outcome, computed_at) FROM STDIN"
                ) as copy:
                    for offset, (model, node, outcome) in enumerate(uploads):
                        for index, level in enumerate(_LEVELS):
                            copy.write_row(
                                (
                                    first_ratio_id + 3 * offset + index,
                                    first_id + offset,
                                    SCALE_VERSION,
                                    level,
                                    10 * 2**30,
                                    rng.lognormvariate(0.1, 0.05),
                                    "lora",
                                    model,
                                    keys[node][1],
                                    GPU["name"],
                                    key,
                                    outcome,
                                    now,
                                )
                            )
                last = first_id + count - 1
                cursor.execute(
                    "SELECT setval(pg_get_serial_sequence('calibration_upload', 'id'), %s)",
                    (last,),
                )
                cursor.execute(
                    "SELECT setval(pg_get_serial_sequence('calibration_ratio', 'id'), %s)",
                    (first_ratio_id + 3 * count - 1,),
                )
                # Changes naming no model: every model of the partition is refitted.
                cursor.execute(
                    "INSERT INTO calibration_change (estimator_version, method, level) "
                    "SELECT %s, 'lora', unnest(%s::text[])",
                    (SCALE_VERSION, list(_LEVELS)),
                )
            connection.commit()
            # What autovacuum does after a bulk load (its insert threshold): statistics, and
            # the visibility map that lets a refit's queries read the index alone.
            connection.autocommit = True
            with connection.cursor() as cursor:
                cursor.execute("VACUUM ANALYZE calibration_upload, calibration_ratio")
        finally:
            raw.close()
    finally:
        engine.dispose()


def _time_uploads(
    sessions: Any, keys: list[NodeKey], tag: str, uploads: int = SCALE_UPLOADS
) -> list[float]:
    """`uploads` uploads through the store, SCALE_THREADS at a time (upload i of model
    i mod SCALE_MODELS); each one's seconds."""
    from concurrent.futures import ThreadPoolExecutor

    from service.calibration.uploads import NewUpload, submit_upload
    from service.core.calibration import EMPTY_TABLE, Measured, Outcome

    def one(index: int) -> float:
        upload = NewUpload(
            job={"estimate_gib": 10.0},
            model=f"bench/model-{index % SCALE_MODELS}",
            method="lora",
            gpu_name=str(GPU["name"]),
            gpu_memory_total_bytes=int(str(GPU["memory_total_bytes"])),
            measured=Measured(device_bytes=13 * 2**30),
            outcome=Outcome.COMPLETED,
            environment=SCALE_ENVIRONMENT,
            node_id=f"scale-node-{index % SCALE_NODES}",
            run_id=f"timed-{tag}-{index}",
        )
        started = time.perf_counter()
        with sessions() as session:
            submit_upload(
                session,
                upload,
                api_key_id=keys[index % SCALE_NODES][0],
                idempotency_key=f"timed-{tag}-{index}",
                estimate=_stand_in_estimate,
                factors=EMPTY_TABLE,
                render=lambda receipt: {"id": receipt.upload_id},
            )
            session.commit()
        return time.perf_counter() - started

    with ThreadPoolExecutor(SCALE_THREADS) as pool:
        return list(pool.map(one, range(uploads)))


def run_scale(server_url: str, sizes: tuple[int, ...] = SCALE_SIZES) -> list[dict[str, Any]]:
    """At each size of stored ratios: upload throughput and p99; the refit after a burst of
    uploads of every model; the time from one upload to a replica's load serving it (the
    replica's refit and read, as `FactorCache` runs it); and a full refit in Python, which the
    served factors must equal."""
    from service.calibration.factors import (
        factor_loader,
        fit_factor_table,
        refresh_factors,
    )
    from service.core.calibration import Level

    rows = []
    with scratch_postgres_database(server_url) as database_url:
        upgrade(database_url)
        engine = create_engine_from_url(database_url, pool_size=SCALE_THREADS + 2)
        sessions = create_session_factory(engine)
        load = factor_loader(sessions, SCALE_VERSION)
        try:
            with sessions.begin() as session:
                made = [
                    create_key(
                        session,
                        scopes=[KeyScope.UPLOAD],
                        name=f"scale {node}",
                        now=datetime.now(UTC),
                        nodes=[f"scale-node-{node}"],
                    ).key
                    for node in range(SCALE_NODES)
                ]
                keys = [(key.id, key.prefix) for key in made]
            stored_uploads = 0
            for size in sizes:
                count = size // len(_LEVELS) - stored_uploads
                started = time.perf_counter()
                _bulk_insert(database_url, keys, count)
                insert_s = time.perf_counter() - started
                stored_uploads += count
                with sessions.begin() as session:  # the bulk rows' factors, before timing
                    started = time.perf_counter()
                    refresh_factors(session, SCALE_VERSION)
                    refit_all_s = time.perf_counter() - started
                wall = time.perf_counter()
                latencies = _time_uploads(sessions, keys, str(size))
                wall = time.perf_counter() - wall
                with sessions.begin() as session:
                    started = time.perf_counter()
                    refitted = refresh_factors(session, SCALE_VERSION)
                    burst_s = time.perf_counter() - started
                before = load()
                # One upload (of model 0), then a replica's load: the refit of what it
                # changed, and the read of the stored factors.
                upload_s = _time_uploads(sessions, keys, f"{size}-one", uploads=1)[0]
                started = time.perf_counter()
                served = load()
                pickup_s = time.perf_counter() - started
                model = {"model": "bench/model-0", "method": "lora", "level": Level.DEVICE}
                old, new = before.lookup(**model), served.lookup(**model)
                assert old is not None and new is not None
                assert new.factor.runs == old.factor.runs + 1, "the upload is not served"
                with sessions() as session:
                    started = time.perf_counter()
                    full = fit_factor_table(
                        session, SCALE_VERSION, method="lora", level=Level.DEVICE
                    )
                    full_s = time.perf_counter() - started
                partition = {
                    key: factor
                    for key, factor in served.factors.items()
                    if key.method == "lora" and key.level is Level.DEVICE
                }
                assert partition == full.factors, "stored factors differ from a full refit"
                ordered = sorted(latencies)
                rows.append(
                    {
                        "ratios": size,
                        "bulk insert s": round(insert_s, 1),
                        "uploads/s": round(SCALE_UPLOADS / wall, 1),
                        "upload p50 ms": round(1e3 * ordered[len(ordered) // 2], 1),
                        "upload p99 ms": round(1e3 * ordered[int(0.99 * len(ordered))], 1),
                        "one upload ms": round(1e3 * upload_s, 1),
                        "one upload -> a replica's load serves it s": round(pickup_s, 2),
                        # The replica that took the upload reloads at its next tick; the
                        # others once their factors pass the TTL.
                        f"upload -> every replica serves it, at most s (target <= "
                        f"{SCALE_PICKUP_S:g})": round(FACTOR_TTL_S + REFRESH_TICK_S + pickup_s, 2),
                        f"refit after {SCALE_UPLOADS} uploads of {SCALE_MODELS} models s": round(
                            burst_s, 2
                        ),
                        "partitions refitted": refitted,
                        "refit of every model, 3 partitions s": round(refit_all_s, 2),
                        "factors": len(served.factors),
                        "full refit of the partition in Python s": round(full_s, 2),
                    }
                )
        finally:
            engine.dispose()
    return rows


def scale_figures(server_url: str, sizes: tuple[int, ...] = SCALE_SIZES) -> dict[str, Any]:
    try:
        rows = run_scale(server_url, sizes)
    except OperationalError as error:
        return {"scale: skipped": f"PostgreSQL unreachable at {server_url}: {error.orig}"}
    figures: dict[str, Any] = {
        "scale: setup": f"PostgreSQL, synthetic ratios ({SCALE_MODELS} models, {SCALE_NODES} "
        f"nodes with a key each, 3 levels) by COPY; {SCALE_UPLOADS} uploads timed, "
        f"{SCALE_THREADS} at a time, in process (stand-in estimator)",
    }
    for row in rows:
        size = row.pop("ratios")
        for name, value in row.items():
            figures[f"scale {size:>9,}: {name}"] = value
    if len(rows) >= 2:
        growth = rows[-1]["upload p99 ms"] / max(rows[0]["upload p99 ms"], 1e-9)
        figures[
            f"scale: p99 at {sizes[-1]:,} / at {sizes[0]:,} (target <= {SCALE_P99_GROWTH:g})"
        ] = round(growth, 2)
    figures["scale: every replica serves an upload within"] = (
        f"{FACTOR_TTL_S:g} s TTL + {REFRESH_TICK_S:g} s tick + a replica's load after the upload"
    )
    figures["scale: load average"] = " ".join(f"{v:.1f}" for v in os.getloadavg())
    return figures


if __name__ == "__main__":
    for name, value in run().items():
        print(f"{name:<44}{value}")
