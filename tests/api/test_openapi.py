"""The committed OpenAPI document is the app's, and documents every field with its bounds."""

from __future__ import annotations

from typing import Any

import pytest

from service.openapi import DEFAULT_PATH, main, openapi_document, render

DOCUMENT = openapi_document()
SCHEMAS: dict[str, Any] = DOCUMENT["components"]["schemas"]
# Schemas of request bodies: every field a client sends must be bounded.
REQUEST_SCHEMAS = (
    "JobSpec",
    "LoraIn",
    "QuantizationIn",
    "ParallelIn",
    "ModelRef",
    "GpuRef",
    "GpuOfferIn",
    "BatchIn",
    "FitCheckIn",
)


def test_committed_document_matches_the_app() -> None:
    committed = DEFAULT_PATH.read_text(encoding="utf-8")
    assert committed == render(DOCUMENT), "openapi/openapi.json drifted: python -m service.openapi"


def test_check_mode_reports_drift(tmp_path: Any) -> None:
    stale = tmp_path / "openapi.json"
    stale.write_text("{}\n", encoding="utf-8")
    assert main(["--check", str(stale)]) == 1
    assert main([str(stale)]) == 0
    assert main(["--check", str(stale)]) == 0


def _properties() -> list[tuple[str, str, dict[str, Any]]]:
    return [
        (schema_name, field, spec)
        for schema_name, schema in SCHEMAS.items()
        for field, spec in schema.get("properties", {}).items()
    ]


@pytest.mark.parametrize(("schema", "field", "spec"), _properties())
def test_every_field_has_a_description(schema: str, field: str, spec: dict[str, Any]) -> None:
    assert spec.get("description"), f"{schema}.{field} has no description"


def _variants(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [v for v in spec.get("anyOf", [spec]) if v.get("type") != "null"]


def _bounded(variant: dict[str, Any]) -> bool:
    if "$ref" in variant or "enum" in variant or "const" in variant:
        return True
    kind = variant.get("type")
    if kind in ("integer", "number"):
        return "maximum" in variant or "exclusiveMaximum" in variant
    if kind == "string":
        return "maxLength" in variant or "pattern" in variant
    if kind in ("array", "object"):
        return "maxItems" in variant or "maxProperties" in variant
    return kind == "boolean"


@pytest.mark.parametrize("schema", REQUEST_SCHEMAS)
def test_every_request_field_is_bounded(schema: str) -> None:
    for field, spec in SCHEMAS[schema]["properties"].items():
        for variant in _variants(spec):
            assert _bounded(variant), f"{schema}.{field} is unbounded: {variant}"
        if any(v.get("type") in ("integer", "number") for v in _variants(spec)):
            number = next(v for v in _variants(spec) if v.get("type") in ("integer", "number"))
            assert "minimum" in number or "exclusiveMinimum" in number, f"{schema}.{field}"


def test_problem_responses_are_declared() -> None:
    post = DOCUMENT["paths"]["/v1/estimates"]["post"]["responses"]
    for status in ("404", "413", "422"):
        assert "application/problem+json" in post[status]["content"]
    assert "Problem" in SCHEMAS
