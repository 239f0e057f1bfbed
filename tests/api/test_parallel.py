"""Multi-GPU jobs through the estimate route: strategies' settings, DeepSpeed and FSDP configs
taken as users write them, and the combinations refused with the field that makes them so."""

from __future__ import annotations

from typing import Any

from fastapi.testclient import TestClient

from service.core.result import Component

MISTRAL_FULL: dict[str, Any] = {
    "model": "mistralai/Mistral-7B-v0.1",
    "method": "full",
    "batch_size": 1,
    "seq_len": 2048,
    "gradient_checkpointing": True,
}
# A ZeRO-3 config as HF's DeepSpeed examples write it: "auto" where HF fills the value.
ZERO3_CONFIG: dict[str, Any] = {
    "bf16": {"enabled": "auto"},
    "zero_optimization": {
        "stage": 3,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9,
    },
    "train_micro_batch_size_per_gpu": "auto",
}


def _estimate(client: TestClient, job: dict[str, Any]) -> dict[str, Any]:
    response = client.post("/v1/estimates", json=job)
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


def _problem(client: TestClient, job: dict[str, Any]) -> tuple[str, str]:
    response = client.post("/v1/estimates", json=job)
    assert response.status_code == 422, response.text
    (error,) = response.json()["errors"]
    return error["pointer"], error["detail"]


def test_a_deepspeed_config_is_its_fields(client: TestClient) -> None:
    from_config = _estimate(
        client, {**MISTRAL_FULL, "parallel": {"gpus": 4, "deepspeed_config": ZERO3_CONFIG}}
    )
    explicit = _estimate(
        client,
        {**MISTRAL_FULL, "parallel": {"gpus": 4, "strategy": "zero3", "overlap_comm": True}},
    )
    assert from_config["estimated"] == explicit["estimated"]
    assert from_config["components"] == explicit["components"]


def test_zero3_holds_fp32_masters_and_falls_with_the_gpu_count(client: TestClient) -> None:
    """Mistral-7B in bf16 under ZeRO-3: every rank holds its share of the fp32 master weights
    and both Adam moments (12 bytes per parameter over the GPUs), and its share shrinks as
    GPUs are added."""
    per_gpu = {}
    for gpus in (4, 8):
        answer = _estimate(
            client, {**MISTRAL_FULL, "parallel": {"gpus": gpus, "strategy": "zero3"}}
        )
        params = answer["params"]["total"]
        state = answer["components"][Component.OPTIMIZER_STATE.value]
        assert state >= 12 * params // gpus
        per_gpu[gpus] = answer["estimated"]["allocated_bytes"]
    assert per_gpu[8] < per_gpu[4]


def test_request_fields_win_over_the_config(client: TestClient) -> None:
    config = {**ZERO3_CONFIG, "zero_optimization": {**ZERO3_CONFIG["zero_optimization"]}}
    zero2 = _estimate(
        client,
        {**MISTRAL_FULL, "parallel": {"gpus": 4, "deepspeed_config": config, "strategy": "zero2"}},
    )
    assert any("ZeRO-2" in note for note in zero2["assumptions"])


def test_an_fsdp_config_sets_the_strategy_and_checkpointing(client: TestClient) -> None:
    job = {"model": "Qwen/Qwen2.5-0.5B", "method": "full", "batch_size": 2, "seq_len": 1024}
    accelerate_style = _estimate(
        client,
        {
            **job,
            "parallel": {
                "gpus": 8,
                "fsdp_config": {
                    "fsdp_version": 2,
                    "fsdp_reshard_after_forward": False,
                    "fsdp_activation_checkpointing": True,
                },
            },
        },
    )
    explicit = _estimate(
        client,
        {
            **job,
            "gradient_checkpointing": True,
            "parallel": {"gpus": 8, "strategy": "fsdp2", "reshard_after_forward": False},
        },
    )
    assert accelerate_style["estimated"] == explicit["estimated"]
    # Kept gathered from forward to backward: the whole model, not one layer.
    assert accelerate_style["components"][Component.COMMUNICATION.value] >= (
        accelerate_style["params"]["total"] * 2
    )


def test_config_errors_name_the_key(client: TestClient) -> None:
    bad_stage = {"zero_optimization": {"stage": 5}}
    pointer, detail = _problem(
        client, {**MISTRAL_FULL, "parallel": {"gpus": 4, "deepspeed_config": bad_stage}}
    )
    assert pointer == "/parallel/deepspeed_config/zero_optimization/stage"
    assert "0, 1, 2 or 3" in detail
    pointer, detail = _problem(
        client,
        {**MISTRAL_FULL, "parallel": {"gpus": 4, "fsdp_config": {"version": 3}}},
    )
    assert pointer == "/parallel/fsdp_config/version"
    pointer, _ = _problem(
        client,
        {
            **MISTRAL_FULL,
            "parallel": {"gpus": 4, "deepspeed_config": ZERO3_CONFIG, "fsdp_config": {}},
        },
    )
    assert pointer == "/parallel"


def test_qlora_under_a_sharding_strategy_is_refused(client: TestClient) -> None:
    job = {
        "model": "Qwen/Qwen2.5-7B",
        "method": "qlora",
        "batch_size": 1,
        "seq_len": 1024,
    }
    for strategy in ("zero3", "fsdp", "fsdp2"):
        pointer, detail = _problem(client, {**job, "parallel": {"gpus": 4, "strategy": strategy}})
        assert pointer == "/parallel/strategy"
        assert "bnb_4bit_quant_storage" in detail
    # ZeRO-2 keeps whole weights on every rank: QLoRA runs.
    _estimate(client, {**job, "parallel": {"gpus": 4, "strategy": "zero2"}})


def test_offload_a_strategy_cannot_do_is_refused(client: TestClient) -> None:
    pointer, detail = _problem(
        client, {**MISTRAL_FULL, "parallel": {"gpus": 2, "strategy": "ddp", "offload": "optimizer"}}
    )
    assert pointer == "/parallel/offload"
    assert "DDP" in detail
    offloaded = _estimate(
        client,
        {
            **MISTRAL_FULL,
            "parallel": {"gpus": 4, "strategy": "zero3", "offload": "optimizer_and_params"},
        },
    )
    assert offloaded["host_bytes"] > 0
