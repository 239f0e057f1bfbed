"""A single body that copies a job read before at another shape: the same answer, byte for
byte, as the body read in full (`batch_body.read_known`)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from service.api import batch_body
from service.api.batch_body import known_key, read_known
from service.core.limits import MAX_BATCH_SIZE
from tests.api.conftest import FULL_JOB, SMALL_JOB, make_app

JOBS: list[dict[str, Any]] = [
    FULL_JOB,
    SMALL_JOB,
    {**SMALL_JOB, "method": "full", "gpu": "T4", "gradient_checkpointing": True},
    # Another objective: its copies' specs are checked again whole.
    {**SMALL_JOB, "objective": "dpo"},
    # KTO runs a KL batch: a micro-batch of one is refused at that shape alone.
    {**SMALL_JOB, "objective": "kto", "batch_size": 2},
    # A job the core refuses at every shape.
    {**SMALL_JOB, "method": "full", "lora": {"r": 4}},
    {**SMALL_JOB, "model": "nobody/no-such-model"},
]
SHAPES = [(1, 256), (2, 512), (3, 1000), (8, 4096)]


@pytest.fixture
def client() -> Iterator[TestClient]:
    batch_body._known.clear()
    # No kept answers: every answer below is computed.
    with TestClient(make_app(estimate_cache_entries=0)) as test_client:
        yield test_client
    batch_body._known.clear()


def _post(client: TestClient, job: dict[str, Any]) -> tuple[int, bytes]:
    response = client.post("/v1/estimates", content=json.dumps(job).encode())
    return response.status_code, response.content


def _read_in_full(client: TestClient, job: dict[str, Any]) -> tuple[int, bytes]:
    batch_body._known.clear()
    return _post(client, job)


@pytest.mark.parametrize("job", JOBS, ids=range(len(JOBS)))
def test_copies_at_other_shapes_answer_as_each_read_in_full(
    client: TestClient, job: dict[str, Any]
) -> None:
    copies = [{**job, "batch_size": b, "seq_len": s} for b, s in SHAPES]
    _post(client, job)
    shared = []
    for copy in copies:
        key = known_key(json.dumps(copy).encode())
        assert key is not None and read_known(key) is not None
        shared.append(_post(client, copy))
    assert shared == [_read_in_full(client, copy) for copy in copies]


def test_a_job_is_remembered_once_read_and_valid(client: TestClient) -> None:
    body = json.dumps(SMALL_JOB).encode()
    key = known_key(body)
    assert key is not None and read_known(key) is None
    _post(client, SMALL_JOB)
    found = read_known(key)
    assert found is not None and found[0].batch_size == SMALL_JOB["batch_size"]
    bad = {**SMALL_JOB, "lora_rank": 4}
    bad_key = known_key(json.dumps(bad).encode())
    assert bad_key is not None
    assert _post(client, bad)[0] == 422 and read_known(bad_key) is None


@pytest.mark.parametrize(
    "shape",
    [
        {"batch_size": True},  # a boolean
        {"batch_size": "2"},  # text
        {"batch_size": 2.0},  # a float, even a whole one, is not an integer
        {"seq_len": 0},  # out of bounds
        {"batch_size": MAX_BATCH_SIZE + 1},
        {"seq_len": None},
    ],
)
def test_a_shape_the_known_reading_cannot_take_is_answered_as_before(
    client: TestClient, shape: dict[str, Any]
) -> None:
    copy = {**SMALL_JOB, **shape}
    _post(client, SMALL_JOB)
    key = known_key(json.dumps(copy).encode())
    assert key is None or read_known(key) is None
    shared = _post(client, copy)
    assert shared[0] == 422
    assert shared == _read_in_full(client, copy)


def test_the_memo_is_forgotten_whole_when_full(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(batch_body, "MAX_KNOWN_JOBS", 2)
    for r in (4, 8, 16):
        _post(client, {**SMALL_JOB, "lora": {"r": r}})
    assert len(batch_body._known) <= 2
