"""POST /v1/estimates: the breakdown, the defaults, and every way a job can be wrong."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from fastapi.testclient import TestClient

from service.api import batch_body
from service.api.problems import PROBLEM_MEDIA_TYPE, ProblemType
from service.api.routes import estimates
from service.api.schemas import JobSpec
from service.calibration.factors import table_identity
from service.catalog.models import default_catalog
from service.core.calibration import EMPTY_TABLE
from service.core.errors import InvalidSpecError
from service.core.estimator import estimate, forget_compiled_steps
from service.core.reserved import clear_replay_caches
from service.core.result import Component
from service.core.spec import LoraSpec, TrainingSpec
from tests.api.conftest import FULL_JOB, SMALL_JOB, answered_as_the_core


def _problem(response: Any, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == PROBLEM_MEDIA_TYPE
    body: dict[str, Any] = response.json()
    assert body["status"] == status
    assert "Traceback" not in response.text
    return body


def test_minimal_job_gets_the_full_breakdown(client: TestClient) -> None:
    response = client.post(
        "/v1/estimates", json={"model": "Qwen/Qwen2.5-7B", "batch_size": 4, "seq_len": 2048}
    )
    assert response.status_code == 200
    body = response.json()
    peak = body["peak"]
    assert (
        0
        < peak["allocated_bytes"]
        <= peak["reserved_bytes"]
        <= peak["device_bytes"]
        <= peak["device_bytes_upper"]
    )
    assert sum(body["components"].values()) == body["estimated"]["allocated_bytes"]
    # the reference model's and the generation's KV cache only where there are (DPO, GRPO)
    own = {"reference_model", "generation_kv_cache"}
    assert set(body["components"]) == {c.value for c in Component} - own
    assert peak["step"] in (1, 2) and peak["phase"] and peak["phase_words"]
    assert body["calibration"] == {
        "applied": False,
        "scope": "none",
        "factor": None,
        "upper_multiplier": None,
        "nodes": 0,
        "samples": 0,
        "levels": [],
        "state": "fresh",
        "table_id": table_identity(EMPTY_TABLE),  # the store has no factors
    }
    assert body["assumptions"] and body["estimator_version"]
    assert body["gpu"] is None


def test_answer_matches_the_core(client: TestClient) -> None:
    arch = default_catalog().resolve("Qwen/Qwen2.5-0.5B").arch
    expected = estimate(arch, TrainingSpec(batch_size=2, seq_len=512))
    body = client.post("/v1/estimates", json=SMALL_JOB).json()
    assert body["model"] == "Qwen/Qwen2.5-0.5B"
    assert body["peak"]["device_bytes_upper"] == expected.device_bytes_upper
    assert body["params"] == {
        "total": expected.params.total,
        "trainable": expected.params.trainable,
    }


def test_defaults_are_the_cores() -> None:
    job = JobSpec.model_validate(SMALL_JOB)
    assert job.to_spec() == TrainingSpec(batch_size=2, seq_len=512)


def test_the_issues_full_example(client: TestClient) -> None:
    response = client.post("/v1/estimates", json=FULL_JOB)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["gpu"]["name"] == "A100-80GB"
    assert body["gpu"]["fits"] is True
    assert body["gpu"]["headroom_bytes"] == (
        body["gpu"]["usable_bytes"] - body["peak"]["device_bytes_upper"]
    )


def test_gpu_by_reported_memory(client: TestClient) -> None:
    body = client.post("/v1/estimates", json={**SMALL_JOB, "gpu": {"memory_mib": 81559}}).json()
    assert body["gpu"]["memory_bytes"] == 81559 * 1024**2
    unlisted = client.post("/v1/estimates", json={**SMALL_JOB, "gpu": {"memory_mib": 30000}})
    assert unlisted.json()["gpu"]["name"] is None


def test_gpu_without_bf16_warns(client: TestClient) -> None:
    body = client.post("/v1/estimates", json={**SMALL_JOB, "gpu": "Tesla T4"}).json()
    assert any("bf16" in w for w in body["warnings"])


def test_model_as_a_published_config(client: TestClient) -> None:
    config = dict(default_catalog().resolve("Qwen/Qwen2.5-0.5B").config)
    by_config = client.post("/v1/estimates", json={**SMALL_JOB, "model": {"hf_config": config}})
    by_id = client.post("/v1/estimates", json=SMALL_JOB)
    assert by_config.status_code == 200
    assert by_config.json()["model"] == "hf_config"
    assert by_config.json()["peak"] == by_id.json()["peak"]


def test_unknown_model_is_404_with_the_closest_ids(client: TestClient) -> None:
    response = client.post("/v1/estimates", json={**SMALL_JOB, "model": "Qwen/Qwen2.5-7B-Instrct"})
    body = _problem(response, 404)
    assert body["type"] == ProblemType.UNKNOWN_MODEL
    assert body["model"] == "Qwen/Qwen2.5-7B-Instrct"
    assert "Qwen/Qwen2.5-7B" in body["suggestions"]


def test_unknown_gpu_is_404_with_the_closest_names(client: TestClient) -> None:
    body = _problem(client.post("/v1/estimates", json={**SMALL_JOB, "gpu": "A100-81GB"}), 404)
    assert body["type"] == ProblemType.UNKNOWN_GPU
    assert "A100-80GB" in body["suggestions"]


def test_out_of_bounds_field_is_422_with_its_path(client: TestClient) -> None:
    response = client.post("/v1/estimates", json={**SMALL_JOB, "lora": {"r": 0}})
    body = _problem(response, 422)
    assert body["type"] == ProblemType.INVALID_REQUEST
    assert [e["loc"] for e in body["errors"]] == [["body", "lora", "r"]]
    assert body["errors"][0]["pointer"] == "/lora/r"


def test_missing_and_unknown_fields_are_422(client: TestClient) -> None:
    body = _problem(client.post("/v1/estimates", json={"model": "x", "bogus": 1}), 422)
    locs = {tuple(e["loc"]) for e in body["errors"]}
    assert {("body", "batch_size"), ("body", "seq_len"), ("body", "bogus")} <= locs


def test_invalid_combination_is_located_by_the_core(client: TestClient) -> None:
    response = client.post("/v1/estimates", json={**SMALL_JOB, "method": "full", "lora": {"r": 8}})
    body = _problem(response, 422)
    assert body["errors"][0]["loc"] == ["body", "lora"]
    assert body["errors"][0]["type"] == "invalid_spec"


def test_target_module_the_model_lacks_is_422(client: TestClient) -> None:
    job = {**SMALL_JOB, "lora": {"target_modules": ["query_key_value"]}}
    body = _problem(client.post("/v1/estimates", json=job), 422)
    assert body["errors"][0]["loc"] == ["body", "lora", "target_modules"]


def test_a_module_to_save_that_is_not_counted_is_422(client: TestClient) -> None:
    job = {**SMALL_JOB, "lora": {"modules_to_save": ["lm_head", "foo"]}}
    body = _problem(client.post("/v1/estimates", json=job), 422)
    assert [e["loc"] for e in body["errors"]] == [["body", "lora", "modules_to_save", 1]]
    assert body["errors"][0]["detail"] == "Input should be 'embed_tokens' or 'lm_head'"


def test_the_core_refuses_a_module_to_save_it_would_not_count() -> None:
    with pytest.raises(InvalidSpecError) as caught:
        LoraSpec(modules_to_save=("embed_tokens", "foo"))
    assert caught.value.field == "lora.modules_to_save"
    assert "'foo'" in caught.value.reason


def test_invalid_config_is_422_inside_hf_config(client: TestClient) -> None:
    job = {**SMALL_JOB, "model": {"hf_config": {"model_type": "llama", "hidden_size": 64}}}
    body = _problem(client.post("/v1/estimates", json=job), 422)
    assert body["errors"][0]["loc"][:3] == ["body", "model", "hf_config"]


def test_absurd_config_is_refused_before_estimating(client: TestClient) -> None:
    config = dict(default_catalog().resolve("Qwen/Qwen2.5-0.5B").config)
    config["num_hidden_layers"] = 10**9
    job = {**SMALL_JOB, "model": {"hf_config": config}}
    body = _problem(client.post("/v1/estimates", json=job), 422)
    assert body["errors"][0]["loc"] == ["body", "model", "hf_config", "num_hidden_layers"]


def test_model_needs_an_id_or_a_config(client: TestClient) -> None:
    for model in ({}, {"id": "Qwen/Qwen2.5-0.5B", "hf_config": {}}, 7):
        body = _problem(client.post("/v1/estimates", json={**SMALL_JOB, "model": model}), 422)
        assert body["errors"][0]["loc"][:2] == ["body", "model"]


def test_malformed_json_is_422(client: TestClient) -> None:
    response = client.post(
        "/v1/estimates", content=b'{"model": ', headers={"content-type": "application/json"}
    )
    body = _problem(response, 422)
    assert body["errors"][0]["type"] == "json_invalid"


def test_body_that_is_not_an_object_is_422(client: TestClient) -> None:
    for payload in ([1, 2], "text", None, 3.5):
        _problem(client.post("/v1/estimates", json=payload), 422)


def test_other_methods_and_mounted_paths_are_answered_as_the_router_does(
    client: TestClient,
) -> None:
    """POST /v1/estimates skips the router; any other request on its path is routed."""
    for method in ("GET", "PUT", "DELETE"):
        response = client.request(method, "/v1/estimates")
        assert response.status_code == 405
        assert response.headers["allow"] == "POST"
        assert response.headers["content-type"] == "application/problem+json"
    answer = client.post("/v1/estimates", json=SMALL_JOB).json()
    # Served under a root path, the estimate is found at the same route.
    with TestClient(client.app, root_path="/api") as mounted:
        assert mounted.post("/api/v1/estimates", json=SMALL_JOB).json() == answer


def test_an_encoder_job_takes_num_labels(client: TestClient) -> None:
    job = {"model": "bert-base-uncased", "method": "full", "batch_size": 4, "seq_len": 512}
    two = client.post("/v1/estimates", json=job)
    many = client.post("/v1/estimates", json={**job, "num_labels": 100})
    assert two.status_code == many.status_code == 200, many.text
    assert many.json()["params"]["total"] > two.json()["params"]["total"]


def test_an_encoder_decoder_job_takes_target_length(client: TestClient) -> None:
    job = {
        "model": "bigscience/T0_3B",
        "method": "lora",
        "batch_size": 8,
        "seq_len": 128,
        "dtype": "fp32",
        "optim": "adamw_torch",
        "attn_implementation": "eager",
    }
    short = client.post("/v1/estimates", json={**job, "target_length": 4})
    same = client.post("/v1/estimates", json=job)
    assert short.status_code == same.status_code == 200, short.text
    assert short.json()["peak"]["allocated_bytes"] < same.json()["peak"]["allocated_bytes"]


def test_an_encoder_decoder_lora_job_under_deepspeed_zero3_offload(client: TestClient) -> None:
    # PEFT's example: accelerate's DeepSpeed plugin, stage 3, both offloads, no bucket keys
    job = {
        "model": "bigscience/T0_3B",
        "method": "lora",
        "batch_size": 8,
        "seq_len": 128,
        "target_length": 4,
        "dtype": "fp32",
        "optim": "adamw_torch",
        "attn_implementation": "eager",
    }
    config = {
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"device": "cpu"},
            "offload_param": {"device": "cpu"},
        }
    }
    alone = client.post("/v1/estimates", json=job)
    zero = client.post("/v1/estimates", json={**job, "parallel": {"deepspeed_config": config}})
    assert alone.status_code == zero.status_code == 200, zero.text
    answer = zero.json()
    assert answer["host_bytes"] > 10 * 2**30  # the fp32 model, pinned on the host
    assert answer["peak"]["allocated_bytes"] < alone.json()["peak"]["allocated_bytes"]
    assert any("reduce bucket of 500,000,000" in note for note in answer["assumptions"])
    fsdp = {**job, "parallel": {"gpus": 2, "strategy": "fsdp"}}
    body = _problem(client.post("/v1/estimates", json=fsdp), 422)
    assert body["errors"][0]["loc"] == ["body", "parallel", "strategy"]


def test_target_length_on_a_decoder_is_422(client: TestClient) -> None:
    body = _problem(client.post("/v1/estimates", json={**SMALL_JOB, "target_length": 3}), 422)
    assert body["errors"][0]["loc"] == ["body", "target_length"]
    assert "encoder-decoder" in body["errors"][0]["detail"]


def test_an_encoder_decoder_with_flash_attention_is_422_naming_the_field(
    client: TestClient,
) -> None:
    job = {"model": "bigscience/T0_3B", "batch_size": 8, "seq_len": 128, "target_length": 4}
    assert client.post("/v1/estimates", json=job).status_code == 200
    flash = {**job, "attn_implementation": "flash_attention_2"}
    body = _problem(client.post("/v1/estimates", json=flash), 422)
    assert body["errors"][0]["loc"] == ["body", "attn_implementation"]


def test_num_labels_on_a_decoder_is_422(client: TestClient) -> None:
    body = _problem(client.post("/v1/estimates", json={**SMALL_JOB, "num_labels": 3}), 422)
    assert body["errors"][0]["loc"] == ["body", "num_labels"]
    assert "encoder" in body["errors"][0]["detail"]


def test_a_target_module_bert_lacks_is_422(client: TestClient) -> None:
    job = {"model": "bert-base-uncased", "batch_size": 4, "seq_len": 512}
    body = _problem(
        client.post("/v1/estimates", json={**job, "lora": {"target_modules": ["q_proj"]}}), 422
    )
    assert body["errors"][0]["loc"] == ["body", "lora", "target_modules"]
    assert "query" in body["errors"][0]["detail"]


def test_torchtune_options_reach_the_estimate_and_hf_is_422(client: TestClient) -> None:
    job = {
        "model": "Qwen/Qwen2.5-0.5B",
        "method": "lora",
        "batch_size": 2,
        "seq_len": 1024,
        "framework": "torchtune",
        "gradient_checkpointing": True,
    }
    kept = client.post("/v1/estimates", json=job)
    offloaded = client.post("/v1/estimates", json={**job, "activation_offloading": True})
    assert kept.status_code == offloaded.status_code == 200, offloaded.text
    assert kept.json()["host_pinned_bytes"] == 0
    assert offloaded.json()["host_pinned_bytes"] > 24 * 4 * 2**20  # a 4 MiB block per layer
    assert offloaded.json()["peak"]["allocated_bytes"] < kept.json()["peak"]["allocated_bytes"]
    hf = {**job, "framework": "hf", "method": "full", "optimizer_in_backward": True}
    body = _problem(client.post("/v1/estimates", json=hf), 422)
    assert body["errors"][0]["loc"] == ["body", "optimizer_in_backward"]
    assert "HF Trainer has no such option" in body["errors"][0]["detail"]


VISION_JOB = {
    "model": "Qwen/Qwen2-VL-2B-Instruct",
    "batch_size": 2,
    "seq_len": 1024,
    "gradient_checkpointing": True,
    "lora": {"r": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]},
    "vision": {"images_per_sample": 1, "image_height": 448, "image_width": 448},
}


def test_a_vision_language_job_with_its_images(client: TestClient) -> None:
    body = client.post("/v1/estimates", json=VISION_JOB).json()
    spec = JobSpec.model_validate(VISION_JOB).to_spec()
    arch = default_catalog().resolve("Qwen/Qwen2-VL-2B-Instruct").arch
    expected = estimate(arch, spec)
    assert body["peak"]["device_bytes_upper"] == expected.device_bytes_upper
    assert body["params"]["total"] == arch.total_params
    by_tokens = {**VISION_JOB, "vision": {"images_per_sample": 1, "image_tokens": 256}}
    assert client.post("/v1/estimates", json=by_tokens).json()["peak"] == body["peak"]


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"vision": None}, "vision"),
        ({"seq_len": 200}, "seq_len"),
        ({"vision": {"image_height": 448}}, "vision.image_width"),
        (
            {"vision": {"image_tokens": 64, "image_height": 28, "image_width": 28}},
            "vision.image_tokens",
        ),
        ({"lora": {"target_modules": "all-linear"}}, "lora.target_modules"),
        ({"method": "full", "lora": None}, "method"),
    ],
)
def test_a_vision_language_job_that_is_not_modelled_is_a_422(
    client: TestClient, change: dict[str, Any], field: str
) -> None:
    body = _problem(client.post("/v1/estimates", json={**VISION_JOB, **change}), 422)
    assert field in str(body)


MLLAMA_JOB = {
    "model": "meta-llama/Llama-3.2-11B-Vision-Instruct",
    "batch_size": 1,
    "seq_len": 1024,
    "gradient_checkpointing": True,
    "lora": {"r": 16, "target_modules": ["gate_proj", "up_proj", "down_proj"]},
    "vision": {"images_per_sample": 1, "image_height": 1120, "image_width": 1120},
}


def test_a_llama_vision_job_with_its_images(client: TestClient) -> None:
    body = client.post("/v1/estimates", json=MLLAMA_JOB).json()
    spec = JobSpec.model_validate(MLLAMA_JOB).to_spec()
    arch = default_catalog().resolve("meta-llama/Llama-3.2-11B-Vision").arch
    assert body["peak"]["device_bytes_upper"] == estimate(arch, spec).device_bytes_upper
    assert body["params"]["total"] == arch.total_params == 10_670_220_835
    assert any("2 x 2 tiles" in note for note in body["assumptions"])


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"vision": None}, "vision"),
        ({"vision": {"image_tokens": 64}}, "vision.image_tokens"),
        ({"vision": {"image_height": 560, "image_width": 560, "min_pixels": 3136}}, "min_pixels"),
        ({"lora": {"target_modules": ["q_proj", "v_proj"]}}, "lora.target_modules"),
        ({"method": "qlora"}, "method"),
        ({"attn_implementation": "flash_attention_2"}, "attn_implementation"),
    ],
)
def test_a_llama_vision_job_that_is_not_modelled_is_a_422(
    client: TestClient, change: dict[str, Any], field: str
) -> None:
    body = _problem(client.post("/v1/estimates", json={**MLLAMA_JOB, **change}), 422)
    assert field in str(body)


def test_a_cold_estimate_is_made_in_the_thread_pool_a_warm_one_on_the_event_loop(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An estimate that would run the step or replay the allocator is made in the thread
    pool, the event loop free meanwhile; a warm one (the job compiled, its shape's replays
    remembered) on the event loop. The answers are the core's either way."""
    clear_replay_caches()
    forget_compiled_steps()
    monkeypatch.setattr(batch_body, "_known", {})  # (jobs read before keep their pieces)
    pooled: list[object] = []
    pool = estimates.run_in_threadpool

    async def counted(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        pooled.append(fn)
        return await pool(fn, *args, **kwargs)

    monkeypatch.setattr(estimates, "run_in_threadpool", counted)
    made = []
    answers = []
    # the first shape runs the step and replays; the second runs it again (and so records
    # the job's piece); the third lies between the shapes the first replayed
    jobs = [{**SMALL_JOB, "batch_size": 2, "seq_len": seq_len} for seq_len in (600, 700, 800)]
    for job in jobs:
        response = client.post("/v1/estimates", json=job)
        assert response.status_code == 200, response.text
        answers.append(response.json())
        made.append(len(pooled))
    assert made == [1, 2, 2]
    for job, answer in zip(jobs, answers, strict=True):
        assert answer == answered_as_the_core(client, job)
