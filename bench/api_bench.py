"""Throughput and latency of the API on a real server, its start-up and memory, and the core's
in-process costs.

One uvicorn server process on a loopback port (one worker, an embedded SQLite store in a
temporary directory) is timed from its start to the first 200 from /readyz, then driven by
keep-alive connections that send pre-encoded requests and read no more of each response than
its status and length (asyncio protocols, one callback per response), so that the clients cost
a fraction of what the server does per request and the server is what saturates. First a
trivial endpoint (GET /livez), then POST /v1/estimates with a few repeated job bodies (answers
kept), then with a new job on every request, each after a warm-up; then the batch route with
1000 distinct jobs a request, no job of the run asked twice; all on the same server in one
run, whose resident memory is read after start-up and after the loads. The server's own CPU
time per request is read from /proc where available. In process: one `estimate()` call, and a
fit-check over every catalog GPU with its max-batch and max-seq answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from service.core.spec import TrainingSpec

CONCURRENCY = 32  # clients with a request in flight at any time
# Processes the clients run in: all CPUs but the server's, at most 8.
CLIENT_PROCESSES = max(1, min(8, (os.cpu_count() or 2) - 1))
CLIENT_START_S = 1.0  # time for the client processes to start before the warm-up
# Below this share of busy time the server is not what limits requests per second.
SATURATED = 0.8
WARMUP_S = 1.0
DURATION_S = 5.0  # per endpoint
STARTUP_TIMEOUT_S = 30.0
READY_POLL_S = 0.01  # start-up is timed to within this
# The example job; the batch size and sequence length vary between requests, as a
# scheduler's jobs do.
ESTIMATE_JOB: dict[str, Any] = {
    "model": "Qwen/Qwen2.5-7B-Instruct",
    "method": "qlora",
    "lora": {"r": 16, "lora_alpha": 32, "lora_dropout": 0.05, "target_modules": "all-linear"},
    "quantization": {"type": "nf4", "double_quant": True, "prepare_kbit": True},
    "autocast": True,
    "optim": "paged_adamw_8bit",
    "gradient_checkpointing": True,
    "gpu": "A100-80GB",
}
SHAPES = [(b, s) for b in (1, 2, 4, 8) for s in (512, 1024, 2048, 4096)]
# A new job on every request: more distinct bodies than the server keeps answers for
# (Settings.estimate_cache_entries, 4096 by default), sent in a cycle, so that none is kept.
NEW_JOB_SHAPES = [(b, s) for b in range(1, 9) for s in range(1024, 2048)]
# The batch route: BATCH_JOBS distinct jobs a request, every job of the run a new shape
# (batch sizes 1-16, sequences from 2048 up), so that no job is asked twice; the first
# BATCH_WARMUP requests replay the allocator at the powers of two around these shapes.
BATCH_JOBS = 1000
BATCH_WARMUP = 2
BATCH_REQUESTS = 8
BATCH_SIZES = 16
BATCH_FIRST_SEQ = 2048
# Targets from the issues and the core.
ESTIMATE_OVERHEAD_TARGET = 0.20  # repeated bodies: time per request over GET /livez
NEW_JOB_RATIO_TARGET = 0.75  # new bodies: at least this share of GET /livez's requests/s
BATCH_TARGET_PER_S = 20_000  # estimates a second through the batch route
CORE_ESTIMATE_TARGET_S = 50e-6
FIT_CHECK_TARGET_S = 1e-3  # the 37-GPU catalog, solved in process
FIT_CHECK_HTTP_TARGET_S = 2e-3  # the same over HTTP, request to answer
# Fit-checks over HTTP: one after another on one connection, the job at a new batch size and
# sequence length each time (its curves and suggestions worked out anew), after a warm-up.
FIT_CHECK_WARMUP = 5
FIT_CHECK_REQUESTS = 100
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True, slots=True)
class Load:
    """One endpoint under load."""

    name: str
    requests: int
    errors: int
    seconds: float
    latencies: list[float]
    server_cpu_s: float | None

    @property
    def rps(self) -> float:
        return self.requests / self.seconds

    def percentile(self, q: float) -> float:
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    @property
    def server_busy(self) -> float | None:
        """The share of the time the server's process was on a CPU."""
        return None if self.server_cpu_s is None else self.server_cpu_s / self.seconds

    @property
    def server_cpu_per_request_s(self) -> float | None:
        return None if self.server_cpu_s is None else self.server_cpu_s / self.requests


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextlib.contextmanager
def _store() -> Iterator[str]:
    """The URL of an embedded store in a temporary directory, migrated as `make run` does."""
    from service.store.migrate import upgrade

    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{Path(tmp) / 'bench.db'}"
        upgrade(url)
        yield url


