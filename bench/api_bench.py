"""Throughput and latency of the API on a real server, and the core's in-process costs.

One uvicorn server process on a loopback port (one worker, an embedded SQLite store in a
temporary directory) is driven by concurrent httpx clients, bounded in count and in time:
first a trivial endpoint (GET /livez), then POST /v1/estimates, each after a warm-up, so the
two are measured on the same server in one run. The server's own CPU time per request is read
from /proc where available: unlike requests per second it does not depend on whether the
clients or the server saturate first. In process: one `estimate()` call, and a fit-check over
every catalog GPU with its max-batch and max-seq answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx

CONCURRENCY = 32  # clients with a request in flight at any time
WARMUP_S = 1.0
DURATION_S = 5.0  # per endpoint
STARTUP_TIMEOUT_S = 30.0
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
# Targets from the issue and the core.
ESTIMATE_OVERHEAD_TARGET = 0.20
CORE_ESTIMATE_TARGET_S = 50e-6
FIT_CHECK_TARGET_S = 5e-3
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
    def server_cpu_per_request_s(self) -> float | None:
        return None if self.server_cpu_s is None else self.server_cpu_s / self.requests


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextlib.contextmanager
def _server(port: int) -> Iterator[subprocess.Popen[bytes]]:
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "VRAMCAST_DATABASE_URL": f"sqlite:///{Path(tmp) / 'bench.db'}"}
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
        process = subprocess.Popen(command, env=env)
        try:
            _wait_ready(f"http://127.0.0.1:{port}", process)
            yield process
        finally:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _wait_ready(url: str, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with status {process.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/livez", timeout=1.0).status_code == 200:
                return
        time.sleep(0.1)
    raise RuntimeError(f"the server did not answer within {STARTUP_TIMEOUT_S} s")


def _cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of a process (Linux /proc), None elsewhere."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    # Fields 14 and 15 of /proc/<pid>/stat (proc(5)): utime and stime, in clock ticks.
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS


RequestMaker = Callable[[httpx.AsyncClient, int], Any]


async def _drive(base_url: str, make: RequestMaker, seconds: float) -> tuple[int, int, list[float]]:
    latencies: list[float] = []
    errors = 0
    limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=CONCURRENCY)
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=30.0) as client:
        deadline = time.perf_counter() + seconds

        async def worker(offset: int) -> None:
            nonlocal errors
            i = offset
            while time.perf_counter() < deadline:
                started = time.perf_counter()
                response = await make(client, i)
                latencies.append(time.perf_counter() - started)
                if response.status_code != 200:
                    errors += 1
                i += CONCURRENCY

        await asyncio.gather(*(worker(k) for k in range(CONCURRENCY)))
    return len(latencies), errors, latencies


def _load(name: str, base_url: str, pid: int, make: RequestMaker) -> Load:
    asyncio.run(_drive(base_url, make, WARMUP_S))
    cpu_before = _cpu_seconds(pid)
    started = time.perf_counter()
    count, errors, latencies = asyncio.run(_drive(base_url, make, DURATION_S))
    seconds = time.perf_counter() - started
    cpu_after = _cpu_seconds(pid)
    cpu = None if cpu_before is None or cpu_after is None else cpu_after - cpu_before
    return Load(name, count, errors, seconds, latencies, cpu)


def _livez(client: httpx.AsyncClient, _i: int) -> Any:
    return client.get("/livez")


_BODIES = [{**ESTIMATE_JOB, "batch_size": b, "seq_len": s} for b, s in SHAPES]


def _estimate(client: httpx.AsyncClient, i: int) -> Any:
    return client.post("/v1/estimates", json=_BODIES[i % len(_BODIES)])


def _median_time(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def in_process() -> dict[str, float]:
    """Seconds: one estimate() (same spec, and a new batch/seq each call), the 37-GPU
    fit-check in the core and through the API's handler."""
    from service.api.app import create_app
    from service.api.estimation import Estimation
    from service.api.schemas import FitCheckIn
    from service.api.settings import Settings
    from service.catalog.gpus import default_gpu_catalog
    from service.catalog.models import default_catalog
    from service.core.estimator import default_target_modules, estimate
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
        est = estimate(arch, s)
        return Requirement(device_bytes=est.device_bytes, device_bytes_upper=est.device_bytes_upper)

    def core_check(job: TrainingSpec) -> Callable[[], object]:
        return lambda: check_fit(
            job,
            offers,
            requirement,
            max_batch_size=4096,
            max_seq_len=arch.max_position_embeddings,
            narrower_target_modules=default_target_modules(arch),
        )

    lora = TrainingSpec(
        batch_size=4, seq_len=2048, lora=LoraSpec(r=16, target_modules="all-linear")
    )
    app = create_app(Settings(database_url="sqlite://"))
    services = app.state.services
    body = FitCheckIn.model_validate(
        {"job": {**ESTIMATE_JOB, "batch_size": 4, "seq_len": 2048}, "gpus": [g.name for g in gpus]}
    )

    def api_check() -> object:
        estimation = Estimation(
            models=services.models,
            gpus=services.gpus,
            factors=services.factors,
            metrics=services.metrics,
        )
        return estimation.fit_check(body)

    return {
        "estimate_same_spec_s": same,
        "estimate_new_shape_s": varied,
        "fit_check_core_qlora_s": _median_time(core_check(spec), 30),
        "fit_check_core_lora_s": _median_time(core_check(lora), 30),
        "fit_check_api_qlora_s": _median_time(api_check, 30),
        "gpus": float(len(gpus)),
    }


