"""GPTQ, AWQ, HQQ and torchao float8 bases through the API: answered as the core answers them,
and refused with the field located where a format does not take a value."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.api.conftest import answered_as_the_core

JOB: dict[str, Any] = {
    "model": "Qwen/Qwen2.5-0.5B",
    "method": "qlora",
    "batch_size": 2,
    "seq_len": 512,
    "dtype": "fp16",
    "gradient_checkpointing": True,
    "lora": {"r": 16, "target_modules": "all-linear"},
}


@pytest.mark.parametrize(
    "quantization",
    [
        {"type": "gptq", "bits": 3, "group_size": 64, "desc_act": True},
        {"type": "awq", "group_size": 128, "prepare_kbit": False},
        {"type": "hqq", "bits": 2, "group_size": 64},
        {"type": "torchao-float8"},
    ],
)
def test_each_format_is_answered_with_its_assumption(
    client: TestClient, quantization: dict[str, Any]
) -> None:
    body = answered_as_the_core(client, {**JOB, "quantization": quantization})
    assert any("not traced" in note for note in body["assumptions"])


@pytest.mark.parametrize(
    ("quantization", "loc", "extra"),
    [
        ({"type": "gptq", "bits": 5}, ["body", "quantization", "bits"], {}),
        ({"type": "awq", "group_size": 256}, ["body", "quantization", "group_size"], {}),
        ({"type": "nf4", "bits": 4}, ["body", "quantization", "bits"], {}),
        ({"type": "torchao-int4"}, ["body", "quantization", "type"], {}),
        ({"type": "gptq", "bits": 9}, ["body", "quantization", "bits"], {}),
        ({"type": "awq"}, ["body", "dtype"], {"dtype": "bf16"}),
        ({"type": "gptq"}, ["body", "lora", "use_dora"], {"lora": {"use_dora": True}}),
        ({"type": "hqq"}, ["body", "parallel", "gpus"], {"parallel": {"gpus": 2}}),
    ],
)
def test_what_a_format_does_not_take_is_a_located_422(
    client: TestClient, quantization: dict[str, Any], loc: list[str], extra: dict[str, Any]
) -> None:
    response = client.post("/v1/estimates", json={**JOB, "quantization": quantization, **extra})
    assert response.status_code == 422, response.text
    assert [e["loc"] for e in response.json()["errors"]] == [loc]
