"""POST /v1/estimates:batch: results in order, each bad job failing on its own."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi.testclient import TestClient
from pydantic_core import to_json

from service.api.batch_body import read_shared
from service.api.deps import estimation_for
from service.api.problems import ProblemType
from service.api.routes.estimates import encode_batch
from service.api.schemas import MAX_BATCH_JOBS, BatchIn
from service.core.limits import MAX_BATCH_SIZE
from tests.api.conftest import FULL_JOB, SMALL_JOB


def test_results_come_in_order(client: TestClient) -> None:
    jobs = [{**SMALL_JOB, "batch_size": b} for b in (1, 2, 3)]
    body = client.post("/v1/estimates:batch", json={"jobs": jobs}).json()
    assert [r["index"] for r in body["results"]] == [0, 1, 2]
    peaks = [r["estimate"]["peak"]["allocated_bytes"] for r in body["results"]]
    assert peaks == sorted(peaks) and len(set(peaks)) == 3
    assert body["succeeded"] == 3 and body["failed"] == 0


def test_each_bad_job_gets_its_own_problem(client: TestClient) -> None:
    jobs = [
        FULL_JOB,
        {**SMALL_JOB, "model": "Qwen/Qwen2.5-7B-Instrct"},  # unknown model
        {**SMALL_JOB, "batch_size": "many"},  # fails the schema
        {**SMALL_JOB, "method": "full", "lora": {"r": 4}},  # fails the core's checks
        {**SMALL_JOB, "gpu": "A100-81GB"},  # unknown GPU
        SMALL_JOB,
    ]
    response = client.post("/v1/estimates:batch", json={"jobs": jobs})
    assert response.status_code == 200
    results = response.json()["results"]
    assert [r["status"] for r in results] == [200, 404, 422, 422, 404, 200]
    assert results[0]["estimate"] and results[5]["estimate"]
    assert results[1]["problem"]["type"] == ProblemType.UNKNOWN_MODEL
    assert "Qwen/Qwen2.5-7B" in results[1]["problem"]["suggestions"]
    assert results[2]["problem"]["errors"][0]["loc"] == ["body", "jobs", 2, "batch_size"]
    assert results[2]["problem"]["errors"][0]["pointer"] == "/jobs/2/batch_size"
    assert results[3]["problem"]["errors"][0]["loc"] == ["body", "jobs", 3, "lora"]
    assert results[4]["problem"]["type"] == ProblemType.UNKNOWN_GPU
    assert response.json()["succeeded"] == 2 and response.json()["failed"] == 4


def test_a_job_that_is_not_an_object_fails_alone(client: TestClient) -> None:
    body = client.post("/v1/estimates:batch", json={"jobs": [7, SMALL_JOB]}).json()
    assert [r["status"] for r in body["results"]] == [422, 200]


def test_up_to_the_limit_is_answered(client: TestClient) -> None:
    jobs = [{**SMALL_JOB, "batch_size": 1 + i % 8} for i in range(MAX_BATCH_JOBS)]
    body = client.post("/v1/estimates:batch", json={"jobs": jobs}).json()
    assert body["succeeded"] == MAX_BATCH_JOBS


def test_over_the_limit_or_empty_is_422(client: TestClient) -> None:
    too_many = {"jobs": [{"model": "m", "batch_size": 1, "seq_len": 1}] * (MAX_BATCH_JOBS + 1)}
    for payload in (too_many, {"jobs": []}, {"jobs": "x"}, {}):
        response = client.post("/v1/estimates:batch", json=payload)
        assert response.status_code == 422
        assert response.json()["errors"][0]["loc"][:2] == ["body", "jobs"]


def test_a_body_that_is_not_a_batch_is_answered_as_a_declared_body_would_be(
    client: TestClient,
) -> None:
    cases: list[tuple[bytes, str, int, list[str | int]]] = [
        (b'{"jobs": [', "application/json", 422, ["body", 10]),  # malformed: where it broke
        (b"", "application/json", 422, ["body"]),  # empty: the body is missing
        (b"null", "application/json", 422, ["body"]),
        (b'{"jobs": [], "extra": 1}', "application/json", 422, ["body", "jobs"]),
        (b'{"jobs": "\xff"}', "application/json", 422, ["body"]),  # not UTF-8
        (b"[" * 100_000 + b"]" * 100_000, "application/json", 422, ["body"]),  # too deep
    ]
    for content, content_type, status, loc in cases:
        response = client.post(
            "/v1/estimates:batch", content=content, headers={"content-type": content_type}
        )
        assert response.status_code == status, content
        assert response.headers["content-type"] == "application/problem+json"
        assert response.json()["errors"][0]["loc"] == loc, content
    as_text = client.post(
        "/v1/estimates:batch",
        content=b'{"jobs": [{"model": "m", "batch_size": 1, "seq_len": 1}]}',
        headers={"content-type": "text/plain"},
    )
    assert as_text.status_code == 415
    assert as_text.json()["content_type"] == "text/plain"


def _answer(client: TestClient, jobs: list[Any]) -> Any:
    response = client.post("/v1/estimates:batch", json={"jobs": jobs})
    assert response.status_code == 200
    return response.json()


def test_a_batch_of_shapes_reads_each_distinct_job_once_and_answers_as_one_by_one(
    client: TestClient,
) -> None:
    """Jobs that differ only in batch and sequence are read once (`batch_body.read_shared`) and
    answered as the same jobs are one by one; two settings interleaved stay apart."""
    lora = {**SMALL_JOB, "gradient_checkpointing": True}
    jobs = [
        {**(SMALL_JOB if i % 2 else lora), "batch_size": 1 + i % 4, "seq_len": 256 * (1 + i)}
        for i in range(8)
    ]
    shared = read_shared(json.dumps({"jobs": jobs}).encode())
    assert shared is not None and shared.firsts == [0, 1, 0, 1, 0, 1, 0, 1]
    assert [job.batch_size for job in shared.jobs] == [job["batch_size"] for job in jobs]
    results = _answer(client, jobs)["results"]
    for job, result in zip(jobs, results, strict=True):
        alone = client.post("/v1/estimates", json=job).json()
        assert result["estimate"] == alone


@pytest.mark.parametrize(
    "shape",
    [
        {"batch_size": True},  # a boolean
        {"batch_size": "2"},  # text
        {"batch_size": 2.0},  # a float, even a whole one, is not an integer
        {"seq_len": 0},  # out of bounds in a copy
        {"batch_size": MAX_BATCH_SIZE + 1},
    ],
)
def test_a_copy_the_shared_reading_cannot_take_is_answered_as_before(
    client: TestClient, shape: dict[str, Any]
) -> None:
    jobs = [SMALL_JOB, {**SMALL_JOB, **shape}, {**SMALL_JOB, "batch_size": 3}]
    assert read_shared(json.dumps({"jobs": jobs}).encode()) is None
    results = _answer(client, jobs)["results"]
    assert results[0]["status"] == 200 and results[2]["status"] == 200
    name = next(iter(shape))
    assert results[1]["status"] == 422
    assert results[1]["problem"]["errors"][0]["loc"] == ["body", "jobs", 1, name]


def test_copies_of_a_job_the_core_refuses_fail_each_at_their_own_index(
    client: TestClient,
) -> None:
    bad = {**SMALL_JOB, "method": "full", "lora": {"r": 4}}
    jobs = [bad, {**bad, "batch_size": 2}, SMALL_JOB]
    assert read_shared(json.dumps({"jobs": jobs}).encode()) is not None
    results = _answer(client, jobs)["results"]
    assert [r["status"] for r in results] == [422, 422, 200]
    assert [r["problem"]["errors"][0]["loc"] for r in results[:2]] == [
        ["body", "jobs", 0, "lora"],
        ["body", "jobs", 1, "lora"],
    ]


def test_shared_jobs_answer_the_bytes_of_the_jobs_read_one_by_one(client: TestClient) -> None:
    """A batch's copies of a job, estimated at their own shapes from what the job resolves
    once (its model, GPU and compiled step), answer byte for byte what the same jobs read in
    full one by one answer: failures of the job, of its model, of its GPU and of a shape
    alone included."""
    gpu_job = {**FULL_JOB, "gpu": "A100-80GB"}
    kto = {**SMALL_JOB, "objective": "kto", "method": "lora"}
    groups: list[dict[str, Any]] = [
        gpu_job,  # many shapes: its step compiled, then read from its pieces
        {**SMALL_JOB, "gpu": "T4"},
        kto,  # a copy at batch size 1 is refused, the others answered
        {**kto, "gpu": "A100-80GB", "batch_size": 1},  # the job refused, copies answered
        {**SMALL_JOB, "model": "Qwen/Qwen2.5-7B-Instrct"},  # unknown model
        {**SMALL_JOB, "method": "full", "lora": {"r": 4}},  # refused by the core
        {**SMALL_JOB, "gpu": "A100-81GB"},  # unknown GPU
    ]
    jobs = [
        {**group, "batch_size": 1 + (i * 7) % 5, "seq_len": 200 + 37 * i}
        for i in range(24)
        for group in groups
    ]
    jobs = [*groups, *jobs]
    body = json.dumps({"jobs": jobs}).encode()
    shared = read_shared(body)
    assert shared is not None and len(set(shared.firsts)) == len(groups)
    services = client.app.state.services  # type: ignore[attr-defined]
    one_by_one = to_json(estimation_for(services).batch(BatchIn.model_validate_json(body).jobs))
    answer = json.loads(one_by_one)
    assert answer["failed"] > 0 and answer["succeeded"] > 0
    statuses = {r["status"] for r in answer["results"]}
    assert statuses == {200, 404, 422}
    assert encode_batch(estimation_for(services).shared_results(shared)) == one_by_one
    response = client.post(
        "/v1/estimates:batch", content=body, headers={"content-type": "application/json"}
    )
    assert response.content == one_by_one
    # Each answered job's estimate is, byte for byte, POST /v1/estimates' answer to it.
    for index, result in enumerate(answer["results"][: 3 * len(groups)]):
        if result["status"] == 200:
            alone = client.post("/v1/estimates", json=jobs[index]).content
            expected = b'{"index":%d,"status":200,"estimate":%s,"problem":null}' % (index, alone)
            assert expected in response.content
