"""POST /v1/estimates for a model whose config parses but whose step is not modelled yet."""

from __future__ import annotations

from fastapi.testclient import TestClient

from service.api.problems import PROBLEM_MEDIA_TYPE

JOB = {"model": "deepseek-ai/DeepSeek-V2-Lite", "batch_size": 1, "seq_len": 1024}


def test_an_unmodelled_step_is_422_naming_model_type(client: TestClient) -> None:
    job = {**JOB, "lora": {"target_modules": "all-linear"}}
    response = client.post("/v1/estimates", json=job)
    assert response.status_code == 422, response.text
    assert response.headers["content-type"] == PROBLEM_MEDIA_TYPE
    error = response.json()["errors"][0]
    assert error["loc"][-1] == "model_type"
    assert "not modelled yet" in error["detail"]
    assert "lower bound" in error["detail"]


def test_peft_s_missing_default_targets_come_first(client: TestClient) -> None:
    response = client.post("/v1/estimates", json=JOB)
    assert response.status_code == 422, response.text
    assert response.json()["errors"][0]["loc"] == ["body", "lora", "target_modules"]
