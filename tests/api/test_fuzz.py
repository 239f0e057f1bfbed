"""Schema-generated and malformed requests never get a 5xx, and errors stay problem+json."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.checks import negative_data_rejection, positive_data_acceptance

from service.api.problems import PROBLEM_MEDIA_TYPE
from tests.api.conftest import FULL_JOB, SMALL_JOB, make_app

APP = make_app()
SCHEMA = schemathesis.openapi.from_asgi("/openapi.json", APP)


@pytest.fixture(scope="module")
def fuzz_client() -> Iterator[TestClient]:
    with TestClient(APP, raise_server_exceptions=False) as client:
        yield client


POST_ROUTES = ("/v1/estimates", "/v1/estimates:batch", "/v1/fit-checks")


@SCHEMA.parametrize()
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
def test_schema_generated_requests(case: Any) -> None:
    """Valid and schema-violating requests from the OpenAPI document (schemathesis): no 5xx,
    every answer conforms to the document, and schema-violating input is rejected."""
    # The core refuses some schema-valid combinations (full fine-tuning with LoRA options, a
    # model without the requested modules): a 422 for valid-looking data is expected.
    excluded = [positive_data_acceptance]
    if case.operation.path == "/v1/estimates:batch":
        excluded.append(negative_data_rejection)  # a bad job is its own entry, not a 422
    case.call_and_validate(excluded_checks=excluded)


def _assert_handled(response: Any) -> None:
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        assert response.headers["content-type"] == PROBLEM_MEDIA_TYPE
        assert "Traceback" not in response.text


JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner),
    max_leaves=20,
)


@settings(max_examples=150, deadline=None)
@given(route=st.sampled_from(POST_ROUTES), body=st.binary(max_size=300))
def test_arbitrary_bytes(fuzz_client: TestClient, route: str, body: bytes) -> None:
    _assert_handled(
        fuzz_client.post(route, content=body, headers={"content-type": "application/json"})
    )


@settings(max_examples=150, deadline=None)
@given(route=st.sampled_from(POST_ROUTES), body=JSON)
def test_arbitrary_json(fuzz_client: TestClient, route: str, body: Any) -> None:
    _assert_handled(fuzz_client.post(route, json=body))


@settings(max_examples=100, deadline=None)
@given(
    base=st.sampled_from([SMALL_JOB, FULL_JOB]),
    field=st.sampled_from(sorted(FULL_JOB)),
    value=JSON,
)
def test_one_field_replaced_by_anything(
    fuzz_client: TestClient, base: dict[str, Any], field: str, value: Any
) -> None:
    job = {**base, field: value}
    _assert_handled(fuzz_client.post("/v1/estimates", json=job))
    _assert_handled(fuzz_client.post("/v1/fit-checks", json={"job": job, "gpus": ["L4"]}))
    batch = fuzz_client.post("/v1/estimates:batch", json={"jobs": [job, SMALL_JOB]})
    assert batch.status_code == 200
    assert batch.json()["results"][1]["status"] == 200


@settings(max_examples=100, deadline=None)
@given(
    config=st.dictionaries(
        st.sampled_from(
            _CONFIG_KEYS := [
                "model_type",
                "hidden_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
                "intermediate_size",
                "vocab_size",
                "head_dim",
                "tie_word_embeddings",
                "max_position_embeddings",
                "num_local_experts",
                "num_experts_per_tok",
                "hidden_act",
                "final_logit_softcapping",
            ]
        ),
        st.integers(-2, 2**40)
        | st.sampled_from(["llama", "qwen2", "mixtral", "phi", "gelu"])
        | JSON,
    )
)
def test_arbitrary_model_configs(fuzz_client: TestClient, config: dict[str, Any]) -> None:
    job = {**SMALL_JOB, "model": {"hf_config": config}}
    _assert_handled(fuzz_client.post("/v1/estimates", json=job))


def test_pathological_bodies(fuzz_client: TestClient) -> None:
    deep = '{"model": {"hf_config": {"a": ' + "[" * 900 + "]" * 900 + "}}}"
    many_fields = "{" + ",".join(f'"k{i}": 1' for i in range(5000)) + "}"
    long_key = '{"' + "k" * 100_000 + '": 1}'
    nested = "[" * 100_000 + "]" * 100_000
    for body in (deep, many_fields, long_key, nested, "", "null", '"\\ud800"'):
        for route in POST_ROUTES:
            response = fuzz_client.post(
                route, content=body.encode(), headers={"content-type": "application/json"}
            )
            assert response.status_code == 422, (route, body[:40], response.text[:200])
            _assert_handled(response)
    _assert_handled(fuzz_client.get("/v1/models/" + "x" * 5000))
    for literal in ("NaN", "Infinity", "-Infinity", "1e999"):
        job = json.dumps({**SMALL_JOB, "lora": {"lora_dropout": 0.1}}).replace("0.1", literal)
        gpu = {"name": "L4", "price_per_hour": 0.1}
        fit = json.dumps({"job": SMALL_JOB, "gpus": [gpu]}).replace("0.1", literal)
        for route, body in (("/v1/estimates", job), ("/v1/fit-checks", fit)):
            response = fuzz_client.post(
                route, content=body, headers={"content-type": "application/json"}
            )
            assert response.status_code == 422, (route, literal)
    big = json.dumps({**SMALL_JOB, "lora": {"modules_to_save": ["m" * 100] * 20_000}})
    assert fuzz_client.post("/v1/estimates", content=big.encode()).status_code == 413
