"""GET /v1/models, /v1/models/{id}, /v1/gpus."""

from __future__ import annotations

from fastapi.testclient import TestClient

from service.api.problems import PROBLEM_MEDIA_TYPE, ProblemType
from service.catalog.gpus import default_gpu_catalog
from service.catalog.models import default_catalog
from service.core.fit import DRIVER_RESERVED_BYTES


def test_models_lists_the_catalog(client: TestClient) -> None:
    body = client.get("/v1/models").json()
    ids = [m["id"] for m in body["models"]]
    assert ids == [e.id for e in default_catalog().entries()]
    assert all(m["total_params"] > 0 and m["model_type"] for m in body["models"])


def test_model_by_id_with_its_architecture_and_counts(client: TestClient) -> None:
    response = client.get("/v1/models/Qwen/Qwen2.5-7B-Instruct")
    assert response.status_code == 200
    body = response.json()
    assert body["id"] == "Qwen/Qwen2.5-7B"
    arch = body["architecture"]
    assert (arch["hidden_size"], arch["num_hidden_layers"], arch["num_key_value_heads"]) == (
        3584,
        28,
        4,
    )
    assert "q_proj" in arch["linear_modules"]
    params = body["params"]
    assert params["total"] == default_catalog().resolve("Qwen/Qwen2.5-7B").arch.total_params
    assert abs(params["total"] - params["published"]) / params["published"] < 0.02


def test_unknown_model_is_404_with_the_closest_ids(client: TestClient) -> None:
    response = client.get("/v1/models/meta-llama/Llama-3.1-8b-instrukt")
    assert response.status_code == 404
    assert response.headers["content-type"] == PROBLEM_MEDIA_TYPE
    body = response.json()
    assert body["type"] == ProblemType.UNKNOWN_MODEL
    assert "meta-llama/Llama-3.1-8B" in body["suggestions"]
    assert body["instance"] == "/v1/models/meta-llama/Llama-3.1-8b-instrukt"


def test_gpus_list_driver_names_and_reported_memory(client: TestClient) -> None:
    body = client.get("/v1/gpus").json()
    catalog = default_gpu_catalog().gpus()
    assert len(body["gpus"]) == len(catalog)
    a100 = next(g for g in body["gpus"] if g["name"] == "A100-80GB")
    assert a100["driver_name"] == "NVIDIA A100-SXM4-80GB"
    assert a100["memory_mib"] == 81920 and a100["memory_bytes"] == 81920 * 1024**2
    assert a100["usable_bytes"] == a100["memory_bytes"] - DRIVER_RESERVED_BYTES
    assert a100["bf16"] is True and a100["fp8"] is False
