"""An isolated app per test, driven over HTTP in-process."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from service.api.app import create_app
from service.api.settings import Settings

# The example job: every field given.
FULL_JOB: dict[str, Any] = {
    "model": "Qwen/Qwen2.5-7B-Instruct",
    "method": "qlora",
    "lora": {
        "r": 16,
        "lora_alpha": 32,
        "lora_dropout": 0.05,
        "target_modules": "all-linear",
        "adapter_dtype": "fp32",
        "modules_to_save": [],
    },
    "quantization": {"type": "nf4", "double_quant": True, "prepare_kbit": True},
    "dtype": "bf16",
    "autocast": True,
    "optim": "paged_adamw_8bit",
    "batch_size": 4,
    "seq_len": 2048,
    "gradient_checkpointing": True,
    "attn_implementation": "sdpa",
    "loss": "hf",
    "framework": "hf",
    "parallel": {"gpus": 1, "strategy": "ddp", "offload": "none"},
    "gpu": "A100-80GB",
}

SMALL_JOB: dict[str, Any] = {"model": "Qwen/Qwen2.5-0.5B", "batch_size": 2, "seq_len": 512}


def make_app(**settings: Any) -> FastAPI:
    return create_app(Settings(database_url="sqlite://", **settings))


@pytest.fixture
def app() -> FastAPI:
    return make_app()


@pytest.fixture
def client(app: FastAPI) -> Iterator[TestClient]:
    with TestClient(app) as test_client:
        yield test_client
