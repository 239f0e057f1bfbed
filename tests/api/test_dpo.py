"""POST /v1/estimates and /v1/fit-checks with objective 'dpo': the settings reach the core, the
answer shows the reference model and the doubled batch, and what is not modelled is a 422
naming the field."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from service.api.schemas import JobSpec
from service.catalog.models import default_catalog
from service.core.estimator import estimate
from service.core.spec import DpoSpec, Method, Objective
from tests.api.conftest import SMALL_JOB

DPO_JOB: dict[str, Any] = {**SMALL_JOB, "objective": "dpo"}


def _error_fields(response: Any) -> list[list[Any]]:
    assert response.status_code == 422, response.text
    return [e["loc"] for e in response.json()["errors"]]


def test_dpo_settings_reach_the_core_and_the_answer(client: TestClient) -> None:
    job = {
        **DPO_JOB,
        "method": "full",
        "dpo": {"precompute_ref_log_probs": False, "max_completion_length": 128},
    }
    spec = JobSpec.model_validate(job).to_spec()
    assert spec.objective is Objective.DPO and spec.method is Method.FULL
    assert spec.dpo == DpoSpec(max_completion_length=128)
    response = client.post("/v1/estimates", json=job)
    assert response.status_code == 200, response.text
    body = response.json()
    expected = estimate(default_catalog().resolve("Qwen/Qwen2.5-0.5B").arch, spec)
    assert body["peak"]["allocated_bytes"] == expected.allocated_bytes
    text = str(body)
    assert "reference_model" in text and "reference_forward" in text
    assert "4 sequences of 512 tokens" in text


def test_sft_is_the_default_and_its_answer_is_unchanged(client: TestClient) -> None:
    plain = client.post("/v1/estimates", json=SMALL_JOB).json()
    named = client.post("/v1/estimates", json={**SMALL_JOB, "objective": "sft"}).json()
    assert plain["peak"] == named["peak"]
    assert "reference_model" not in str(plain)


@pytest.mark.parametrize(
    ("job", "field"),
    [
        ({**SMALL_JOB, "objective": "cpo"}, "objective"),
        ({**SMALL_JOB, "objective": "simpo-ish"}, "objective"),
        ({**SMALL_JOB, "dpo": {}}, "dpo"),
        ({**DPO_JOB, "parallel": {"gpus": 2, "strategy": "fsdp"}}, "parallel"),
        ({**DPO_JOB, "model": "google-bert/bert-base-uncased", "method": "full"}, "objective"),
        ({**DPO_JOB, "framework": "litgpt"}, "framework"),
        ({**DPO_JOB, "dpo": {"max_completion_length": 0}}, "dpo"),
    ],
)
def test_what_dpo_does_not_model_is_422_naming_the_field(
    client: TestClient, job: dict[str, Any], field: str
) -> None:
    response = client.post("/v1/estimates", json=job)
    locs = _error_fields(response)
    assert any(field in loc for loc in locs), locs


def test_a_fit_check_can_suggest_precomputed_reference_log_probs(client: TestClient) -> None:
    job = {**DPO_JOB, "model": "Qwen/Qwen2.5-7B", "method": "full", "batch_size": 1}
    response = client.post("/v1/fit-checks", json={"job": job, "gpus": ["A100-40GB"]})
    assert response.status_code == 200, response.text
    assert "precompute_ref_log_probs" in str(response.json())


def test_dpo_under_ddp_answers_per_rank_with_the_buckets(client: TestClient) -> None:
    job = {**DPO_JOB, "method": "full", "parallel": {"gpus": 4, "strategy": "ddp"}}
    response = client.post("/v1/estimates", json=job)
    assert response.status_code == 200, response.text
    one_gpu = client.post("/v1/estimates", json={**DPO_JOB, "method": "full"}).json()
    body = response.json()
    # each rank holds the one-GPU step, the frozen reference copy included, plus DDP's buckets
    assert body["peak"]["allocated_bytes"] > one_gpu["peak"]["allocated_bytes"]
    assert "reference_model" in str(body) and "4 sequences of 512 tokens" in str(body)
