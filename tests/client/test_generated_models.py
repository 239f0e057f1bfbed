"""The client's job models are the OpenAPI document's: the committed module is what
`python -m service.openapi --client` writes from the committed openapi/openapi.json, and its
models take what the job schema takes."""

from __future__ import annotations

import json
from typing import get_args

from service.openapi import DEFAULT_PATH
from service.openapi.client import CLIENT_PATH, HEADER, client_text
from vramcast_client import _generated
from vramcast_client.models import Job, Lora, MethodName


def _document() -> dict[str, object]:
    document: dict[str, object] = json.loads(DEFAULT_PATH.read_text(encoding="utf-8"))
    return document


def test_the_committed_models_are_the_documents() -> None:
    committed = CLIENT_PATH.read_text(encoding="utf-8")
    assert committed.startswith(HEADER + "\n")
    assert committed == client_text(_document()), (
        "clients/python/src/vramcast_client/_generated.py is stale: "
        "run python -m service.openapi --client (make client-models)"
    )


def test_the_models_module_re_exports_the_generated_ones() -> None:
    assert Job is _generated.Job and Lora is _generated.Lora
    schemas = _document()["components"]
    assert isinstance(schemas, dict)
    methods = schemas["schemas"]["Method"]["enum"]
    assert list(get_args(MethodName)) == methods


def test_every_job_field_of_the_schema_is_a_field_of_the_job() -> None:
    components = _document()["components"]
    assert isinstance(components, dict)
    fields = set(components["schemas"]["JobSpec"]["properties"])
    assert set(Job.model_fields) == fields