@dataclass(frozen=True, slots=True)
class Replica:
    """A started server: its process and how long it took to answer /readyz with a 200."""

    process: subprocess.Popen[bytes]
    startup_s: float
    rss_started_bytes: int | None  # resident memory once ready


@contextlib.contextmanager
def _server(port: int, database_url: str) -> Iterator[subprocess.Popen[bytes]]:
    """A started server's process (the store benchmark's servers)."""
    with _replica(port, database_url) as replica:
        yield replica.process


@contextlib.contextmanager
def _replica(port: int, database_url: str) -> Iterator[Replica]:
    env = {**os.environ, "VRAMCAST_DATABASE_URL": database_url}
    command = [
        sys.executable,
        "-m",
        "uvicorn",
        "service.api.app:create_app",
        "--factory",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--log-level",
        "warning",
        "--no-access-log",
    ]
    started = time.perf_counter()
    process = subprocess.Popen(command, env=env)
    try:
        _wait_ready(port, process)
        startup_s = time.perf_counter() - started
        yield Replica(process, startup_s, _rss_bytes(process.pid))
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _wait_ready(port: int, process: subprocess.Popen[bytes]) -> None:
    """Until GET /readyz answers 200 (the catalogs, the store and the first factors loaded),
    asking every READY_POLL_S on a new connection."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    request = _http_request("GET", "/readyz", close=True)
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with status {process.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1) as c:
            c.sendall(request)
            if c.recv(64).startswith(b"HTTP/1.1 200 "):
                return
        time.sleep(READY_POLL_S)
    raise RuntimeError(f"the server was not ready within {STARTUP_TIMEOUT_S} s")


def _rss_bytes(pid: int, field: str = "VmRSS") -> int | None:
    """A process's resident memory (VmRSS), or its peak (VmHWM), from /proc; None elsewhere."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024  # proc(5): in kB
    return None


def _cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of a process (Linux /proc), None elsewhere."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    # Fields 14 and 15 of /proc/<pid>/stat (proc(5)): utime and stime, in clock ticks.
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS


_LENGTH_FIELD = b"\r\ncontent-length:"  # as the head reads once lowered


class _Client(asyncio.Protocol):
    """One keep-alive connection sending pre-encoded requests one after another: a protocol
    (callbacks on the event loop, no stream objects or awaits per request) that parses no
    more of a response than its status and length, so that it costs far less per request
    than the server does."""

    def __init__(
        self,
        requests: list[bytes],
        offset: int,
        step: int,
        measure_from: float,
        measure_to: float,
        done: asyncio.Future[None],
    ) -> None:
        self.requests = requests
        self.i = offset
        self.step = step
        self.measure_from = measure_from
        self.measure_to = measure_to
        self.done = done
        self.buffer = bytearray()
        self.latencies: list[float] = []
        self.errors = 0
        self.counting = False
        self.sent_at = 0.0
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self._send()

    def _send(self) -> None:
        assert self.transport is not None
        now = time.time()
        if now >= self.measure_to:
            self.transport.close()
            return
        self.counting = now >= self.measure_from
        self.sent_at = time.perf_counter()
        self.transport.write(self.requests[self.i % len(self.requests)])
        self.i += self.step

    def data_received(self, data: bytes) -> None:
        buffer = self.buffer
        buffer += data
        while True:
            end = buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            head = bytes(buffer[:end]).lower()
            at = head.find(_LENGTH_FIELD)
            length = 0
            if at >= 0:  # the value runs to the next line, or to the end of the head
                stop = head.find(b"\r\n", at + 2)
                length = int(head[at + len(_LENGTH_FIELD) : stop if stop >= 0 else None])
            total = end + 4 + length
            if len(buffer) < total:
                return
            status = int(head[9:12])
            del buffer[:total]
            if self.counting:
                self.latencies.append(time.perf_counter() - self.sent_at)
                self.errors += status != 200
            self._send()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_result(None)