def over_http() -> tuple[Load, Load]:
    port = _free_port()
    base_url = f"http://127.0.0.1:{port}"
    with _server(port) as process:
        trivial = _load("GET /livez", base_url, process.pid, _livez)
        estimates = _load("POST /v1/estimates", base_url, process.pid, _estimate)
    return trivial, estimates


def run() -> list[str]:
    """Run everything; the report's lines."""
    trivial, estimates = over_http()
    core = in_process()
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"
    lines = [
        f"API on one uvicorn worker, {CONCURRENCY} concurrent httpx clients, "
        f"{DURATION_S:.0f} s per endpoint, loopback, {os.cpu_count()} CPUs "
        f"(load average {load}: other processes skew these figures)",
        "",
        f"  {'endpoint':<22}{'req/s':>9}{'p50 ms':>9}{'p99 ms':>9}{'server CPU µs/req':>20}"
        f"{'errors':>8}",
    ]
    for load in (trivial, estimates):
        cpu = load.server_cpu_per_request_s
        lines.append(
            f"  {load.name:<22}{load.rps:>9.0f}{load.percentile(0.5) * 1e3:>9.2f}"
            f"{load.percentile(0.99) * 1e3:>9.2f}"
            f"{'n/a' if cpu is None else f'{cpu * 1e6:.0f}':>20}{load.errors:>8}"
        )
    overhead = trivial.rps / estimates.rps - 1
    lines.append("")
    lines.append(
        f"  estimate vs trivial: {overhead:+.1%} time per request by req/s "
        f"(target <= {ESTIMATE_OVERHEAD_TARGET:.0%}: "
        f"{'met' if overhead <= ESTIMATE_OVERHEAD_TARGET else 'NOT met'})"
    )
    if trivial.server_cpu_per_request_s and estimates.server_cpu_per_request_s:
        cpu_ratio = estimates.server_cpu_per_request_s / trivial.server_cpu_per_request_s - 1
        lines.append(f"  estimate vs trivial: {cpu_ratio:+.1%} server CPU per request")
    lines += [
        "",
        "In process (median)",
        f"  estimate(), same spec               {core['estimate_same_spec_s'] * 1e6:8.1f} µs"
        f"  (target < {CORE_ESTIMATE_TARGET_S * 1e6:.0f} µs)",
        f"  estimate(), new batch/seq each call {core['estimate_new_shape_s'] * 1e6:8.1f} µs",
        f"  fit-check, {core['gpus']:.0f} GPUs, core, QLoRA job  "
        f"{core['fit_check_core_qlora_s'] * 1e3:8.2f} ms"
        f"  (target < {FIT_CHECK_TARGET_S * 1e3:.0f} ms)",
        f"  fit-check, {core['gpus']:.0f} GPUs, core, LoRA job   "
        f"{core['fit_check_core_lora_s'] * 1e3:8.2f} ms",
        f"  fit-check, {core['gpus']:.0f} GPUs, API handler      "
        f"{core['fit_check_api_qlora_s'] * 1e3:8.2f} ms",
    ]
    return lines


if __name__ == "__main__":
    print("\n".join(run()))
