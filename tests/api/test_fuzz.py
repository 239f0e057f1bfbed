"""Schema-generated and malformed requests never get a 5xx, and errors stay problem+json."""

from __future__ import annotations

import atexit
import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.checks import negative_data_rejection, positive_data_acceptance
from schemathesis.python import asgi

from service.api.problems import PROBLEM_MEDIA_TYPE
from service.store.keys import KeyScope
from service.store.migrate import upgrade
from tests.api.conftest import FULL_JOB, SMALL_JOB, issue_key, make_app

# An app on a store of its own (migrated SQLite, in a temporary directory), with read keys
# required, so that every route runs with a valid key of each scope: uploads are stored.
STORE = Path(tempfile.mkdtemp(prefix="vramcast-fuzz-"))
atexit.register(shutil.rmtree, STORE, ignore_errors=True)
STORE_URL = f"sqlite:///{STORE / 'store.db'}"
upgrade(STORE_URL)
APP = make_app(database_url=STORE_URL, require_read_key=True)
KEYS = {scope: issue_key(APP, scope) for scope in KeyScope}
# With an admin key (every route answers), every phase: the document's examples, its coverage
# (each field's boundaries and violations: most of the cases, generated as the tests are
# collected) and random requests; with a read or an upload key (the routes of another scope
# refuse it), random requests alone. The Authorization header is each test's key, never
# generated (nor left out as a schema violation).
SCHEMA = schemathesis.openapi.from_asgi("/openapi.json", APP)
FUZZED = schemathesis.openapi.from_asgi("/openapi.json", APP)
FUZZED.config.phases.update(phases=["examples", "fuzzing"])
for _schema in (SCHEMA, FUZZED):
    _schema.config.generation.update(with_security_parameters=False)
# One client for every case (schemathesis makes one per case), which looks up no proxy settings
# in the environment for each request: half of a case's time.
CLIENT = asgi.get_client(APP).__enter__()
CLIENT.trust_env = False
atexit.register(CLIENT.close)
OPERATIONS = sum(1 for _ in SCHEMA.get_all_operations())
# Random requests per operation and key (an operation that takes no input makes one or a few).
EXAMPLES = 60
MIN_CASES = 5000


@pytest.fixture(scope="module")
def fuzz_client() -> Iterator[TestClient]:
    with TestClient(APP, raise_server_exceptions=False) as client:
        yield client


POST_ROUTES = ("/v1/estimates", "/v1/estimates:batch", "/v1/fit-checks")

# The 422s a request the document allows may still get, by error type: each a constraint a
# JSON Schema cannot state, and why it cannot. Any other refusal of a schema-valid request is
# a disagreement between the document and the validation, and fails.
UNSTATABLE = {
    "invalid_spec": "the estimator's refusals of a job the document describes: fields checked "
    "against each other (a method's options beside another method, an objective's settings "
    "beside another objective, adalora.target_r <= init_r) and against the model (its modules, "
    "its position table), and values it does not model yet (an unknown trainer, adapter "
    "dropout); an upload stores such a job all the same, with its estimate error, so they are "
    "the estimator's and not the document's (which cannot compare two values or read the "
    "catalog)",
    "invalid_config": "an inline config.json is free JSON (any config a model publishes): what "
    "the parser needs of each model_type is the parser's",
    "implausible_measurement": "a measured peak against another value: the GPU's reported "
    "total, the level below it",
    "idempotency_key_reused": "an Idempotency-Key already used with another body: the store's "
    "state, not the request's",
}
# JSON Schema's integer is any number without a fraction (2.0 among them), while the API takes
# an integer only as an integer: an int_type error on a whole float.
WHOLE_FLOAT_ERROR = "int_type"
# Statuses a valid request may get besides 2xx and 422: a key without the route's scope, an
# unknown model or GPU (the catalog's, not the document's), and a body over the byte limit (a
# JSON Schema bounds items, not bytes).
ALLOWED = (401, 403, 404, 413)


