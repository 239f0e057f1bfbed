"""POST /v1/estimates for DeepSeek models: V2's and V3's steps are estimated, the settings no
reference trace checked are refused (422 naming the field)."""

from __future__ import annotations

from fastapi.testclient import TestClient

JOB = {"model": "deepseek-ai/DeepSeek-V2-Lite", "batch_size": 1, "seq_len": 1024}
ALL_LINEAR = {"target_modules": "all-linear"}


def test_a_v2_step_is_estimated(client: TestClient) -> None:
    response = client.post("/v1/estimates", json={**JOB, "lora": ALL_LINEAR})
    assert response.status_code == 200, response.text
    body = response.json()
    # the routed experts' merged weights dominate the activations (26 MoE layers, ~1.1 GB each)
    assert body["components"]["activations"] > 26 * 10**9
    assert body["peak"]["allocated_bytes"] <= body["peak"]["reserved_bytes"]


def test_a_v3_step_is_estimated(client: TestClient) -> None:
    job = {**JOB, "model": "deepseek-ai/DeepSeek-V3", "lora": ALL_LINEAR}
    response = client.post("/v1/estimates", json={**job, "gradient_checkpointing": True})
    assert response.status_code == 200, response.text
    # 671B parameters in bf16 are 1.25 TiB of frozen weights alone
    assert response.json()["components"]["frozen_weights"] > 1.2 * 2**40


def test_an_unchecked_setting_is_422_naming_it(client: TestClient) -> None:
    response = client.post("/v1/estimates", json={**JOB, "lora": ALL_LINEAR, "autocast": True})
    assert response.status_code == 422, response.text
    error = response.json()["errors"][0]
    assert error["loc"][-1] == "autocast"
    assert "DeepSeek" in error["detail"]


def test_peft_s_missing_default_targets_come_first(client: TestClient) -> None:
    response = client.post("/v1/estimates", json=JOB)
    assert response.status_code == 422, response.text
    assert response.json()["errors"][0]["loc"] == ["body", "lora", "target_modules"]
