"""HTTP hygiene: 415 for bodies that are not JSON, strict numbers and booleans, request ids,
and the JSON access log."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any, get_args

import pytest
from fastapi.testclient import TestClient

from service.api.access import ACCESS_LOGGER, REQUEST_ID_HEADER
from service.api.problems import PROBLEM_MEDIA_TYPE, ProblemType
from service.api.schemas import JobSpec
from service.api.schemas.base import In
from service.api.schemas.calibrations import CalibrationFilterIn
from tests.api.conftest import SMALL_JOB, make_app

JSON_ROUTES: dict[str, dict[str, Any]] = {
    "/v1/estimates": SMALL_JOB,
    "/v1/estimates:batch": {"jobs": [SMALL_JOB]},
    "/v1/fit-checks": {"job": SMALL_JOB, "gpus": ["A100-80GB"]},
    "/v1/calibrations": {},
}


def _problem(response: Any, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == PROBLEM_MEDIA_TYPE
    body: dict[str, Any] = response.json()
    assert body["status"] == status
    return body


@pytest.mark.parametrize("route", sorted(JSON_ROUTES))
@pytest.mark.parametrize(
    "content_type", ["text/plain", "application/x-www-form-urlencoded", "application/xml"]
)
def test_a_body_that_is_not_json_is_415_naming_its_content_type(
    client: TestClient, route: str, content_type: str
) -> None:
    body = json.dumps(JSON_ROUTES[route]).encode()
    response = client.post(route, content=body, headers={"content-type": content_type})
    problem = _problem(response, 415)
    assert problem["type"] == ProblemType.UNSUPPORTED_MEDIA_TYPE
    assert problem["content_type"] == content_type
    assert content_type in problem["detail"]
    assert "application/json" in problem["detail"]


@pytest.mark.parametrize(
    "content_type", ["application/json", "application/json; charset=utf-8", "application/x+json"]
)
def test_json_content_types_are_accepted(client: TestClient, content_type: str) -> None:
    for route in ("/v1/estimates", "/v1/estimates:batch", "/v1/fit-checks"):
        body = json.dumps(JSON_ROUTES[route]).encode()
        response = client.post(route, content=body, headers={"content-type": content_type})
        assert response.status_code == 200, (route, response.text)


@pytest.mark.parametrize(
    ("field", "value", "kind"),
    [
        ("batch_size", True, "int_type"),
        ("batch_size", "8", "int_type"),
        ("batch_size", 8.5, "int_from_float"),
        ("seq_len", False, "int_type"),
        ("gradient_checkpointing", 1, "bool_type"),
        ("gradient_checkpointing", "true", "bool_type"),
        ("max_grad_norm", True, "float_type"),
        ("max_grad_norm", "1.0", "float_type"),
    ],
)
def test_numbers_and_booleans_are_taken_only_as_themselves(
    client: TestClient, field: str, value: Any, kind: str
) -> None:
    problem = _problem(client.post("/v1/estimates", json={**SMALL_JOB, field: value}), 422)
    assert problem["type"] == ProblemType.INVALID_REQUEST
    [error] = problem["errors"]
    assert error["loc"] == ["body", field]
    assert error["type"] == kind
    assert field in problem["detail"]


def test_nested_and_batched_fields_are_strict_too(client: TestClient) -> None:
    job = {**SMALL_JOB, "lora": {"r": True}, "parallel": {"gpus": True}}
    problem = _problem(client.post("/v1/estimates", json=job), 422)
    assert {tuple(e["loc"]) for e in problem["errors"]} == {
        ("body", "lora", "r"),
        ("body", "parallel", "gpus"),
    }
    gpus = [{"memory_mib": True}]
    problem = _problem(client.post("/v1/fit-checks", json={"job": SMALL_JOB, "gpus": gpus}), 422)
    assert problem["errors"][0]["loc"] == ["body", "gpus", 0, "memory_mib"]
    batch = client.post("/v1/estimates:batch", json={"jobs": [{**SMALL_JOB, "batch_size": True}]})
    [result] = batch.json()["results"]
    assert result["status"] == 422
    assert result["problem"]["errors"][0]["loc"] == ["body", "jobs", 0, "batch_size"]


def test_a_number_may_be_written_as_an_integer_but_an_integer_not_as_a_float(
    client: TestClient,
) -> None:
    as_written = {**SMALL_JOB, "max_grad_norm": 1, "lora": {"lora_dropout": 0}}
    assert client.post("/v1/estimates", json=as_written).status_code == 200
    integral = client.post("/v1/estimates", json={**SMALL_JOB, "batch_size": 2.0})
    problem = _problem(integral, 422)
    assert problem["errors"][0]["loc"] == ["body", "batch_size"]
    assert problem["errors"][0]["detail"] == "Input should be a valid integer"


class TestRequestId:
    def test_a_new_id_on_every_response(self, client: TestClient) -> None:
        ids = {client.get("/livez").headers[REQUEST_ID_HEADER] for _ in range(3)}
        assert len(ids) == 3
        assert all(len(i) == 32 and int(i, 16) >= 0 for i in ids)

    def test_a_sane_id_is_echoed_on_answers_and_errors(self, client: TestClient) -> None:
        sent = {REQUEST_ID_HEADER: "req-7f3a:42/b"}
        assert client.get("/livez", headers=sent).headers[REQUEST_ID_HEADER] == "req-7f3a:42/b"
        missing = client.get("/v1/nothing-here", headers=sent)
        assert missing.status_code == 404
        assert missing.headers[REQUEST_ID_HEADER] == "req-7f3a:42/b"
        refused = client.post(
            "/v1/estimates", content=b"x", headers={**sent, "content-type": "a/b"}
        )
        assert refused.status_code == 415
        assert refused.headers[REQUEST_ID_HEADER] == "req-7f3a:42/b"

    @pytest.mark.parametrize("sent", ["has space", 'quote"d', "x" * 129, "ünï"])
    def test_an_unsafe_id_is_replaced(self, client: TestClient, sent: str) -> None:
        answered = client.get(
            "/livez", headers=[(REQUEST_ID_HEADER.encode(), sent.encode())]
        ).headers[REQUEST_ID_HEADER]
        assert answered != sent
        assert len(answered) == 32

    def test_the_413_of_the_body_limit_carries_it(self) -> None:
        with TestClient(make_app(max_body_bytes=1024)) as client:
            response = client.post(
                "/v1/estimates", content=b" " * 2048, headers={REQUEST_ID_HEADER: "big-1"}
            )
        assert response.status_code == 413
        assert response.headers[REQUEST_ID_HEADER] == "big-1"


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def access_log() -> Iterator[list[logging.LogRecord]]:
    logger = logging.getLogger(ACCESS_LOGGER)
    handler = _Records()
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield handler.records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def test_each_request_is_one_json_line_with_route_status_latency_and_id(
    client: TestClient, access_log: list[logging.LogRecord]
) -> None:
    ok = client.post("/v1/estimates", json=SMALL_JOB, headers={REQUEST_ID_HEADER: "job-1"})
    bad = client.post("/v1/estimates", json={**SMALL_JOB, "batch_size": True})
    model = client.get("/v1/models/Qwen/Qwen2.5-0.5B")
    client.get("/nowhere")
    lines = [json.loads(record.getMessage()) for record in access_log]
    assert [(line["method"], line["route"], line["status"]) for line in lines] == [
        ("POST", "/v1/estimates", 200),
        ("POST", "/v1/estimates", 422),
        ("GET", "/v1/models/{model_id:path}", 200),
        ("GET", "unmatched", 404),
    ]
    assert [line["request_id"] for line in lines[:3]] == [
        "job-1",
        bad.headers[REQUEST_ID_HEADER],
        model.headers[REQUEST_ID_HEADER],
    ]
    assert ok.headers[REQUEST_ID_HEADER] == "job-1"
    for line, record in zip(lines, access_log, strict=True):
        assert set(line) == {"request_id", "method", "route", "status", "latency_ms"}
        assert 0 < line["latency_ms"] < 60_000
        assert record.name == ACCESS_LOGGER
        assert record.levelno == logging.INFO
        assert record.access == line  # type: ignore[attr-defined]


def _subclasses(model: type[In]) -> Iterator[type[In]]:
    for sub in model.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def _takes_int(annotation: Any) -> bool:
    return annotation is int or any(_takes_int(arg) for arg in get_args(annotation))


def test_every_integer_of_a_request_body_refuses_booleans_and_text() -> None:
    # Query parameters arrive as text: their model reads "50" as 50.
    bodies = {m for m in _subclasses(In) if m is not CalibrationFilterIn}
    assert JobSpec in bodies
    unchecked = [
        f"{model.__name__}.{name}"
        for model in bodies
        for name, field in model.model_fields.items()
        if _takes_int(field.annotation)
        and not any(
            name in validator.info.fields
            for validator in model.__pydantic_decorators__.field_validators.values()
        )
    ]
    assert not unchecked, f"add these to the model's `integers(...)`: {unchecked}"
