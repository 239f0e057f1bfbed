"""The real service on loopback (uvicorn in a subprocess, a migrated temporary SQLite store),
a flaky HTTP server in front of it, and a fake GPU probe for the reporter.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Protocol

import httpx
import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from service.store.db import create_engine_from_url
from service.store.keys import KeyScope, create_key
from service.store.models import CalibrationUpload
from vramcast_client.measure import GpuPeaks

GIB = 1024**3
A100_80GB = GpuPeaks(
    gpu_name="NVIDIA A100-SXM4-80GB",
    memory_total_bytes=85_899_345_920,
    allocated_bytes=3 * GIB,
    reserved_bytes=4 * GIB,
    device_bytes=5 * GIB,
    driver="550.54.15",
)
SMALL_JOB: dict[str, Any] = {"model": "Qwen/Qwen2.5-0.5B", "batch_size": 2, "seq_len": 512}
START_TIMEOUT_S = 60.0


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def vramcast(*argv: str) -> subprocess.CompletedProcess[str]:
    """The `vramcast` command line of this environment, run as a separate process."""
    script = Path(sys.executable).with_name("vramcast")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "service.cli"]
    return subprocess.run([*command, *argv], capture_output=True, text=True, check=True)


class Store:
    """A migrated SQLite store in a temporary directory, and a way to read its uploads.

    The first store of a session is migrated by `vramcast db upgrade`; later ones start as
    copies of a migrated file nothing has opened since, which is quicker.
    """

    _template: Path | None = None

    def __init__(self, directory: Path) -> None:
        path = directory / "vramcast.db"
        self.url = f"sqlite:///{path}"
        if Store._template is None:
            template = directory / "template.db"
            vramcast("db", "upgrade", "--database-url", f"sqlite:///{template}")
            Store._template = template
        shutil.copyfile(Store._template, path)
        self._engine = create_engine_from_url(self.url)

    def issue_key(self, *scopes: KeyScope) -> str:
        with Session(self._engine) as session, session.begin():
            uploads = KeyScope.UPLOAD in scopes and KeyScope.ADMIN not in scopes
            issued = create_key(
                session,
                scopes=scopes,
                name="tests",
                now=datetime.now(UTC),
                nodes=["*"] if uploads else [],
            )
            return issued.token

    def uploads(self, run_id: str | None = None) -> list[CalibrationUpload]:
        with Session(self._engine, expire_on_commit=False) as session:
            query = select(CalibrationUpload).order_by(CalibrationUpload.id)
            if run_id is not None:
                query = query.where(CalibrationUpload.run_id == run_id)
            return list(session.scalars(query))

    def close(self) -> None:
        self._engine.dispose()


class ServiceProcess:
    """`uvicorn service.api.app:create_app` on a free 127.0.0.1 port, on `store`."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "VRAMCAST_DATABASE_URL": store.url}
        command = [sys.executable, "-m", "uvicorn", "service.api.app:create_app", "--factory"]
        command += ["--host", "127.0.0.1", "--port", str(self.port), "--log-level", "warning"]
        self._log = tempfile.TemporaryFile()  # noqa: SIM115  (outlives __init__; kill() closes it)
        self.process = subprocess.Popen(command, env=env, stdout=self._log, stderr=self._log)
        self._wait_until_live()

    def _wait_until_live(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the service exited: {self.log_text()[-2000:]}")
            try:
                if httpx.get(f"{self.url}/livez", timeout=1.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        self.kill()
        raise RuntimeError(f"the service did not answer within {START_TIMEOUT_S} s")

    def log_text(self) -> str:
        """What the service wrote to stdout and stderr so far."""
        self._log.seek(0)
        return self._log.read().decode(errors="replace")

    def kill(self) -> None:
        """End it at once (SIGKILL), as a crash or an OOM killer would."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=10)
        self._log.close()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self.kill()


@dataclass(frozen=True)
class Service:
    url: str
    store: Store
    upload_key: str
    process: ServiceProcess


@pytest.fixture(scope="session")
def store_dir() -> Iterator[Path]:
    directory = Path(tempfile.mkdtemp(prefix="vramcast-client-tests-"))
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="session")
def service(store_dir: Path) -> Iterator[Service]:
    """The service every test may share: it is never stopped before the session ends."""
    store = Store(store_dir)
    process = ServiceProcess(store)
    try:
        yield Service(process.url, store, store.issue_key(KeyScope.UPLOAD), process)
    finally:
        process.stop()
        store.close()


@pytest.fixture
def own_service(tmp_path: Path) -> Iterator[Service]:
    """A service of the test's own, on its own store, that the test may kill."""
    store = Store(tmp_path)
    process = ServiceProcess(store)
    try:
        yield Service(process.url, store, store.issue_key(KeyScope.UPLOAD), process)
    finally:
        process.stop()
        store.close()


@pytest.fixture(autouse=True)
def _isolated_spool(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No test reads or writes the real ~/.cache spool."""
    monkeypatch.setenv("VRAMCAST_SPOOL_DIR", str(tmp_path / "default-spool"))


class FakeProbe:
    """The reporter's GPU, given: the explicit injection point instead of torch.cuda."""

    def __init__(self, peaks: GpuPeaks | None = A100_80GB) -> None:
        self.peaks = peaks
        self.started = 0
        self.stopped = 0

    def start(self) -> None:
        self.started += 1

    def read(self) -> GpuPeaks | None:
        return self.peaks

    def stop(self) -> None:
        self.stopped += 1


class FlakyServer:
    """A loopback HTTP server that fails as `script` says, then forwards to `upstream`.

    Script steps: an HTTP status (answered with a problem+json body), or "drop" (the
    connection is closed without an answer). When the script is used up, each request is
    forwarded to the upstream service and its answer relayed.
    """

    def __init__(self, upstream: str, script: Sequence[int | str], *, retry_after: str = "0"):
        self.upstream = upstream
        self.script = list(script)
        self.retry_after = retry_after
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def _next(self, method: str, path: str, headers: dict[str, str]) -> int | str:
        with self._lock:
            self.requests.append((method, path, headers))
            return self.script.pop(0) if self.script else "forward"

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        flaky = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self._answer()

            def do_POST(self) -> None:
                self._answer()

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _answer(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                headers = {k.lower(): v for k, v in self.headers.items()}
                step = flaky._next(self.command, self.path, headers)
                if step == "drop":
                    self.close_connection = True
                    return
                if isinstance(step, int):
                    problem = {
                        "type": "about:blank",
                        "title": "Service Unavailable" if step == 503 else "Failure",
                        "status": step,
                        "detail": f"injected failure {step}",
                    }
                    self._send(
                        step,
                        json.dumps(problem).encode(),
                        {
                            "Content-Type": "application/problem+json",
                            "Retry-After": flaky.retry_after,
                        },
                    )
                    return
                forwarded = {
                    k: v for k, v in headers.items() if k not in ("host", "content-length")
                }
                answer = httpx.request(
                    self.command,
                    flaky.upstream + self.path,
                    content=body,
                    headers=forwarded,
                    timeout=30,
                )
                kept = ("content-type", "retry-after", "idempotent-replayed")
                relay = {k: v for k, v in answer.headers.items() if k.lower() in kept}
                self._send(answer.status_code, answer.content, relay)

            def _send(self, status: int, body: bytes, headers: dict[str, str]) -> None:
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        return Handler


class FlakyFactory(Protocol):
    def __call__(self, script: Sequence[int | str], *, retry_after: str = "0") -> FlakyServer: ...


@pytest.fixture
def flaky(service: Service) -> Iterator[FlakyFactory]:
    """Make flaky servers in front of the shared service; all are closed afterwards."""
    made: list[FlakyServer] = []

    def make(script: Sequence[int | str], *, retry_after: str = "0") -> FlakyServer:
        server = FlakyServer(service.url, script, retry_after=retry_after)
        made.append(server)
        return server

    yield make
    for server in made:
        server.close()
