"""POST /v1/estimates and /v1/fit-checks with objective 'reward': the objective reaches the
core, the answer shows the doubled batch and no logits, and what is not modelled is a 422
naming the field."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from service.api.schemas import JobSpec
from service.catalog.models import default_catalog
from service.core.estimator import estimate
from service.core.spec import Method, Objective
from tests.api.conftest import SMALL_JOB

REWARD_JOB: dict[str, Any] = {**SMALL_JOB, "objective": "reward"}


def _error_fields(response: Any) -> list[list[Any]]:
    assert response.status_code == 422, response.text
    return [e["loc"] for e in response.json()["errors"]]


def test_the_reward_objective_reaches_the_core_and_the_answer(client: TestClient) -> None:
    job = {**REWARD_JOB, "method": "full"}
    spec = JobSpec.model_validate(job).to_spec()
    assert spec.objective is Objective.REWARD and spec.method is Method.FULL
    response = client.post("/v1/estimates", json=job)
    assert response.status_code == 200, response.text
    body = response.json()
    expected = estimate(default_catalog().resolve("Qwen/Qwen2.5-0.5B").arch, spec)
    assert body["peak"]["allocated_bytes"] == expected.allocated_bytes
    text = str(body)
    assert "RewardTrainer" in text and "score head" in text
    assert "reference_model" not in text


@pytest.mark.parametrize(
    ("job", "field"),
    [
        ({**REWARD_JOB, "parallel": {"gpus": 2, "strategy": "zero2"}}, "parallel"),
        ({**REWARD_JOB, "model": "google-bert/bert-base-uncased", "method": "full"}, "objective"),
        ({**REWARD_JOB, "model": "google/t5-v1_1-small", "method": "lora"}, "objective"),
        ({**REWARD_JOB, "framework": "litgpt"}, "framework"),
        ({**REWARD_JOB, "method": "ia3"}, "method"),
        ({**REWARD_JOB, "autocast": True, "dtype": "fp16"}, "autocast"),
        ({**REWARD_JOB, "num_labels": 2}, "num_labels"),
        ({**REWARD_JOB, "dpo": {}}, "dpo"),
    ],
)
def test_what_reward_does_not_model_is_422_naming_the_field(
    client: TestClient, job: dict[str, Any], field: str
) -> None:
    response = client.post("/v1/estimates", json=job)
    locs = _error_fields(response)
    assert any(field in loc for loc in locs), locs


def test_a_fit_check_of_a_reward_model_offers_no_fused_loss(client: TestClient) -> None:
    job = {**REWARD_JOB, "model": "Qwen/Qwen2.5-7B", "method": "full", "batch_size": 4}
    response = client.post("/v1/fit-checks", json={"job": job, "gpus": ["A100-40GB"]})
    assert response.status_code == 200, response.text
    changes = [c for s in response.json()["results"][0]["suggestions"] for c in s["changes"]]
    assert "lora" in changes and "fused_loss" not in changes
