"""POST /v1/estimates:batch: results in order, each bad job failing on its own."""

from __future__ import annotations

from fastapi.testclient import TestClient

from service.api.problems import ProblemType
from service.api.schemas import MAX_BATCH_JOBS
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