def _value_at(case: Any, loc: list[Any]) -> Any:
    """What the case sent at an error's location ("body", "query" or "header", then keys)."""
    if not loc:
        return None
    value = {"body": case.body, "query": case.query, "header": case.headers}.get(loc[0])
    for key in loc[1:]:
        try:
            value = value[key]
        except (KeyError, IndexError, TypeError):
            return None
    return value


def _unstatable(case: Any, errors: list[dict[str, Any]]) -> list[Any]:
    """The errors of a schema-valid request that no constraint in UNSTATABLE explains (a
    batch's entries are located in its body, as its other errors are)."""
    left = []
    for error in errors:
        if error["type"] in UNSTATABLE:
            continue
        sent = _value_at(case, error["loc"])
        if error["type"] == WHOLE_FLOAT_ERROR and isinstance(sent, float) and sent.is_integer():
            continue
        left.append(error)
    return left


def valid_requests_are_accepted(ctx: Any, response: Any, case: Any) -> bool | None:
    """schemathesis' positive_data_acceptance, with the refusals of UNSTATABLE: a request the
    document allows is answered, or refused only for a constraint the document cannot state.
    A batch's entries are held to the same."""
    meta = case.meta
    if meta is None or not meta.generation.mode.is_positive:
        return None
    status = response.status_code
    if status >= 500 or status in ALLOWED or (200 <= status < 300 and not _is_batch(case)):
        return None
    if status == 422:
        left = _unstatable(case, response.json().get("errors") or [])
        assert not left, f"a schema-valid request refused: {left}"
        return None
    if status == 200:  # a batch: each refused job as a refused request
        for result in response.json()["results"]:
            if result["status"] == 422:
                left = _unstatable(case, result["problem"].get("errors") or [])
                assert not left, f"a schema-valid job refused: {left}"
        return None
    raise AssertionError(f"a schema-valid request answered {status}: {response.text[:500]}")


def _is_batch(case: Any) -> bool:
    return bool(case.operation.path == "/v1/estimates:batch")


CASES: dict[KeyScope, int] = dict.fromkeys(KeyScope, 0)
RAN: set[tuple[KeyScope, str]] = set()


def _generated(case: Any, scope: KeyScope) -> None:
    """One schema-generated request with a valid key of `scope`: no 5xx, every answer conforms
    to the document, schema-violating input is refused, and schema-valid input is accepted
    (`valid_requests_are_accepted`)."""
    CASES[scope] += 1
    RAN.add((scope, case.operation.label))
    excluded = [positive_data_acceptance]
    if _is_batch(case):
        excluded.append(negative_data_rejection)  # a bad job is its own entry, not a 422
    case.call_and_validate(
        session=CLIENT,
        headers={"Authorization": f"Bearer {KEYS[scope]}"},
        excluded_checks=excluded,
        additional_checks=[valid_requests_are_accepted],
    )


FUZZ_SETTINGS = settings(
    max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck)
)


@FUZZED.parametrize()
@FUZZ_SETTINGS
def test_schema_generated_requests_with_a_read_key(case: Any) -> None:
    _generated(case, KeyScope.READ)


@FUZZED.parametrize()
@FUZZ_SETTINGS
def test_schema_generated_requests_with_an_upload_key(case: Any) -> None:
    _generated(case, KeyScope.UPLOAD)


@SCHEMA.parametrize()
@FUZZ_SETTINGS
def test_schema_generated_requests_with_an_admin_key(case: Any) -> None:
    _generated(case, KeyScope.ADMIN)


def test_the_generated_requests_were_enough() -> None:
    """Every operation ran with every key (when the whole module ran): 5,000 cases or more."""
    if len(RAN) < OPERATIONS * len(KeyScope):
        pytest.skip("only part of the schema-generated tests ran")
    assert sum(CASES.values()) >= MIN_CASES, CASES
    print(f"{sum(CASES.values())} schema-generated cases:", {k.value: n for k, n in CASES.items()})


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
