"""The client distribution on its own: `pip install ./clients/python` into a fresh virtualenv
brings httpx and pydantic but not the service's stack, and a training node uploads with it
to the real service on loopback.

The virtualenv is built from scratch, so pip needs PyPI (or a pip cache / find-links that
hold setuptools, httpx and pydantic): the test is marked `venv`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.client.conftest import SMALL_JOB, Service

CLIENT = Path(__file__).resolve().parents[2] / "clients" / "python"
SERVICE_STACK = {"fastapi", "starlette", "sqlalchemy", "alembic", "psycopg", "psycopg-binary"}
INSTALL_TIMEOUT_S = 600

NODE_SCRIPT = """
import importlib.util, json, sys
from vramcast_client import Delivery, GpuPeaks, Reporter, RetryPolicy, VramcastClient

url, key, run_id, spool, job = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5]
job = json.loads(job)
GIB = 1024**3
peaks = GpuPeaks(
    gpu_name="NVIDIA A100-SXM4-80GB",
    memory_total_bytes=85_899_345_920,
    allocated_bytes=3 * GIB,
    reserved_bytes=4 * GIB,
    device_bytes=5 * GIB,
    driver="550.54.15",
)

class Probe:
    def start(self): pass
    def read(self): return peaks
    def stop(self): pass

with VramcastClient(url, api_key=key) as client:
    receipt = client.upload_calibration(
        {
            "job": job,
            "gpu": {"name": peaks.gpu_name, "memory_total_bytes": peaks.memory_total_bytes},
            "measured": {"allocated_bytes": 6 * GIB, "reserved_bytes": 7 * GIB},
            "outcome": "completed",
            "environment": {"world_size": 1},
            "node_id": "fresh-node",
            "run_id": run_id + "-client",
        },
        idempotency_key=run_id + "-client",
    )

node = Reporter(
    url, api_key=key, probe=Probe(), spool_dir=spool, node_id="fresh-node",
    run_id=run_id + "-reporter", retry=RetryPolicy(attempts=2, backoff_s=0.01),
)
node.start()
delivery = node.finish(job)
node.close()

print(json.dumps({
    "receipt": receipt.model_dump(mode="json"),
    "delivery": delivery.value,
    "service_importable": importlib.util.find_spec("service") is not None,
    "fastapi_importable": importlib.util.find_spec("fastapi") is not None,
}))
"""


def run(
    command: list[str], *, env: dict[str, str], timeout: float, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        command, capture_output=True, text=True, env=env, timeout=timeout, cwd=cwd
    )
    assert done.returncode == 0, f"{' '.join(command)}\n{done.stdout}\n{done.stderr}"
    return done


@pytest.mark.venv
def test_fresh_virtualenv_installs_the_client_alone_and_uploads(
    service: Service, tmp_path: Path
) -> None:
    # The source is copied first: pip builds in the tree it is given.
    source = tmp_path / "client-source"
    shutil.copytree(CLIENT, source, ignore=shutil.ignore_patterns("build", "*.egg-info"))
    venv = tmp_path / "venv"
    env = {
        k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")
    }
    # Without a pip of its own (this environment's pip installs into it: `--python`), which
    # saves seeding one; what the client brings is the same.
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)], env=env, timeout=60)
    python = str(venv / "bin" / "python")
    pip = [sys.executable, "-m", "pip", "--python", python]
    pip += ["--disable-pip-version-check", "--no-input"]
    run([*pip, "install", "--quiet", str(source)], env=env, timeout=INSTALL_TIMEOUT_S)

    listed = run([*pip, "list", "--format", "json"], env=env, timeout=60)
    installed = {entry["name"].lower() for entry in json.loads(listed.stdout)}
    assert {"vramcast-client", "httpx", "pydantic"} <= installed
    assert not installed & SERVICE_STACK, sorted(installed & SERVICE_STACK)

    run_id = f"fresh-{uuid.uuid4().hex[:8]}"
    node = run(
        [
            python,
            "-c",
            NODE_SCRIPT,
            service.url,
            service.upload_key,
            run_id,
            str(tmp_path / "spool"),
            json.dumps(SMALL_JOB),
        ],
        env=env,
        cwd=tmp_path,  # not the repository: `service` must not be importable
        timeout=120,
    )
    answer = json.loads(node.stdout)
    assert not answer["service_importable"] and not answer["fastapi_importable"]
    receipt = answer["receipt"]
    assert receipt["replayed"] is False and receipt["model"] == SMALL_JOB["model"]
    assert {ratio["level"] for ratio in receipt["ratios"]} == {"allocated", "reserved"}
    assert answer["delivery"] == "uploaded"

    (stored,) = service.store.uploads(run_id + "-client")
    assert stored.id == receipt["id"] and stored.node_id == "fresh-node"
    (reported,) = service.store.uploads(run_id + "-reporter")
    assert reported.measured_device_bytes == 5 * 1024**3
    assert reported.gpu_memory_total_bytes == 85_899_345_920