async def _drive(
    port: int, requests: list[bytes], concurrency: int, measure_from: float, measure_to: float
) -> tuple[int, int, list[float]]:
    """Requests from `concurrency` keep-alive connections until `measure_to` (wall clock);
    those that start after `measure_from` are counted."""
    loop = asyncio.get_running_loop()
    clients: list[_Client] = []
    for k in range(concurrency):
        done: asyncio.Future[None] = loop.create_future()
        client = _Client(requests, k, concurrency, measure_from, measure_to, done)
        await loop.create_connection(lambda client=client: client, "127.0.0.1", port)  # type: ignore[misc]
        clients.append(client)
    await asyncio.gather(*(client.done for client in clients))
    latencies = [latency for client in clients for latency in client.latencies]
    return len(latencies), sum(client.errors for client in clients), latencies


def _client_process(
    port: int, requests: list[bytes], concurrency: int, start_at: float
) -> tuple[int, int, list[float]]:
    """One client process: warm up from `start_at`, then measure for DURATION_S."""
    time.sleep(max(0.0, start_at - time.time()))
    measure_from = start_at + WARMUP_S
    return asyncio.run(_drive(port, requests, concurrency, measure_from, measure_from + DURATION_S))


def _load(name: str, port: int, pid: int, requests: list[bytes]) -> Load:
    """CONCURRENCY connections spread over CLIENT_PROCESSES processes."""
    per_process = max(1, CONCURRENCY // CLIENT_PROCESSES)
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(CLIENT_PROCESSES, mp_context=context) as pool:
        pool.submit(time.sleep, 0).result()  # the workers exist before the clock starts
        start_at = time.time() + CLIENT_START_S
        futures = [
            pool.submit(_client_process, port, requests, per_process, start_at)
            for _ in range(CLIENT_PROCESSES)
        ]
        time.sleep(max(0.0, start_at + WARMUP_S - time.time()))
        cpu_before = _cpu_seconds(pid)
        time.sleep(DURATION_S)
        cpu_after = _cpu_seconds(pid)
        results = [future.result() for future in futures]
    cpu = None if cpu_before is None or cpu_after is None else cpu_after - cpu_before
    latencies = [latency for _, _, chunk in results for latency in chunk]
    errors = sum(e for _, e, _ in results)
    return Load(name, len(latencies), errors, DURATION_S, latencies, cpu)


def _http_request(method: str, path: str, body: bytes = b"", *, close: bool = False) -> bytes:
    head = f"{method} {path} HTTP/1.1\r\nHost: bench\r\n"
    if close:
        head += "Connection: close\r\n"
    if body:
        head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    return head.encode() + b"\r\n" + body


def _bodies(shapes: list[tuple[int, int]]) -> list[bytes]:
    return [json.dumps({**ESTIMATE_JOB, "batch_size": b, "seq_len": s}).encode() for b, s in shapes]


_ENCODED_BODIES = _bodies(SHAPES)
LIVEZ_REQUESTS = [_http_request("GET", "/livez")]
ESTIMATE_REQUESTS = [_http_request("POST", "/v1/estimates", body) for body in _ENCODED_BODIES]
NEW_JOB_REQUESTS = [
    _http_request("POST", "/v1/estimates", body) for body in _bodies(NEW_JOB_SHAPES)
]


def _median_time(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def in_process(database_url: str) -> dict[str, float]:
    """Seconds: one estimate() (same spec, and a new batch/seq each call), the 37-GPU
    fit-check in the core and through the API's handler."""
    from pydantic_core import to_json

    from service.api.app import create_app
    from service.api.deps import estimation_for
    from service.api.schemas import FitCheckIn
    from service.api.settings import Settings
    from service.catalog.gpus import default_gpu_catalog
    from service.catalog.models import default_catalog
    from service.core.estimator import (
        default_target_modules,
        estimate,
        peak_levels,
        shape_levels,
    )
    from service.core.fit import GpuOffer, Requirement, check_fit
    from service.core.spec import LoraSpec, Method, Optim, QuantSpec, TrainingSpec

    arch = default_catalog().resolve("Qwen/Qwen2.5-7B").arch
    spec = TrainingSpec(
        method=Method.QLORA,
        batch_size=4,
        seq_len=2048,
        lora=LoraSpec(r=16, lora_alpha=32, lora_dropout=0.05, target_modules="all-linear"),
        quantization=QuantSpec(double_quant=True),
        autocast=True,
        optim=Optim.PAGED_ADAMW_8BIT,
        gradient_checkpointing=True,
    )
    estimate(arch, spec)
    same = _median_time(lambda: estimate(arch, spec), 2000)
    shapes = [replace(spec, batch_size=1 + i % 16, seq_len=256 + i) for i in range(2000)]
    fresh = iter(shapes)
    varied = _median_time(lambda: estimate(arch, next(fresh)), len(shapes))

    gpus = default_gpu_catalog().gpus()
    offers = [GpuOffer(memory_bytes=gpu.memory_bytes) for gpu in gpus]

    def requirement(s: TrainingSpec) -> Requirement:
        levels = peak_levels(arch, s)
        return Requirement(
            device_bytes=levels.device_bytes, device_bytes_upper=levels.device_bytes_upper
        )

    def shaped(s: TrainingSpec) -> Callable[[int, int], Requirement]:
        levels_at = shape_levels(arch, s)

        def at(batch_size: int, seq_len: int) -> Requirement:
            levels = levels_at(batch_size, seq_len)
            return Requirement(
                device_bytes=levels.device_bytes, device_bytes_upper=levels.device_bytes_upper
            )

        return at

    def core_check(job: TrainingSpec) -> Callable[[], object]:
        return lambda: check_fit(
            job,
            offers,
            requirement,
            max_batch_size=4096,
            max_seq_len=arch.max_position_embeddings,
            narrower_target_modules=default_target_modules(arch),
            shaped=shaped,
        )

    lora = TrainingSpec(
        batch_size=4, seq_len=2048, lora=LoraSpec(r=16, target_modules="all-linear")
    )
    app = create_app(Settings(database_url=database_url))
    services = app.state.services
    body = FitCheckIn.model_validate(
        {"job": {**ESTIMATE_JOB, "batch_size": 4, "seq_len": 2048}, "gpus": [g.name for g in gpus]}
    )

    def api_check() -> object:
        # what the route does with a read body: the answer's values, encoded
        return to_json(estimation_for(services).fit_check_values(body))

    from service.core.estimator import forget_compiled_steps
    from service.core.reserved import clear_replay_caches

    def cold(fn: Callable[[], object]) -> Callable[[], object]:
        def first_call() -> object:
            clear_replay_caches()
            forget_compiled_steps()
            return fn()

        return first_call

    return {
        "estimate_same_spec_s": same,
        "estimate_new_shape_s": varied,
        "estimate_cold_power_of_two_s": _median_time(cold(lambda: estimate(arch, spec)), 5),
        "estimate_cold_between_s": _median_time(
            cold(lambda: estimate(arch, replace(spec, batch_size=3, seq_len=1500))), 5
        ),
        "fit_check_core_lora_cold_s": _median_time(cold(core_check(lora)), 3),
        "fit_check_core_qlora_s": _median_time(core_check(spec), 30),
        "fit_check_core_lora_s": _median_time(core_check(lora), 30),
        # the same job at a new shape each check (replays of the shapes' brackets made first)
        "fit_check_core_qlora_new_shape_s": _new_shape_checks(core_check, spec),
        "fit_check_api_qlora_s": _median_time(api_check, 30),
        "gpus": float(len(gpus)),
    }


def _new_shape_checks(
    check: Callable[[TrainingSpec], Callable[[], object]], job: TrainingSpec
) -> float:
    """The median of 30 checks of `job`, each at a batch size and sequence length not
    checked before (each first checked once, untimed, at a neighbouring shape in the same
    brackets: the replays a replica that has run a while holds)."""
    shapes = [(1 + i % 8, 1100 + 2 * i) for i in range(30)]
    for b, s in shapes:
        check(job.with_shape(b, s + 1))()
    checks = iter([check(job.with_shape(b, s)) for b, s in shapes])
    return _median_time(lambda: next(checks)(), len(shapes))


def _asgi_scope(method: str, path: str, body: bytes) -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"host", b"bench"),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }


