"""POST /v1/estimates and /v1/fit-checks with objective 'kto': the settings reach the core, the
answer shows the reference model and the unpaired batch, a fit-check never offers a micro-batch
KTOTrainer refuses, and what is not modelled is a 422 naming the field."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from service.api.schemas import JobSpec
from service.catalog.models import default_catalog
from service.core.estimator import estimate
from service.core.spec import Method, Objective
from service.core.spec.kto import KtoLossType, KtoSpec
from tests.api.conftest import SMALL_JOB

KTO_JOB: dict[str, Any] = {**SMALL_JOB, "objective": "kto"}


def _error_fields(response: Any) -> list[list[Any]]:
    assert response.status_code == 422, response.text
    return [e["loc"] for e in response.json()["errors"]]


def test_kto_settings_reach_the_core_and_the_answer(client: TestClient) -> None:
    job = {
        **KTO_JOB,
        "method": "full",
        "kto": {"precompute_ref_log_probs": False, "loss_type": "kto"},
    }
    spec = JobSpec.model_validate(job).to_spec()
    assert spec.objective is Objective.KTO and spec.method is Method.FULL
    assert spec.kto == KtoSpec(loss_type=KtoLossType.KTO)
    response = client.post("/v1/estimates", json=job)
    assert response.status_code == 200, response.text
    body = response.json()
    expected = estimate(default_catalog().resolve("Qwen/Qwen2.5-0.5B").arch, spec)
    assert body["peak"]["allocated_bytes"] == expected.allocated_bytes
    text = str(body)
    assert "reference_model" in text and "reference_forward" in text
    assert "2 unpaired examples of 512 tokens" in text and "the KL batch" in text


def test_without_the_kl_batch_one_example_per_batch_is_taken(client: TestClient) -> None:
    job = {**KTO_JOB, "batch_size": 1, "kto": {"loss_type": "apo_zero_unpaired"}}
    response = client.post("/v1/estimates", json=job)
    assert response.status_code == 200, response.text
    assert "no KL batch" in str(response.json())


@pytest.mark.parametrize(
    ("job", "field"),
    [
        ({**SMALL_JOB, "kto": {}}, "kto"),
        ({**KTO_JOB, "batch_size": 1}, "batch_size"),
        ({**KTO_JOB, "kto": {"loss_type": "sigmoid"}}, "loss_type"),
        ({**KTO_JOB, "kto": {"precompute_ref_log_probs": "yes"}}, "precompute_ref_log_probs"),
        ({**KTO_JOB, "dpo": {}}, "dpo"),
        ({**KTO_JOB, "parallel": {"gpus": 2, "strategy": "fsdp"}}, "parallel"),
        ({**KTO_JOB, "autocast": True, "dtype": "fp16"}, "autocast"),
        ({**KTO_JOB, "model": "google-bert/bert-base-uncased", "method": "full"}, "objective"),
        ({**KTO_JOB, "model": "google/t5-v1_1-small", "method": "full"}, "objective"),
        ({**KTO_JOB, "model": "Qwen/Qwen1.5-MoE-A2.7B"}, "objective"),
        ({**KTO_JOB, "framework": "litgpt"}, "framework"),
        ({**KTO_JOB, "method": "ia3"}, "method"),
    ],
)
def test_what_kto_does_not_model_is_422_naming_the_field(
    client: TestClient, job: dict[str, Any], field: str
) -> None:
    response = client.post("/v1/estimates", json=job)
    locs = _error_fields(response)
    assert any(field in loc for loc in locs), locs


def test_a_fit_check_suggests_precomputed_log_probs(client: TestClient) -> None:
    job = {**KTO_JOB, "model": "Qwen/Qwen2.5-7B", "method": "full", "seq_len": 2048}
    response = client.post("/v1/fit-checks", json={"job": job, "gpus": ["A100-80GB"]})
    assert response.status_code == 200, response.text
    assert "precompute_ref_log_probs" in str(response.json())


@pytest.mark.parametrize(("loss_type", "largest"), [("kto", 0), ("apo_zero_unpaired", 1)])
def test_the_largest_micro_batch_is_one_kto_trainer_runs(
    client: TestClient, loss_type: str, largest: int
) -> None:
    """One example fits an A100-40GB, two do not (Qwen2.5-1.5B LoRA at 8192 tokens: about 24
    and 43 GiB): with the KL batch KTOTrainer refuses one, so nothing fits."""
    job = {
        **KTO_JOB,
        "model": "Qwen/Qwen2.5-1.5B",
        "method": "lora",
        "seq_len": 8192,
        "kto": {"loss_type": loss_type},
    }
    response = client.post("/v1/fit-checks", json={"job": job, "gpus": ["A100-40GB"]})
    assert response.status_code == 200, response.text
    assert [r["max_batch_size"] for r in response.json()["results"]] == [largest]
