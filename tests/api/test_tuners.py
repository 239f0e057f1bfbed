"""POST /v1/estimates with PEFT's (IA)^3 and LN tuning: their options round-trip to the core's
spec, and options that do not fit the method are 422s naming the field."""

from __future__ import annotations

from typing import Any

from fastapi.testclient import TestClient

from service.api.schemas import JobSpec
from service.catalog.models import default_catalog
from service.core.codec import spec_from_dict, spec_to_dict
from service.core.estimator import estimate
from service.core.spec import Method
from service.core.spec.prompt import IA3Spec, LnTuningSpec
from tests.api.conftest import SMALL_JOB


def _errors(response: Any) -> list[list[Any]]:
    assert response.status_code == 422, response.text
    return [e["loc"] for e in response.json()["errors"]]


def test_ia3_options_reach_the_core_and_the_answer(client: TestClient) -> None:
    job = {
        **SMALL_JOB,
        "method": "ia3",
        "ia3": {"target_modules": ["q_proj", "v_proj", "down_proj"], "feedforward_modules": []},
    }
    spec = JobSpec.model_validate(job).to_spec()
    assert spec.method is Method.IA3
    assert spec.ia3 == IA3Spec(
        target_modules=("q_proj", "v_proj", "down_proj"), feedforward_modules=()
    )
    body = client.post("/v1/estimates", json=job).json()
    expected = estimate(default_catalog().resolve("Qwen/Qwen2.5-0.5B").arch, spec)
    assert body["params"]["trainable"] == expected.params.trainable == 24 * (896 + 128 + 896)
    assert body["peak"]["allocated_bytes"] == expected.allocated_bytes


def test_ln_tuning_defaults_round_trip(client: TestClient) -> None:
    targets = ["post_attention_layernorm", "norm"]
    job = {**SMALL_JOB, "method": "ln-tuning", "ln_tuning": {"target_modules": targets}}
    spec = JobSpec.model_validate(job).to_spec()
    assert spec.ln_tuning == LnTuningSpec(target_modules=tuple(targets))
    assert spec_from_dict(spec_to_dict(spec)) == spec
    response = client.post("/v1/estimates", json={**SMALL_JOB, "method": "ln-tuning"})
    assert response.status_code == 200
    assert response.json()["params"]["trainable"] == 24 * 896


def test_options_of_another_method_are_422(client: TestClient) -> None:
    response = client.post("/v1/estimates", json={**SMALL_JOB, "ia3": {}})
    assert _errors(response) == [["body", "ia3"]]
    response = client.post("/v1/estimates", json={**SMALL_JOB, "method": "ia3", "ln_tuning": {}})
    assert _errors(response) == [["body", "ln_tuning"]]


def test_a_quantized_base_is_422_naming_quantization(client: TestClient) -> None:
    job = {**SMALL_JOB, "method": "ln-tuning", "quantization": {"type": "nf4"}}
    assert _errors(client.post("/v1/estimates", json=job)) == [["body", "quantization"]]


def test_a_target_the_model_lacks_is_422(client: TestClient) -> None:
    job = {**SMALL_JOB, "method": "ia3", "ia3": {"target_modules": ["query_key_value"]}}
    assert _errors(client.post("/v1/estimates", json=job)) == [["body", "ia3", "target_modules"]]


def test_prompt_tuning_needs_its_options_and_counts_its_embedding(client: TestClient) -> None:
    response = client.post("/v1/estimates", json={**SMALL_JOB, "method": "prompt-tuning"})
    assert _errors(response) == [["body", "prompt_tuning"]]
    job = {**SMALL_JOB, "method": "prompt-tuning", "prompt_tuning": {"num_virtual_tokens": 0}}
    assert _errors(client.post("/v1/estimates", json=job)) == [
        ["body", "prompt_tuning", "num_virtual_tokens"]
    ]
    job["prompt_tuning"] = {"num_virtual_tokens": 20}
    body = client.post("/v1/estimates", json=job).json()
    assert body["params"]["trainable"] == 20 * 896


def test_prefix_tuning_needs_its_options_and_counts_its_encoder(client: TestClient) -> None:
    response = client.post("/v1/estimates", json={**SMALL_JOB, "method": "prefix-tuning"})
    assert _errors(response) == [["body", "prefix_tuning"]]
    job: dict[str, Any] = {
        **SMALL_JOB,
        "method": "prefix-tuning",
        "prefix_tuning": {"num_virtual_tokens": 0},
    }
    assert _errors(client.post("/v1/estimates", json=job)) == [
        ["body", "prefix_tuning", "num_virtual_tokens"]
    ]
    job["prefix_tuning"] = {"num_virtual_tokens": 20, "encoder_hidden_size": 64}
    assert _errors(client.post("/v1/estimates", json=job)) == [
        ["body", "prefix_tuning", "encoder_hidden_size"]
    ]
    job["prefix_tuning"] = {"num_virtual_tokens": 20}
    assert _errors(client.post("/v1/estimates", json={**job, "gradient_checkpointing": True})) == [
        ["body", "gradient_checkpointing"]
    ]
    # PrefixEncoder's embedding: 20 x (24 layers x 2 x 128, the key/value width)
    body = client.post("/v1/estimates", json=job).json()
    assert body["params"]["trainable"] == 20 * 24 * 2 * 128
    job["prefix_tuning"] = {"num_virtual_tokens": 20, "prefix_projection": True}
    body = client.post("/v1/estimates", json=job).json()
    width = 24 * 2 * 128
    assert body["params"]["trainable"] == 20 * 128 + 128 * 128 + 128 + 128 * width + width


def test_a_prefix_tuning_fit_check_offers_no_checkpointing(client: TestClient) -> None:
    job = {
        "model": "meta-llama/Llama-3.2-1B",
        "batch_size": 8,
        "seq_len": 2048,
        "method": "prefix-tuning",
        "prefix_tuning": {"num_virtual_tokens": 200},
    }
    response = client.post("/v1/fit-checks", json={"job": job, "gpus": ["L4"]})
    assert response.status_code == 200, response.text
    (result,) = response.json()["results"]
    assert not result["fits"] and result["suggestions"]
    changes = {change for s in result["suggestions"] for change in s["changes"]}
    assert "gradient_checkpointing" not in changes  # PEFT's prefix tuning cannot take it