def app_cpu_per_request(database_url: str, repeat: int = 3000) -> dict[str, float]:
    """CPU seconds the app itself spends per request, called as ASGI in this process: no
    server, no network, no clients competing for the CPU."""
    from service.api.app import create_app
    from service.api.settings import Settings

    app = create_app(Settings(database_url=database_url))
    requests: dict[str, list[tuple[dict[str, Any], bytes]]] = {
        "GET /livez": [(_asgi_scope("GET", "/livez", b""), b"")],
        "estimates, repeated": [
            (_asgi_scope("POST", "/v1/estimates", body), body) for body in _ENCODED_BODIES
        ],
        # More distinct bodies than `repeat`: none is asked twice.
        "estimates, new jobs": [
            (_asgi_scope("POST", "/v1/estimates", body), body) for body in _bodies(NEW_JOB_SHAPES)
        ],
    }

    async def call(scope: dict[str, Any], body: bytes) -> None:
        delivered = False

        async def receive() -> dict[str, Any]:
            nonlocal delivered
            if delivered:
                await asyncio.sleep(3600)  # the client never disconnects
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}

        statuses: list[int] = []

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                statuses.append(message["status"])

        await app(scope, receive, send)
        if statuses != [200]:
            raise RuntimeError(f"{scope['path']} answered {statuses}")

    async def measure() -> dict[str, float]:
        costs: dict[str, float] = {}
        async with app.router.lifespan_context(app):
            for name, calls in requests.items():
                for i in range(200):
                    await call(*calls[i % len(calls)])
                started = time.process_time()
                for i in range(repeat):
                    await call(*calls[i % len(calls)])
                costs[name] = (time.process_time() - started) / repeat
        return costs

    return asyncio.run(measure())


