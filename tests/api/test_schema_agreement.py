"""Where the OpenAPI document once allowed what validation refuses: each constraint is now
stated in the document, and the API refuses exactly what it states (422 naming the field)."""

from __future__ import annotations

import re
from typing import Any

from fastapi import FastAPI
from fastapi.testclient import TestClient

from service.api.schemas.jobs import MAX_MODEL_ID_CHARS
from service.calibration.uploads import encode_cursor
from service.core.limits import MAX_PRNG_KEY
from service.core.reserved import REPLAY_CEILING
from service.store.keys import KeyScope
from tests.api.conftest import SMALL_JOB, issue_key, make_app, refused_naming
from tests.api.test_calibrations import upload_body

DOCUMENT = make_app().openapi()


def component(name: str) -> dict[str, Any]:
    found: dict[str, Any] = DOCUMENT["components"]["schemas"][name]
    return found


def test_deepspeed_and_fsdp_configs_are_not_both_given(client: TestClient) -> None:
    assert component("ParallelIn")["not"] == {
        "required": ["deepspeed_config", "fsdp_config"],
        "properties": {"deepspeed_config": {"type": "object"}, "fsdp_config": {"type": "object"}},
    }
    both = {**SMALL_JOB, "parallel": {"deepspeed_config": {}, "fsdp_config": {}}}
    refused_naming(client, both, "parallel")
    # either may be null beside the other, as the document's `not` allows
    one = {**SMALL_JOB, "parallel": {"deepspeed_config": None, "fsdp_config": {}}}
    assert client.post("/v1/estimates", json=one).status_code == 200


def test_a_cursor_is_one_the_service_can_issue(client: TestClient) -> None:
    [parameter] = [
        p
        for p in DOCUMENT["paths"]["/v1/calibrations"]["get"]["parameters"]
        if p["name"] == "cursor"
    ]
    pattern = re.compile(parameter["schema"]["anyOf"][0]["pattern"])
    for upload_id in (1, 9, 10, 99, 100, 12345, 10**16, 10**17 - 1):
        assert pattern.fullmatch(encode_cursor(upload_id)), upload_id
    for cursor in ("0", encode_cursor(0), encode_cursor(10**17), "YmVmb3JlOjA"):
        assert not pattern.fullmatch(cursor), cursor
        response = client.get("/v1/calibrations", params={"cursor": cursor})
        assert response.status_code == 422
        assert response.json()["errors"][0]["loc"] == ["query", "cursor"]
    assert client.get("/v1/calibrations", params={"cursor": encode_cursor(7)}).status_code == 200


def test_a_strategy_is_listed_once(client: TestClient) -> None:
    assert component("PlacementIn")["properties"]["strategies"]["uniqueItems"] is True
    body = {"job": SMALL_JOB, "gpus": ["L4"], "placement": {"strategies": ["ddp", "ddp"]}}
    response = client.post("/v1/fit-checks", json=body)
    assert response.status_code == 422
    assert response.json()["errors"][0]["loc"] == ["body", "placement", "strategies"]


def test_the_prng_key_bound_is_the_documents_to_the_integer(client: TestClient) -> None:
    bound = component("VeraIn")["properties"]["projection_prng_key"]["maximum"]
    assert bound == MAX_PRNG_KEY and int(bound) == MAX_PRNG_KEY  # exact as a JSON number
    job = {**SMALL_JOB, "method": "vera", "vera": {"projection_prng_key": MAX_PRNG_KEY}}
    assert client.post("/v1/estimates", json=job).status_code == 200
    over = {**job, "vera": {"projection_prng_key": MAX_PRNG_KEY + 1}}
    refused_naming(client, over, "projection_prng_key")


def test_a_model_id_is_as_long_as_the_store_keeps(client: TestClient) -> None:
    model_id = component("ModelRef")["properties"]["id"]
    assert model_id["maxLength"] == MAX_MODEL_ID_CHARS
    refused_naming(client, {**SMALL_JOB, "model": "m" * (MAX_MODEL_ID_CHARS + 1)}, "model")
    unknown = client.post("/v1/estimates", json={**SMALL_JOB, "model": "m" * MAX_MODEL_ID_CHARS})
    assert unknown.status_code == 404


def test_an_upload_measures_a_level(store_app: FastAPI, store_client: TestClient) -> None:
    levels = ("allocated_bytes", "reserved_bytes", "device_bytes")
    assert component("MeasuredIn")["anyOf"] == [
        {"required": [level], "properties": {level: {"type": "integer"}}} for level in levels
    ]
    headers = {"Authorization": f"Bearer {issue_key(store_app, KeyScope.UPLOAD)}"}
    none = upload_body(device_bytes=None)
    response = store_client.post("/v1/calibrations", json=none, headers=headers)
    assert response.status_code == 422
    assert response.json()["errors"][0]["loc"][:2] == ["body", "measured"]
    # the upload of a job beyond any GPU is estimated (no allocator replay, no server error)
    huge = {**SMALL_JOB, "batch_size": 4096, "seq_len": 1 << 20}
    body = upload_body(device_bytes=10**9, job=huge, run_id="huge")
    response = store_client.post("/v1/calibrations", json=body, headers=headers)
    assert response.status_code == 201, response.text
    assert response.json()["estimate_error"] is None
    estimate = store_client.post("/v1/estimates", json=huge).json()
    assert estimate["peak"]["allocated_bytes"] > REPLAY_CEILING
