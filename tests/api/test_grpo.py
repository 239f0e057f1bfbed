"""POST /v1/estimates and /v1/fit-checks with objective 'grpo': GRPOConfig's settings reach the
core, the answer shows the generation phase with its KV cache apart, the fit-check offers
GRPO's changes, and what is not modelled is a 422 naming the field."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from service.api.schemas import JobSpec
from service.catalog.models import default_catalog
from service.core.estimator import estimate
from service.core.spec import Objective
from service.core.spec.grpo import GrpoSpec

# Qwen2.5-1.5B LoRA, 8 completions of one prompt (GRPOConfig's default num_generations), 512
# prompt + 512 completion tokens
GRPO_JOB: dict[str, Any] = {
    "model": "Qwen/Qwen2.5-1.5B",
    "method": "lora",
    "lora": {"r": 16, "target_modules": "all-linear"},
    "batch_size": 8,
    "seq_len": 1024,
    "objective": "grpo",
    "grpo": {"num_generations": 8},
}


def _error_fields(response: Any) -> list[list[Any]]:
    assert response.status_code == 422, response.text
    return [e["loc"] for e in response.json()["errors"]]


def test_grpo_settings_reach_the_core_and_the_answer(client: TestClient) -> None:
    spec = JobSpec.model_validate(GRPO_JOB).to_spec()
    assert spec.objective is Objective.GRPO and spec.grpo == GrpoSpec(num_generations=8)
    response = client.post("/v1/estimates", json=GRPO_JOB)
    assert response.status_code == 200, response.text
    body = response.json()
    expected = estimate(default_catalog().resolve("Qwen/Qwen2.5-1.5B").arch, spec)
    assert body["peak"]["allocated_bytes"] == expected.allocated_bytes
    # the generation's KV cache, its own component: 28 layers x (key, value) x 8 rows x 256
    # x 512 prompt tokens x 2 bytes at the prefill
    assert body["generation"]["kv_cache_bytes"] == 28 * 2 * 8 * 256 * 512 * 2
    assert body["generation"]["allocated_bytes"] < body["estimated"]["allocated_bytes"]
    phases = [(p["step"], p["phase"]) for p in body["phases"]]
    assert (1, "generation") in phases and (2, "generation") in phases
    assert "generation_kv_cache" not in body["components"]  # the step's backward peaks
    assert "GRPOTrainer" in str(body["assumptions"])


def test_other_objectives_answer_no_generation(client: TestClient) -> None:
    job = {**GRPO_JOB, "objective": "kto"}
    del job["grpo"]
    body = client.post("/v1/estimates", json=job).json()
    assert body["generation"] is None
    assert "generation_kv_cache" not in body["components"]


@pytest.mark.parametrize(
    ("change", "loc", "words"),
    [
        ({"grpo": {"use_vllm": True}}, ["body", "grpo", "use_vllm"], "vLLM"),
        ({"grpo": {"beta": 0.04}}, ["body", "grpo", "beta"], "reference model"),
        ({"grpo": {"num_iterations": 2}}, ["body", "grpo", "num_iterations"], "old_per_token"),
        ({"batch_size": 4}, ["body", "grpo", "num_generations"], "divisible"),
        ({"seq_len": 512}, ["body", "seq_len"], "max_completion_length"),
        ({"parallel": {"gpus": 2}}, ["body", "parallel", "gpus"], "one GPU"),
        ({"framework": "litgpt"}, ["body", "framework"], "GRPOTrainer"),
        ({"grpo": {"num_generations": 0}}, ["body", "grpo", "num_generations"], ""),
    ],
)
def test_what_is_not_modelled_is_a_422_naming_the_field(
    client: TestClient, change: dict[str, Any], loc: list[str], words: str
) -> None:
    response = client.post("/v1/estimates", json={**GRPO_JOB, **change})
    assert loc in _error_fields(response)
    assert words in response.text


def test_the_fit_check_offers_grpos_changes(client: TestClient) -> None:
    job = {**GRPO_JOB, "batch_size": 16, "grpo": {"num_generations": 16}}
    response = client.post("/v1/fit-checks", json={"job": job, "gpus": ["L4"]})
    assert response.status_code == 200, response.text
    text = response.text
    assert "fewer_generations" in text or "shorter_completions" in text