def _batch_request(first: int) -> bytes:
    """BATCH_JOBS jobs, the `first`-th to the next BATCH_JOBS of the run's distinct shapes."""
    jobs = [
        {
            **ESTIMATE_JOB,
            "batch_size": 1 + k % BATCH_SIZES,
            "seq_len": BATCH_FIRST_SEQ + k // BATCH_SIZES,
        }
        for k in range(first, first + BATCH_JOBS)
    ]
    body = json.dumps({"jobs": jobs}).encode()
    return _http_request("POST", "/v1/estimates:batch", body)


@dataclass(frozen=True, slots=True)
class BatchLoad:
    """Batch requests one after another on one connection."""

    estimates: int
    seconds: list[float]  # each request's, from sending it to the end of its answer
    server_cpu_s: float | None
    errors: int

    @property
    def per_s(self) -> float:
        return self.estimates / sum(self.seconds)

    @property
    def server_cpu_per_estimate_s(self) -> float | None:
        return None if self.server_cpu_s is None else self.server_cpu_s / self.estimates


def _post_and_read(connection: socket.socket, request: bytes) -> tuple[int, bytes]:
    """One request on a keep-alive connection: the status and the body."""
    connection.sendall(request)
    data = bytearray()
    while (end := data.find(b"\r\n\r\n")) < 0:
        data += connection.recv(1 << 16)
    head = bytes(data[:end]).lower()
    at = head.find(_LENGTH_FIELD)
    stop = head.find(b"\r\n", at + 2)
    total = end + 4 + int(head[at + len(_LENGTH_FIELD) : stop if stop >= 0 else None])
    while len(data) < total:
        data += connection.recv(1 << 20)
    return int(head[9:12]), bytes(data[end + 4 : total])


