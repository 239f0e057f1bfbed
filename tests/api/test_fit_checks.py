"""POST /v1/fit-checks: GPUs by name, driver name or memory; solved limits; suggestions; cost."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
from fastapi.testclient import TestClient

from service.api.problems import ProblemType
from service.api.routes import fit_checks
from service.catalog.gpus import default_gpu_catalog
from service.catalog.models import default_catalog
from service.core.estimator import estimate, forget_compiled_steps
from service.core.fit import usable_bytes
from service.core.reserved import clear_replay_caches
from service.core.spec import LoraSpec, TrainingSpec
from tests.api.conftest import SMALL_JOB

BIG_JOB: dict[str, Any] = {
    "model": "Qwen/Qwen2.5-7B",
    "batch_size": 4,
    "seq_len": 2048,
    "lora": {"r": 16, "target_modules": "all-linear"},
}


def _check(client: TestClient, job: dict[str, Any], gpus: list[Any]) -> dict[str, Any]:
    response = client.post("/v1/fit-checks", json={"job": job, "gpus": gpus})
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def test_gpus_by_catalog_name_driver_name_and_reported_memory(client: TestClient) -> None:
    body = _check(
        client,
        SMALL_JOB,
        [
            "A100-80GB",
            {"name": "NVIDIA A100-SXM4-80GB"},
            {"memory_mib": 81920},
            {"memory_mib": 30000},
        ],
    )
    gpus = [r["gpu"] for r in body["results"]]
    assert [g["name"] for g in gpus] == ["A100-80GB", "A100-80GB", "A100-80GB", None]
    assert [g["matched_by"] for g in gpus] == ["name", "name", "memory_mib", "memory_mib"]
    assert gpus[3]["memory_bytes"] == 30000 * 1024**2
    assert all(r["fits"] for r in body["results"])


def test_every_catalog_gpu_answers_exactly(client: TestClient) -> None:
    gpus = [gpu.name for gpu in default_gpu_catalog().gpus()]
    body = _check(client, BIG_JOB, gpus)
    arch = default_catalog().resolve("Qwen/Qwen2.5-7B").arch
    spec = TrainingSpec(
        batch_size=4, seq_len=2048, lora=LoraSpec(r=16, target_modules="all-linear")
    )
    assert body["job"]["peak"]["device_bytes_upper"] == estimate(arch, spec).device_bytes_upper
    for result in body["results"]:
        usable = result["usable_bytes"]
        assert usable == usable_bytes(result["gpu"]["memory_bytes"])
        assert result["fits"] == (result["required_bytes"] <= usable)
        assert result["headroom_bytes"] == usable - result["required_bytes"]
        assert result["utilisation"] == result["required_bytes"] / usable
        b, s = result["max_batch_size"], result["max_seq_len"]
        assert estimate(arch, replace(spec, batch_size=b + 1)).device_bytes_upper > usable
        if b:
            assert estimate(arch, replace(spec, batch_size=b)).device_bytes_upper <= usable
        if s:
            assert estimate(arch, replace(spec, seq_len=s)).device_bytes_upper <= usable
        if s < arch.max_position_embeddings:
            assert estimate(arch, replace(spec, seq_len=s + 1)).device_bytes_upper > usable
        # One GPU each: every result needs what the job as given needs.
        assert result["required_bytes"] == body["job"]["peak"]["device_bytes_upper"]
        assert result["required_bytes_median"] == body["job"]["peak"]["device_bytes"]
        if not result["fits"]:
            assert result["suggestions"], result["gpu"]["name"]
        else:
            assert result["suggestions"] == []


def test_suggestions_say_what_to_set(client: TestClient) -> None:
    body = _check(client, BIG_JOB, ["A100-80GB"])
    result = body["results"][0]
    assert not result["fits"]
    by_change = {tuple(s["changes"]): s for s in result["suggestions"]}
    checkpointing = by_change[("gradient_checkpointing",)]
    assert checkpointing["set"] == {"gradient_checkpointing": True}
    assert checkpointing["fits"] and checkpointing["required_bytes"] < result["required_bytes"]
    smaller = by_change[("smaller_micro_batch",)]
    assert smaller["set"]["batch_size"] * smaller["set"]["gradient_accumulation_steps"] == 4
    fewer = by_change[("fewer_target_modules",)]
    assert fewer["set"] == {"lora": {"target_modules": ["q_proj", "v_proj"]}}
    assert result["suggestions"][0]["fits"]
    # The changed job, sent back, needs what the suggestion said.
    again = client.post("/v1/estimates", json={**BIG_JOB, **checkpointing["set"]}).json()
    assert again["peak"]["device_bytes_upper"] == checkpointing["required_bytes"]


def test_cheapest_gpu_that_fits(client: TestClient) -> None:
    gpus = [
        {"name": "H100-SXM", "price_per_hour": 3.0},
        {"name": "L4", "price_per_hour": 0.5},  # too small for this job
        {"name": "A100-80GB", "count": 2, "price_per_hour": 1.0},
        {"name": "H200", "price_per_hour": 2.5},
    ]
    job = {**BIG_JOB, "gradient_checkpointing": True}
    body = _check(client, job, gpus)
    assert [r["fits"] for r in body["results"]] == [True, False, True, True]
    assert body["results"][2]["cost_per_hour"] == 2.0
    assert body["cheapest"] == {"index": 2, "name": "A100-80GB", "cost_per_hour": 2.0}


def test_no_cheapest_without_prices(client: TestClient) -> None:
    assert _check(client, SMALL_JOB, ["A100-80GB"])["cheapest"] is None


def test_count_spans_the_job(client: TestClient) -> None:
    job = {**SMALL_JOB, "method": "full", "parallel": {"strategy": "zero3"}}
    body = _check(client, job, [{"name": "L4", "count": 1}, {"name": "L4", "count": 4}])
    one, four = body["results"]
    assert (one["count"], four["count"]) == (1, 4)
    assert four["required_bytes"] < one["required_bytes"]


def test_unknown_gpu_is_404(client: TestClient) -> None:
    response = client.post("/v1/fit-checks", json={"job": SMALL_JOB, "gpus": ["A100-81GB"]})
    assert response.status_code == 404
    assert response.json()["type"] == ProblemType.UNKNOWN_GPU
    assert "A100-80GB" in response.json()["suggestions"]


def test_unknown_model_is_404(client: TestClient) -> None:
    job = {**SMALL_JOB, "model": "nope/nothing"}
    response = client.post("/v1/fit-checks", json={"job": job, "gpus": ["L4"]})
    assert response.status_code == 404
    assert response.json()["type"] == ProblemType.UNKNOWN_MODEL


def test_invalid_gpu_entries_are_422_with_their_path(client: TestClient) -> None:
    cases: list[tuple[Any, list[Any]]] = [
        ({}, ["body", "gpus", 0]),
        ({"name": "L4", "memory_mib": 23034}, ["body", "gpus", 0]),
        ({"memory_mib": 12}, ["body", "gpus", 0, "memory_mib"]),
        ({"name": "L4", "count": 0}, ["body", "gpus", 0, "count"]),
        ({"name": "L4", "price_per_hour": -1}, ["body", "gpus", 0, "price_per_hour"]),
    ]
    for gpu, loc in cases:
        response = client.post("/v1/fit-checks", json={"job": SMALL_JOB, "gpus": [gpu]})
        assert response.status_code == 422, gpu
        assert response.json()["errors"][0]["loc"] == loc


def test_invalid_job_is_located_under_job(client: TestClient) -> None:
    job = {**SMALL_JOB, "method": "full", "lora": {}}
    response = client.post("/v1/fit-checks", json={"job": job, "gpus": ["L4"]})
    assert response.status_code == 422
    assert response.json()["errors"][0]["loc"] == ["body", "job", "lora"]
    empty = client.post("/v1/fit-checks", json={"job": SMALL_JOB, "gpus": []})
    assert empty.json()["errors"][0]["loc"] == ["body", "gpus"]


# Placement: the fewest GPUs per GPU type and strategy. The estimator's multi-GPU model
# changes, so no count is pinned: each answer is checked against the per-GPU estimates the
# same route gives for the job at that count and at the count below.

LLAMA_70B_FULL: dict[str, Any] = {
    "model": "meta-llama/Llama-3.1-70B",
    "method": "full",
    "batch_size": 1,
    "seq_len": 4096,
    "gradient_checkpointing": True,
}


def _placed(
    client: TestClient, job: dict[str, Any], gpus: list[Any], placement: dict[str, Any]
) -> dict[str, Any]:
    response = client.post(
        "/v1/fit-checks", json={"job": job, "gpus": gpus, "placement": placement}
    )
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()["placement"]
    return answer


def _upper_on(client: TestClient, job: dict[str, Any], strategy: str, gpus: int) -> int:
    """The per-GPU safe bound the estimate route gives for the job on `gpus` GPUs."""
    spec = {**job, "parallel": {"gpus": gpus, "strategy": strategy}}
    response = client.post("/v1/estimates", json=spec)
    assert response.status_code == 200, response.text
    upper: int = response.json()["peak"]["device_bytes_upper"]
    return upper


def test_placement_is_absent_unless_asked(client: TestClient) -> None:
    assert _check(client, SMALL_JOB, ["L4"])["placement"] is None


def test_fewest_gpus_per_type_and_strategy_for_a_70b_job(client: TestClient) -> None:
    gpus = [
        {"name": "H100-SXM", "price_per_hour": 3.0},
        {"name": "H200", "price_per_hour": 4.0},
        {"name": "A100-80GB", "price_per_hour": 1.8},
    ]
    for method in ("full", "lora"):
        job = {**LLAMA_70B_FULL, "method": method}
        answer = _placed(client, job, gpus, {"strategies": ["zero3", "fsdp"]})
        assert answer["strategies"] == ["zero3", "fsdp"]
        assert answer["gpus_per_node"] == 8 and answer["max_gpus"] == 64
        counts = answer["counts"]
        placements = answer["placements"]
        assert [(p["gpu_index"], p["strategy"]) for p in placements] == [
            (i, s) for i in range(3) for s in ("zero3", "fsdp")
        ]
        for p in placements:
            assert p["outcome"] == "fits", p["reason"]
            count, usable = p["count"], p["usable_bytes"]
            assert p["required_bytes"] <= usable
            assert p["headroom_bytes"] == usable - p["required_bytes"]
            assert p["cost_per_hour"] == gpus[p["gpu_index"]]["price_per_hour"] * count
            assert p["nodes"] == -(-count // 8)
            # The per-GPU breakdown is the estimate route's for the job on `count` GPUs.
            per_gpu = p["per_gpu"]
            assert per_gpu["peak"]["device_bytes_upper"] == p["required_bytes"]
            assert sum(per_gpu["components"].values()) == per_gpu["estimated"]["allocated_bytes"]
            assert _upper_on(client, job, p["strategy"], count) == p["required_bytes"]
            position = counts.index(count)
            if position:
                below = counts[position - 1]
                assert p["previous_count"] == below
                assert _upper_on(client, job, p["strategy"], below) > usable
                assert p["previous_required_bytes"] > usable
        costs = [p["cost_per_hour"] for p in placements]
        assert answer["cheapest"]["cost_per_hour"] == min(costs)
        cheapest = placements[answer["cheapest"]["index"]]
        assert cheapest["cost_per_hour"] == min(costs)
        assert answer["cheapest"]["gpu"] == gpus[cheapest["gpu_index"]]["name"]
        fewest = placements[answer["fewest"]["index"]]
        assert fewest["count"] == min(p["count"] for p in placements) == answer["fewest"]["count"]


def test_a_strategy_that_holds_full_parameters_says_more_gpus_do_not_help(
    client: TestClient,
) -> None:
    answer = _placed(client, LLAMA_70B_FULL, ["H100-SXM"], {"strategies": ["ddp", "zero3"]})
    ddp, zero3 = answer["placements"]
    assert ddp["outcome"] == "does_not_fit" and ddp["count"] is None and ddp["per_gpu"] is None
    assert "within 64 GPUs" in ddp["reason"] and "do not lower" in ddp["reason"]
    assert zero3["outcome"] == "fits"
    assert answer["cheapest"] is None  # no prices
    assert answer["fewest"]["index"] == 1


def test_qlora_is_not_possible_under_a_sharding_strategy(client: TestClient) -> None:
    job = {**LLAMA_70B_FULL, "method": "qlora"}
    answer = _placed(client, job, ["H200"], {"strategies": ["zero3", "ddp"], "max_gpus": 16})
    zero3, ddp = answer["placements"]
    assert zero3["outcome"] == "not_possible"
    assert zero3["reason"].startswith("not possible: QLoRA under zero3")
    assert ddp["outcome"] in ("fits", "does_not_fit")
    response = client.post(
        "/v1/fit-checks",
        json={"job": job, "gpus": ["H200"], "placement": {"strategies": ["zero3", "fsdp"]}},
    )
    assert response.status_code == 422
    error = response.json()["errors"][0]
    assert error["loc"] == ["body", "placement", "strategies"]
    assert "none of zero3, fsdp" in error["detail"]


def test_the_job_s_own_strategy_and_node_size_by_default(client: TestClient) -> None:
    job = {**LLAMA_70B_FULL, "parallel": {"gpus": 8, "strategy": "fsdp2", "gpus_per_node": 4}}
    answer = _placed(client, job, ["H100-SXM"], {"max_gpus": 32})
    assert answer["strategies"] == ["fsdp2"] and answer["gpus_per_node"] == 4
    assert answer["counts"] == [1, 2, 3, 4, 8, 12, 16, 20, 24, 28, 32]
    answer = _placed(client, job, ["H100-SXM"], {"max_gpus": 32, "gpus_per_node": 2})
    assert answer["counts"][:4] == [1, 2, 4, 6]


def test_bad_placement_input_is_422_naming_the_field(client: TestClient) -> None:
    cases: list[tuple[Any, list[Any]]] = [
        ({"strategies": ["zero4"]}, ["body", "placement", "strategies", 0]),
        ({"strategies": []}, ["body", "placement", "strategies"]),
        ({"strategies": ["ddp", "ddp"]}, ["body", "placement", "strategies"]),
        ({"max_gpus": 0}, ["body", "placement", "max_gpus"]),
        ({"max_gpus": 4096}, ["body", "placement", "max_gpus"]),
        ({"max_gpus": "8"}, ["body", "placement", "max_gpus"]),
        ({"gpus_per_node": 0}, ["body", "placement", "gpus_per_node"]),
        ({"nodes": 2}, ["body", "placement", "nodes"]),
    ]
    for placement, loc in cases:
        response = client.post(
            "/v1/fit-checks", json={"job": SMALL_JOB, "gpus": ["L4"], "placement": placement}
        )
        assert response.status_code == 422, placement
        assert response.json()["errors"][0]["loc"] == loc, placement


def test_an_encoder_job_fits_on_one_gpu(client: TestClient) -> None:
    job = {"model": "bert-large-uncased", "method": "full", "batch_size": 4, "seq_len": 512}
    response = client.post("/v1/fit-checks", json={"job": {**job, "dtype": "fp32"}, "gpus": ["L4"]})
    assert response.status_code == 200, response.text
    [result] = response.json()["results"]
    assert result["fits"]


def test_a_llama_vision_job_fits_with_its_images(client: TestClient) -> None:
    """Llama-3.2-Vision: the solver's limits and suggestions go through the mllama step
    (images per sample fixed, seq_len counting text only)."""
    job = {
        "model": "meta-llama/Llama-3.2-11B-Vision-Instruct",
        "batch_size": 1,
        "seq_len": 1024,
        "gradient_checkpointing": True,
        "lora": {"r": 16, "target_modules": ["gate_proj", "up_proj", "down_proj"]},
        "vision": {"images_per_sample": 1, "image_height": 1120, "image_width": 1120},
    }
    body = _check(client, job, ["A100-80GB", "L4"])
    fits = {row["gpu"]["name"]: row["fits"] for row in body["results"]}
    assert fits == {"A100-80GB": True, "L4": False}


def test_a_cold_check_runs_in_the_thread_pool_a_warm_one_on_the_event_loop(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A check that would run a step or replay the allocator is asked again in the thread
    pool (the event loop free meanwhile); once its jobs are compiled and their shapes
    replayed, it is answered on the event loop, alike."""
    clear_replay_caches()
    forget_compiled_steps()
    pooled: list[object] = []
    pool = fit_checks.run_in_threadpool

    async def counted(fn: Callable[[], bytes]) -> bytes:
        pooled.append(fn)
        return await pool(fn)

    monkeypatch.setattr(fit_checks, "run_in_threadpool", counted)
    body = {"job": {**BIG_JOB, "method": "qlora"}, "gpus": ["T4", "L4", "A100-80GB"]}
    answers = []
    for _ in range(4):
        response = client.post("/v1/fit-checks", json=body)
        assert response.status_code == 200, response.text
        answers.append((response.content, len(pooled)))
    # the first in the pool; a job's suggestions' changes are compiled at their second shape
    # (RECORD_AFTER_RUNS), so the second may be too; the last two on the event loop
    assert answers[0][1] == 1
    assert answers[-1][1] == answers[-2][1] == answers[-3][1]
    assert len({content for content, _ in answers}) == 1
