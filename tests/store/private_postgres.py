"""A PostgreSQL server of a test's own, which the test may stop and continue.

The machine's shared server is never signalled: this one runs from the installed binaries
(`initdb`, `pg_ctl` under /usr/lib/postgresql/*/bin) as the `postgres` OS user, in a temporary
directory, on a free loopback port. `freeze` stops the postmaster and every backend with
SIGSTOP (a hung server: its kernel still accepts connections and acknowledges packets, and
nothing answers); `thaw` continues them.

Where the server cannot be started (no binaries, no `postgres` user, not root), tests that
need it skip, unless VRAMCAST_REQUIRE_POSTGRES=1 (CI) fails them.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.store.conftest import REQUIRE_POSTGRES_ENV

POSTGRES_BINARIES = Path("/usr/lib/postgresql")
OS_USER = "postgres"
LOOPBACK = "127.0.0.1"
# Seconds `pg_ctl` waits for the server to start or stop (it starts in about a second).
PG_CTL_WAIT_S = 30


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind((LOOPBACK, 0))
        port: int = probe.getsockname()[1]
        return port


def _binaries() -> Path | None:
    found = sorted(
        (path for path in POSTGRES_BINARIES.glob("*/bin") if (path / "initdb").exists()),
        key=lambda path: int(path.parent.name) if path.parent.name.isdigit() else 0,
    )
    return found[-1] if found else None


def _unavailable(reason: str) -> None:
    if os.environ.get(REQUIRE_POSTGRES_ENV) == "1":
        pytest.fail(f"a private PostgreSQL server: {reason} ({REQUIRE_POSTGRES_ENV}=1)")
    pytest.skip(f"a private PostgreSQL server: {reason}")


@dataclass(frozen=True, slots=True)
class PrivateServer:
    port: int
    data: Path
    bin: Path

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://{OS_USER}@{LOOPBACK}:{self.port}/postgres"

    def pids(self) -> list[int]:
        """The postmaster's pid and its children's (every backend and helper process)."""
        postmaster = int((self.data / "postmaster.pid").read_text().split()[0])
        children = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            with contextlib.suppress(OSError, ValueError, IndexError):
                fields = stat.read_text().rsplit(")", 1)[1].split()
                if int(fields[1]) == postmaster:
                    children.append(int(stat.parent.name))
        return [postmaster, *children]

    def freeze(self) -> None:
        """SIGSTOP the postmaster first (no new backends), then every child."""
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)

    def thaw(self) -> None:
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def _as_postgres(*command: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["runuser", "-u", OS_USER, "--", *map(str, command)],
        capture_output=True,
        text=True,
        timeout=PG_CTL_WAIT_S + 10,
        check=False,
    )


@contextlib.contextmanager
def private_postgres() -> Iterator[PrivateServer]:
    """A new PostgreSQL server (trust authentication, user `postgres`, database `postgres`),
    stopped and removed on exit."""
    binaries = _binaries()
    if binaries is None:
        _unavailable(f"no initdb under {POSTGRES_BINARIES}")
    assert binaries is not None
    if os.geteuid() != 0 or shutil.which("runuser") is None:
        _unavailable("needs root and runuser to run it as the postgres user")
    try:
        owner = pwd.getpwnam(OS_USER)
    except KeyError:
        _unavailable(f"no {OS_USER} OS user")
        raise
    root = Path(tempfile.mkdtemp(prefix="vramcast-pg-"))
    os.chown(root, owner.pw_uid, owner.pw_gid)
    server = PrivateServer(port=_free_port(), data=root / "data", bin=binaries)
    try:
        made = _as_postgres(
            binaries / "initdb", "-D", server.data, "-A", "trust", "-U", OS_USER, "--no-sync"
        )
        if made.returncode != 0:
            _unavailable(f"initdb failed: {made.stderr.strip()[-500:]}")
        options = (
            f"-p {server.port} -c listen_addresses={LOOPBACK} -k {root} "
            "-c fsync=off -c full_page_writes=off"
        )
        started = _as_postgres(
            binaries / "pg_ctl", "-D", server.data, "-o", options, "-l", root / "log",
            "-w", "-t", str(PG_CTL_WAIT_S), "start",
        )  # fmt: skip
        if started.returncode != 0:
            log = (root / "log").read_text() if (root / "log").exists() else ""
            _unavailable(f"pg_ctl start failed: {started.stderr.strip()} {log[-500:]}")
        yield server
    finally:
        with contextlib.suppress(OSError, ValueError):
            server.thaw()
        _as_postgres(binaries / "pg_ctl", "-D", server.data, "-m", "immediate", "-w", "stop")
        shutil.rmtree(root, ignore_errors=True)