def _batch_load(port: int, pid: int) -> BatchLoad:
    """BATCH_WARMUP, then BATCH_REQUESTS measured batch requests, each of new jobs."""
    requests = [_batch_request(i * BATCH_JOBS) for i in range(BATCH_WARMUP + BATCH_REQUESTS)]
    seconds: list[float] = []
    errors = 0
    with socket.create_connection(("127.0.0.1", port)) as connection:
        for request in requests[:BATCH_WARMUP]:
            _post_and_read(connection, request)
        cpu_before = _cpu_seconds(pid)
        for request in requests[BATCH_WARMUP:]:
            started = time.perf_counter()
            status, body = _post_and_read(connection, request)
            seconds.append(time.perf_counter() - started)
            answer = json.loads(body) if status == 200 else {}
            errors += BATCH_JOBS - answer.get("succeeded", 0)
        cpu_after = _cpu_seconds(pid)
    cpu = None if cpu_before is None or cpu_after is None else cpu_after - cpu_before
    return BatchLoad(BATCH_REQUESTS * BATCH_JOBS, seconds, cpu, errors)


def _fit_check_request(index: int) -> bytes:
    """A fit-check of the example job over every catalog GPU, at the index-th shape."""
    from service.catalog.gpus import default_gpu_catalog

    b, s = 1 + index % 8, 1024 + index
    body = {
        "job": {**ESTIMATE_JOB, "batch_size": b, "seq_len": s},
        "gpus": [gpu.name for gpu in default_gpu_catalog().gpus()],
    }
    return _http_request("POST", "/v1/fit-checks", json.dumps(body).encode())


def _fit_check_load(port: int) -> list[float]:
    """Seconds from sending each measured fit-check to the end of its answer."""
    seconds: list[float] = []
    with socket.create_connection(("127.0.0.1", port)) as connection:
        for index in range(FIT_CHECK_WARMUP + FIT_CHECK_REQUESTS):
            request = _fit_check_request(index)
            started = time.perf_counter()
            status, _ = _post_and_read(connection, request)
            if status != 200:
                raise RuntimeError(f"a fit-check answered {status}")
            if index >= FIT_CHECK_WARMUP:
                seconds.append(time.perf_counter() - started)
    return seconds


# The shapes whose allocator replays every load's shapes interpolate between (the powers of
# two around them): replayed before the loads, as a replica that has run a while has them.
REPLAYED_BATCH_SIZES = (1, 2, 4, 8, 16)
REPLAYED_SEQ_LENS = (512, 1024, 2048, 4096)


def _prime(port: int) -> None:
    """Asks once, through the batch route (which keeps no answers), for the jobs at the
    replayed shapes: the first estimate of a shape costs a replay of the allocator (the
    in-process figures time it apart), which the loads' warm-ups are too short to absorb."""
    jobs = [
        {**ESTIMATE_JOB, "batch_size": b, "seq_len": s}
        for b in REPLAYED_BATCH_SIZES
        for s in REPLAYED_SEQ_LENS
    ]
    body = json.dumps({"jobs": jobs}).encode()
    with socket.create_connection(("127.0.0.1", port)) as connection:
        status, _ = _post_and_read(connection, _http_request("POST", "/v1/estimates:batch", body))
    if status != 200:
        raise RuntimeError(f"priming the server answered {status}")


@dataclass(frozen=True, slots=True)
class OverHttp:
    trivial: Load
    repeated: Load
    new: Load
    batch: BatchLoad
    fit_checks: list[float]
    startup_s: float
    rss_started_bytes: int | None
    rss_loaded_bytes: int | None
    rss_peak_bytes: int | None


