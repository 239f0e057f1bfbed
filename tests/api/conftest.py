"""An isolated app per test, driven over HTTP in-process.

`make_app` apps share one migrated SQLite store that tests only read; tests that write the
store use `store_app`, on each database (SQLite and PostgreSQL, the store tests' fixtures).
"""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from service.api.app import create_app
from service.api.settings import Settings
from service.store.db import create_engine_from_url
from service.store.keys import KeyScope, create_key
from service.store.migrate import upgrade
from service.store.models import Base
from tests.store import conftest as store_conftest

# The issue's example job: every field given.
FULL_JOB: dict[str, Any] = {
    "model": "Qwen/Qwen2.5-7B-Instruct",
    "method": "qlora",
    "lora": {
        "r": 16,
        "lora_alpha": 32,
        "lora_dropout": 0.05,
        "target_modules": "all-linear",
        "adapter_dtype": "fp32",
        "modules_to_save": [],
    },
    "quantization": {"type": "nf4", "double_quant": True, "prepare_kbit": True},
    "dtype": "bf16",
    "autocast": True,
    "optim": "paged_adamw_8bit",
    "batch_size": 4,
    "seq_len": 2048,
    "gradient_checkpointing": True,
    "attn_implementation": "sdpa",
    "loss": "hf",
    "framework": "hf",
    "parallel": {"gpus": 1, "strategy": "ddp", "offload": "none"},
    "gpu": "A100-80GB",
}

SMALL_JOB: dict[str, Any] = {"model": "Qwen/Qwen2.5-0.5B", "batch_size": 2, "seq_len": 512}


def answered_as_the_core(client: TestClient, job: dict[str, Any]) -> dict[str, Any]:
    """POST /v1/estimates of `job`: a 200 whose allocated peak is the core estimator's for the
    spec the schema makes of it; returns the answer."""
    from service.api.schemas import JobSpec
    from service.catalog.models import default_catalog
    from service.core.estimator import estimate

    spec = JobSpec.model_validate(job).to_spec()
    response = client.post("/v1/estimates", json=job)
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    expected = estimate(default_catalog().resolve(job["model"]).arch, spec)
    assert body["peak"]["allocated_bytes"] == expected.allocated_bytes
    return body


def refused_naming(client: TestClient, job: dict[str, Any], field: str) -> None:
    """POST /v1/estimates of `job` is a 422 with an error located at `field`."""
    response = client.post("/v1/estimates", json=job)
    assert response.status_code == 422, response.text
    locs = [e["loc"] for e in response.json()["errors"]]
    assert any(field in loc for loc in locs), locs


@functools.cache
def read_only_store_url() -> str:
    directory = Path(tempfile.mkdtemp(prefix="vramcast-api-tests-"))
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    url = f"sqlite:///{directory / 'store.db'}"
    upgrade(url)
    return url


def make_app(**settings: Any) -> FastAPI:
    """An app on the read-only store; its listings open unless a test asks for read keys
    (`TestReadKeys` checks the keyed default)."""
    defaults = {"database_url": read_only_store_url(), "require_read_key": False}
    return create_app(Settings(**{**defaults, **settings}))


def issue_key(app: FastAPI, *scopes: KeyScope, nodes: Sequence[str] = ("*",)) -> str:
    """A new API key's token, stored in the app's database; an upload key uploads for
    `nodes` (any node id unless told)."""
    uploads = KeyScope.UPLOAD in scopes and KeyScope.ADMIN not in scopes
    with app.state.services.sessions.begin() as session:
        issued = create_key(
            session,
            scopes=scopes,
            name="tests",
            now=datetime.now(UTC),
            nodes=nodes if uploads else (),
        )
        return issued.token


def empty_store(url: str) -> None:
    engine = create_engine_from_url(url)
    try:
        with engine.begin() as connection:
            for table in reversed(Base.metadata.sorted_tables):
                connection.execute(table.delete())
    finally:
        engine.dispose()


@pytest.fixture
def app() -> FastAPI:
    return make_app()


@pytest.fixture
def client(app: FastAPI) -> Iterator[TestClient]:
    with TestClient(app) as test_client:
        yield test_client


# The store tests' migrated databases, SQLite and PostgreSQL (fixtures are found by name).
database_url = store_conftest.database_url


@pytest.fixture
def store_app(database_url: str) -> Iterator[FastAPI]:
    """An app on each database, migrated; what the test stored is deleted after it."""
    yield make_app(database_url=database_url)
    empty_store(database_url)


@pytest.fixture
def store_client(store_app: FastAPI) -> Iterator[TestClient]:
    with TestClient(store_app) as test_client:
        yield test_client
