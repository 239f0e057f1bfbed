"""POST /v1/estimates with PEFT's methods beside LoRA: the answer is the core's, and options
that do not fit the method are a 422 naming the field."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from service.catalog.models import default_catalog
from service.core.codec import spec_from_dict, spec_to_dict
from service.core.estimator import estimate
from tests.api.conftest import SMALL_JOB

LORA_FA_JOB: dict[str, Any] = {
    **SMALL_JOB,
    "method": "lora-fa",
    "lora": {"r": 16, "lora_alpha": 32, "target_modules": ["q_proj", "v_proj"]},
}
VERA_JOB: dict[str, Any] = {**SMALL_JOB, "method": "vera", "vera": {"r": 256}}
LOHA_JOB: dict[str, Any] = {
    **SMALL_JOB,
    "method": "loha",
    "loha": {"r": 16, "alpha": 32, "target_modules": ["q_proj", "v_proj"]},
}
LOKR_JOB: dict[str, Any] = {
    **SMALL_JOB,
    "method": "lokr",
    "lokr": {"r": 32, "alpha": 64, "decompose_factor": 4, "target_modules": "all-linear"},
}
ADALORA_JOB: dict[str, Any] = {
    **SMALL_JOB,
    "method": "adalora",
    "adalora": {"init_r": 64, "target_r": 32, "tinit": 200, "tfinal": 500, "total_step": 5000},
}
OFT_JOB: dict[str, Any] = {**SMALL_JOB, "method": "oft", "oft": {"r": 32, "oft_block_size": 0}}
BOFT_JOB: dict[str, Any] = {
    **SMALL_JOB,
    "method": "boft",
    "boft": {"boft_block_size": 8, "boft_n_butterfly_factor": 2},
}
CASES = [LORA_FA_JOB, VERA_JOB, LOHA_JOB, LOKR_JOB, ADALORA_JOB, OFT_JOB, BOFT_JOB]


@pytest.mark.parametrize("job", CASES, ids=lambda job: job["method"])
def test_answer_matches_the_core(client: TestClient, job: dict[str, Any]) -> None:
    from service.api.schemas import JobSpec

    spec = JobSpec.model_validate(job).to_spec()
    assert spec_from_dict(spec_to_dict(spec)) == spec
    expected = estimate(default_catalog().resolve(job["model"]).arch, spec)
    response = client.post("/v1/estimates", json=job)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["peak"]["allocated_bytes"] == expected.allocated_bytes
    assert body["params"]["trainable"] == expected.params.trainable


def test_lora_fa_trains_b_alone(client: TestClient) -> None:
    body = client.post("/v1/estimates", json=LORA_FA_JOB).json()
    # Qwen2.5-0.5B: 24 layers, q_proj 896 -> 896 and v_proj 896 -> 128, rank 16
    assert body["params"]["trainable"] == 24 * 16 * (896 + 128)


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"optim": "adamw_bnb_8bit"}, "optim"),
        ({"quantization": {"type": "nf4"}}, "quantization"),
    ],
)
def test_options_that_do_not_fit_are_422(
    client: TestClient, changes: dict[str, Any], field: str
) -> None:
    response = client.post("/v1/estimates", json={**LORA_FA_JOB, **changes})
    assert response.status_code == 422, response.text
    assert response.json()["errors"][0]["loc"] == ["body", field]


def test_vera_trains_its_vectors(client: TestClient) -> None:
    body = client.post("/v1/estimates", json=VERA_JOB).json()
    # Qwen2.5-0.5B: 24 layers, PEFT's default q_proj (896 out) and v_proj (128 out), r 256
    assert body["params"]["trainable"] == 24 * ((896 + 256) + (128 + 256))


@pytest.mark.parametrize(
    ("job", "field"),
    [
        ({**SMALL_JOB, "method": "lora", "vera": {"r": 8}}, "vera"),
        ({**VERA_JOB, "lora": {"r": 8}}, "lora"),
        ({**VERA_JOB, "quantization": {"type": "nf4"}}, "quantization"),
        ({**LOHA_JOB, "vera": {"r": 8}}, "vera"),
        ({**LOKR_JOB, "loha": {"r": 8}}, "loha"),
        ({**LOKR_JOB, "lokr": {"decompose_factor": 0}}, "lokr.decompose_factor"),
        ({**LOHA_JOB, "loha": {"r": 16, "rank_dropout": 0.1}}, "loha.rank_dropout"),
        ({**ADALORA_JOB, "lora": {"r": 8}}, "lora"),
        ({**ADALORA_JOB, "adalora": {"init_r": 8, "target_r": 16}}, "adalora.target_r"),
        ({**ADALORA_JOB, "adalora": {"lora_dropout": 0.1}}, "adalora.lora_dropout"),
        ({**ADALORA_JOB, "adalora": {"init_r": True}}, "adalora.init_r"),
        ({**OFT_JOB, "oft": {"r": 4, "oft_block_size": 16}}, "oft.r"),
        ({**OFT_JOB, "oft": {"coft": True}}, "oft.coft"),
        ({**OFT_JOB, "adalora": {"init_r": 8}}, "adalora"),
        ({**BOFT_JOB, "boft": {"boft_block_size": 4, "boft_block_num": 8}}, "boft.boft_block_size"),
        ({**BOFT_JOB, "boft": {"boft_dropout": 0.1}}, "boft.boft_dropout"),
        ({**BOFT_JOB, "boft": {"bias": "all"}}, "boft.bias"),
        ({**BOFT_JOB, "boft": {"bias": "some"}}, "boft.bias"),
        ({**BOFT_JOB, "boft": {"boft_block_size": 6}}, "boft.boft_block_size"),
        ({**BOFT_JOB, "boft": {"boft_n_butterfly_factor": 0}}, "boft.boft_n_butterfly_factor"),
        ({**BOFT_JOB, "boft": {"boft_n_butterfly_factor": 9}}, "boft.boft_n_butterfly_factor"),
        ({**BOFT_JOB, "oft": {"r": 8, "oft_block_size": 0}}, "oft"),
    ],
)
def test_options_for_another_method_are_422(
    client: TestClient, job: dict[str, Any], field: str
) -> None:
    response = client.post("/v1/estimates", json=job)
    assert response.status_code == 422, response.text
    assert response.json()["errors"][0]["loc"] == ["body", *field.split(".")]


def test_adalora_trains_its_triplets_and_rank_counts(client: TestClient) -> None:
    body = client.post("/v1/estimates", json=ADALORA_JOB).json()
    # Qwen2.5-0.5B: 24 layers, PEFT's default q_proj (896 -> 896) and v_proj (896 -> 128);
    # per linear lora_A (64 x 896), lora_E (64), lora_B (out x 64) and ranknum (one element)
    per_layer = sum(64 * 896 + 64 + out * 64 + 1 for out in (896, 128))
    assert body["params"]["trainable"] == 24 * per_layer


def test_oft_trains_its_blocks(client: TestClient) -> None:
    body = client.post("/v1/estimates", json=OFT_JOB).json()
    # Qwen2.5-0.5B: 24 layers, PEFT's default q_proj and v_proj (896 inputs each); 32 blocks
    # of 28, each 28 * 27 / 2 trained entries
    assert body["params"]["trainable"] == 24 * 2 * 32 * (28 * 27 // 2)


def test_boft_trains_its_blocks_and_scales(client: TestClient) -> None:
    body = client.post("/v1/estimates", json=BOFT_JOB).json()
    # Qwen2.5-0.5B: 24 layers, PEFT's default q_proj (896 -> 896) and v_proj (896 -> 128);
    # per linear boft_R (2 factors x 112 blocks x 8 x 8) and boft_s (one per output)
    per_layer = sum(2 * 112 * 8 * 8 + out for out in (896, 128))
    assert body["params"]["trainable"] == 24 * per_layer