def over_http(database_url: str) -> OverHttp:
    port = _free_port()
    with _replica(port, database_url) as replica:
        pid = replica.process.pid
        _prime(port)
        trivial = _load("GET /livez", port, pid, LIVEZ_REQUESTS)
        repeated = _load("estimates, repeated", port, pid, ESTIMATE_REQUESTS)
        new = _load("estimates, new jobs", port, pid, NEW_JOB_REQUESTS)
        batch = _batch_load(port, pid)
        fit_checks = _fit_check_load(port)
        rss = (replica.rss_started_bytes, _rss_bytes(pid), _rss_bytes(pid, "VmHWM"))
    return OverHttp(trivial, repeated, new, batch, fit_checks, replica.startup_s, *rss)


def _verdict(overhead: float) -> str:
    met = "met" if overhead <= ESTIMATE_OVERHEAD_TARGET else "NOT met"
    return f"(target <= {ESTIMATE_OVERHEAD_TARGET:.0%}: {met})"


def _mib(size: int | None) -> str:
    return "n/a" if size is None else f"{size / (1 << 20):.0f} MiB"


def run() -> list[str]:
    """Run everything; the report's lines."""
    with _store() as database_url:
        http = over_http(database_url)
        app_cpu = app_cpu_per_request(database_url)
        core = in_process(database_url)
    trivial, repeated, new, batch = http.trivial, http.repeated, http.new, http.batch
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"
    lines = [
        f"API on one uvicorn worker, {CONCURRENCY} keep-alive connections from "
        f"{CLIENT_PROCESSES} client process(es), {DURATION_S:.0f} s per load, loopback, "
        f"{os.cpu_count()} CPUs (load average {load}: other processes skew these figures)",
        f"  repeated: {len(SHAPES)} job bodies in turn (a scheduler re-asking about pending "
        "jobs: answers kept)",
        f"  new jobs: {len(NEW_JOB_SHAPES)} distinct bodies in turn (none kept)",
        "",
        f"  {'load':<22}{'req/s':>9}{'p50 ms':>9}{'p99 ms':>9}{'server CPU µs/req':>20}"
        f"{'errors':>8}",
    ]
    for measured in (trivial, repeated, new):
        cpu = measured.server_cpu_per_request_s
        lines.append(
            f"  {measured.name:<22}{measured.rps:>9.0f}{measured.percentile(0.5) * 1e3:>9.2f}"
            f"{measured.percentile(0.99) * 1e3:>9.2f}"
            f"{'n/a' if cpu is None else f'{cpu * 1e6:.0f}':>20}{measured.errors:>8}"
        )
    lines.append("")
    overhead = trivial.rps / repeated.rps - 1
    lines.append(
        f"  {repeated.name} vs GET /livez: {overhead:+.1%} time per request by req/s "
        f"{_verdict(overhead)}"
    )
    ratio = new.rps / trivial.rps
    met = "met" if ratio >= NEW_JOB_RATIO_TARGET else "NOT met"
    lines.append(
        f"  {new.name} / GET /livez: {ratio:.2f} of the requests/s "
        f"(target >= {NEW_JOB_RATIO_TARGET:.2f}: {met})"
    )
    for measured in (repeated, new):
        if trivial.server_cpu_per_request_s and measured.server_cpu_per_request_s:
            cpu_ratio = measured.server_cpu_per_request_s / trivial.server_cpu_per_request_s - 1
            lines.append(
                f"  {measured.name} vs GET /livez: {cpu_ratio:+.1%} server CPU per request"
            )
    busy = [m.server_busy for m in (trivial, repeated, new) if m.server_busy is not None]
    if busy and min(busy) < SATURATED:
        lines.append(
            f"  the server was busy only {min(busy):.0%} of the time: req/s measure the "
            "clients here, compare the server's CPU per request instead"
        )
    batch_met = "met" if batch.per_s >= BATCH_TARGET_PER_S else "NOT met"
    cpu_each = batch.server_cpu_per_estimate_s
    lines += [
        "",
        f"Batch route, same server: {BATCH_REQUESTS} requests of {BATCH_JOBS} distinct new "
        f"jobs each, one after another (after {BATCH_WARMUP} warm-up requests)",
        f"  estimates/s {batch.per_s:>10.0f}  (target >= {BATCH_TARGET_PER_S}: {batch_met})",
        f"  request median {statistics.median(batch.seconds) * 1e3:.0f} ms, server CPU "
        f"{'n/a' if cpu_each is None else f'{cpu_each * 1e6:.0f} µs'} per estimate, "
        f"{batch.errors} failed jobs",
        "",
        f"Fit-checks over HTTP, same server: {FIT_CHECK_REQUESTS} of the job over the "
        f"{core['gpus']:.0f} catalog GPUs, one after another, each at a new batch size and "
        "sequence length",
        f"  median {statistics.median(http.fit_checks) * 1e3:.2f} ms, p99 "
        f"{sorted(http.fit_checks)[int(0.99 * (len(http.fit_checks) - 1))] * 1e3:.2f} ms  "
        f"(target ≤ {FIT_CHECK_HTTP_TARGET_S * 1e3:.0f} ms: "
        f"{'met' if statistics.median(http.fit_checks) <= FIT_CHECK_HTTP_TARGET_S else 'NOT met'}"
        ")",
        "",
        "One replica (the same server)",
        f"  start-up, process start to the first 200 from /readyz  {http.startup_s:.2f} s",
        f"  resident memory after start-up   {_mib(http.rss_started_bytes)}",
        f"  resident memory after the loads  {_mib(http.rss_loaded_bytes)}  "
        f"(peak {_mib(http.rss_peak_bytes)})",
    ]
    livez = app_cpu["GET /livez"]
    lines += ["", "The app alone, called as ASGI in process (CPU per request)"]
    lines.append(f"  {'GET /livez':<22}{livez * 1e6:8.0f} µs")
    for name in ("estimates, repeated", "estimates, new jobs"):
        cost = app_cpu[name]
        lines.append(f"  {name:<22}{cost * 1e6:8.0f} µs  ({cost / livez - 1:+.0%})")
    lines += [
        "",
        "In process (median)",
        f"  estimate(), same spec               {core['estimate_same_spec_s'] * 1e6:8.1f} µs"
        f"  (target < {CORE_ESTIMATE_TARGET_S * 1e6:.0f} µs)",
        f"  estimate(), new batch/seq each call {core['estimate_new_shape_s'] * 1e6:8.1f} µs",
        f"  fit-check, {core['gpus']:.0f} GPUs, core, QLoRA job  "
        f"{core['fit_check_core_qlora_s'] * 1e3:8.2f} ms"
        f"  (target ≤ {FIT_CHECK_TARGET_S * 1e3:.0f} ms)",
        f"  fit-check, {core['gpus']:.0f} GPUs, core, LoRA job   "
        f"{core['fit_check_core_lora_s'] * 1e3:8.2f} ms",
        f"  fit-check, {core['gpus']:.0f} GPUs, core, QLoRA job at a new shape each check "
        f"{core['fit_check_core_qlora_new_shape_s'] * 1e3:.2f} ms",
        f"  fit-check, {core['gpus']:.0f} GPUs, API handler      "
        f"{core['fit_check_api_qlora_s'] * 1e3:8.2f} ms",
        "",
        "In process, a job shape seen for the first time (the allocator model replays the step "
        "at the powers of two around it; replays are then cached)",
        f"  estimate(), b4 s2048                "
        f"{core['estimate_cold_power_of_two_s'] * 1e3:8.1f} ms  (one replay)",
        f"  estimate(), b3 s1500                "
        f"{core['estimate_cold_between_s'] * 1e3:8.1f} ms  (four replays, interpolated)",
        f"  fit-check, {core['gpus']:.0f} GPUs, core, LoRA job   "
        f"{core['fit_check_core_lora_cold_s'] * 1e3:8.0f} ms",
    ]
    return lines


if __name__ == "__main__":
    print("\n".join(run()))
