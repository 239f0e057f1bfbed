"""POST /v1/estimates with objective 'orpo': the settings reach the core, the answer shows the
doubled batch and its logits, and what is not modelled is a 422 naming the field."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from service.api.schemas import JobSpec
from service.core.spec import Method, Objective
from service.core.spec.orpo import OrpoSpec
from tests.api.conftest import SMALL_JOB, answered_as_the_core, refused_naming

ORPO_JOB: dict[str, Any] = {**SMALL_JOB, "objective": "orpo"}


def test_orpo_settings_reach_the_core_and_the_answer(client: TestClient) -> None:
    job = {**ORPO_JOB, "method": "lora", "orpo": {"disable_dropout": False}}
    spec = JobSpec.model_validate(job).to_spec()
    assert spec.objective is Objective.ORPO and spec.method is Method.LORA
    assert spec.orpo == OrpoSpec(disable_dropout=False)
    text = str(answered_as_the_core(client, job))
    assert "ORPOTrainer" in text and "4 sequences of 512 tokens" in text
    assert "reference_model" not in text


@pytest.mark.parametrize(
    ("job", "field"),
    [
        ({**SMALL_JOB, "orpo": {}}, "orpo"),
        ({**ORPO_JOB, "orpo": {"disable_dropout": "maybe"}}, "disable_dropout"),
        ({**ORPO_JOB, "dpo": {}}, "dpo"),
        ({**ORPO_JOB, "parallel": {"gpus": 2, "strategy": "fsdp"}}, "parallel"),
        ({**ORPO_JOB, "autocast": True, "dtype": "fp16"}, "autocast"),
        ({**ORPO_JOB, "method": "qlora", "autocast": True}, "autocast"),
        ({**ORPO_JOB, "model": "google-bert/bert-base-uncased", "method": "full"}, "objective"),
        ({**ORPO_JOB, "model": "Qwen/Qwen1.5-MoE-A2.7B"}, "objective"),
        ({**ORPO_JOB, "framework": "litgpt"}, "framework"),
        ({**ORPO_JOB, "method": "ia3"}, "method"),
        ({**ORPO_JOB, "loss": "fused"}, "loss"),
    ],
)
def test_what_orpo_does_not_model_is_422_naming_the_field(
    client: TestClient, job: dict[str, Any], field: str
) -> None:
    refused_naming(client, job, field)


def test_orpo_under_trls_default_bf16_is_answered(client: TestClient) -> None:
    mixed = client.post("/v1/estimates", json={**ORPO_JOB, "autocast": True})
    plain = client.post("/v1/estimates", json=ORPO_JOB)
    assert mixed.status_code == plain.status_code == 200, mixed.text
    assert mixed.json()["peak"]["allocated_bytes"] > plain.json()["peak"]["allocated_bytes"]


def test_a_fit_check_suggests_nothing_orpo_trainer_cannot_do(client: TestClient) -> None:
    """No reference log-probs to precompute and no loss to swap: ORPO's changes are the
    optimizer's, checkpointing and the micro-batch."""
    job = {**ORPO_JOB, "model": "Qwen/Qwen2.5-7B", "method": "lora", "seq_len": 4096}
    response = client.post("/v1/fit-checks", json={"job": job, "gpus": ["A100-40GB"]})
    assert response.status_code == 200, response.text
    text = str(response.json())
    assert "precompute_ref_log_probs" not in text and "fused_loss" not in text
    assert "gradient_checkpointing" in text or "max_batch_size" in text
