"""POST /v1/estimates with liger_kernel: the option reaches the core and its fused loss the
answer; a model type whose Liger patches are not modelled is a 422 naming the field."""

from __future__ import annotations

from typing import Any

from fastapi.testclient import TestClient

from tests.api.conftest import SMALL_JOB, answered_as_the_core

LIGER_JOB: dict[str, Any] = {**SMALL_JOB, "liger_kernel": True}


def test_liger_reaches_the_core_and_drops_the_logits(client: TestClient) -> None:
    body = answered_as_the_core(client, LIGER_JOB)
    plain = answered_as_the_core(client, SMALL_JOB)
    assert body["peak"]["allocated_bytes"] < plain["peak"]["allocated_bytes"]
    assert any("fused linear cross-entropy" in a for a in body["assumptions"])


def test_unmodelled_model_types_are_422_naming_the_field(client: TestClient) -> None:
    response = client.post(
        "/v1/estimates", json={**LIGER_JOB, "model": "microsoft/Phi-3-mini-4k-instruct"}
    )
    assert response.status_code == 422, response.text
    locs = [e["loc"] for e in response.json()["errors"]]
    assert any("liger_kernel" in loc for loc in locs), locs


def test_another_loss_beside_liger_is_422_naming_the_loss(client: TestClient) -> None:
    response = client.post("/v1/estimates", json={**LIGER_JOB, "loss": "hf"})
    assert response.status_code == 422, response.text
    locs = [e["loc"] for e in response.json()["errors"]]
    assert any("loss" in loc for loc in locs), locs
