"""The library stack a job names: presets, versions, the answer's note, and what is refused."""

from __future__ import annotations

import typing
from dataclasses import replace
from typing import Any

import pytest
from fastapi.testclient import TestClient

from service.api.problems import PROBLEM_MEDIA_TYPE
from service.api.schemas.jobs import StackPreset
from service.catalog.models import default_catalog
from service.core.errors import InvalidSpecError
from service.core.estimator import estimate
from service.core.result import Component
from service.core.spec import ALL_LINEAR, LoraSpec, Method, TrainingSpec
from service.core.stack import PINNED_STACK, STACK_PRESETS, Stack, preset
from tests.api.conftest import SMALL_JOB

MOE = "Qwen/Qwen1.5-MoE-A2.7B"


def _problem(response: Any) -> dict[str, Any]:
    assert response.status_code == 422, response.text
    assert response.headers["content-type"] == PROBLEM_MEDIA_TYPE
    assert "Traceback" not in response.text
    body: dict[str, Any] = response.json()
    return body


def _note(body: dict[str, Any]) -> str:
    notes = [a for a in body["assumptions"] if a.startswith("stack: ")]
    assert len(notes) == 1
    return notes[0]


def test_the_api_offers_every_preset_and_the_default_is_the_traced_stack() -> None:
    assert set(typing.get_args(StackPreset)) == set(STACK_PRESETS)
    assert preset("hf-5.24") == PINNED_STACK == Stack()
    assert TrainingSpec(batch_size=1, seq_len=8).stack == PINNED_STACK


def test_the_answer_names_the_stack_it_modelled(client: TestClient) -> None:
    default = client.post("/v1/estimates", json=SMALL_JOB).json()
    assert _note(default) == (
        "stack: transformers 5.24.0, PEFT 0.21.2, bitsandbytes 0.50.2, torch 2.13.0 "
        "(the traced one)"
    )
    older = client.post("/v1/estimates", json={**SMALL_JOB, "stack": "hf-4.48"}).json()
    note = _note(older)
    assert note.startswith("stack: transformers 4.48.0, PEFT 0.14.0")
    assert "modelled as the traced stack" in note
    # A dense model's layout is the same on both: the same bytes.
    assert older["peak"] == default["peak"]
    versions = {"transformers": "4.46.3", "torch": "2.4.1"}
    given = client.post("/v1/estimates", json={**SMALL_JOB, "stack": versions}).json()
    assert _note(given).startswith(
        "stack: transformers 4.46.3, PEFT 0.21.2, bitsandbytes 0.50.2, torch 2.4.1 requested"
    )


@pytest.mark.parametrize(
    ("stack", "loc"),
    [
        ("hf-9.0", ["body", "stack"]),
        ({"transformers": "five"}, ["body", "stack", "transformers"]),
        ({"jax": "0.4"}, ["body", "stack", "jax"]),
    ],
)
def test_a_stack_that_is_not_one_is_422_naming_the_field(
    client: TestClient, stack: Any, loc: list[str]
) -> None:
    body = _problem(client.post("/v1/estimates", json={**SMALL_JOB, "stack": stack}))
    assert [e["loc"] for e in body["errors"]] == [loc]
    if stack == "hf-9.0":
        assert body["errors"][0]["detail"] == (
            "'hf-9.0' is not a stack preset (known: hf-5.24, hf-4.48, hf-4.16)"
        )


def test_a_moe_on_transformers_4_quantizes_and_adapts_every_expert(client: TestClient) -> None:
    """transformers 4 builds each expert's linears as nn.Linear: QLoRA quantizes them (the 3-D
    experts of transformers 5 stay in fp32), and all-linear puts a LoRA on each."""
    arch = default_catalog().resolve(MOE).arch
    lora = LoraSpec(r=16, lora_alpha=32, target_modules=ALL_LINEAR)
    spec = TrainingSpec(method=Method.QLORA, batch_size=1, seq_len=512, lora=lora)
    v5 = estimate(arch, spec)
    v4 = estimate(arch, replace(spec, stack=preset("hf-4.48")))
    assert any("stay unquantized in fp32" in w for w in v5.warnings)
    assert not any("unquantized" in w for w in v4.warnings)
    assert v4.components[Component.FROZEN_WEIGHTS] < v5.components[Component.FROZEN_WEIGHTS] / 2
    # one adapter per expert's linear (60 experts x 3) and the router, over 24 layers
    r, h, ie, e = 16, arch.hidden_size, arch.expert_intermediate_size, arch.num_experts
    experts = e * r * (3 * h + 3 * ie) + r * (h + e)
    assert v4.params.trainable - v5.params.trainable >= 24 * experts
    assert any("expert by expert" in a for a in v4.assumptions)
    lora_job = {"r": 16, "lora_alpha": 32, "target_modules": "all-linear"}
    job = {**SMALL_JOB, "model": MOE, "stack": "hf-4.48", "method": "qlora", "lora": lora_job}
    body = client.post("/v1/estimates", json=job).json()
    assert _note(body).startswith("stack: transformers 4.48.0, PEFT 0.14.0")
    assert any("nn.Linear modules" in a for a in body["assumptions"])


def test_a_moe_newer_than_the_stacks_transformers_is_422_naming_the_stack(
    client: TestClient,
) -> None:
    lora = {"r": 16, "lora_alpha": 32, "target_modules": "all-linear"}
    job = {**SMALL_JOB, "model": "Qwen/Qwen3-30B-A3B", "method": "lora", "lora": lora}
    job["stack"] = "hf-4.48"
    body = _problem(client.post("/v1/estimates", json=job))
    assert body["errors"][0]["loc"] == ["body", "stack"]
    assert "cannot run 'qwen3_moe': it was added in 4.51.0" in body["errors"][0]["detail"]
    # transformers 4.51 has it: modelled
    newer = {**job, "stack": {"transformers": "4.51.3", "torch": "2.6.0"}}
    assert client.post("/v1/estimates", json=newer).status_code == 200


def test_what_the_looped_layout_is_not_modelled_for_is_refused() -> None:
    arch = default_catalog().resolve(MOE).arch
    v4 = preset("hf-4.48")
    full = TrainingSpec(method=Method.FULL, batch_size=1, seq_len=512, stack=v4)
    with pytest.raises(InvalidSpecError, match="LoRA and QLoRA") as caught:
        estimate(arch, full)
    assert caught.value.field == "stack"


def test_the_core_checks_versions_itself() -> None:
    with pytest.raises(InvalidSpecError) as caught:
        Stack(torch="latest")
    assert caught.value.field == "stack.torch"


def test_torch_before_2_is_modelled_for_an_encoder_and_refused_for_a_decoder(
    client: TestClient,
) -> None:
    body = _problem(client.post("/v1/estimates", json={**SMALL_JOB, "stack": "hf-4.16"}))
    (error,) = body["errors"]
    assert error["loc"] == ["body", "stack"]
    assert "zero_grad()" in error["detail"]
    bert = {"model": "google-bert/bert-base-uncased", "batch_size": 1, "seq_len": 128}
    pinned = client.post("/v1/estimates", json=bert).json()
    old = client.post("/v1/estimates", json={**bert, "stack": "hf-4.16"}).json()
    assert _note(old).startswith("stack: transformers 4.16.0, PEFT 0.1.0")
    assert old["peak"]["device_bytes"] > pinned["peak"]["device_bytes"]
