"""The safe bound under calibration, over HTTP on SQLite and PostgreSQL: four identical uploads
of one Qwen2.5-7B job from four nodes (a key each) keep a margin above the measured peak, leave
another model family's estimate as it was, and the answer says which calibration it applied."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from service.store.keys import KeyScope
from tests.api.conftest import issue_key
from tests.api.test_calibrations import A100_BYTES, A100_DRIVER_NAME, bearer, reloaded_factors

# The issue's job: Qwen2.5-7B, LoRA r16 on every linear layer, checkpointing, 4 x 2048 tokens.
QWEN_JOB: dict[str, Any] = {
    "model": "Qwen/Qwen2.5-7B-Instruct",
    "batch_size": 4,
    "seq_len": 2048,
    "lora": {"r": 16, "lora_alpha": 32, "target_modules": "all-linear"},
    "gradient_checkpointing": True,
}
# The same job on another model family.
LLAMA_JOB: dict[str, Any] = {**QWEN_JOB, "model": "meta-llama/Llama-3.1-8B"}
# What each of the four nodes measured, over the estimate: the same at every node and run.
MEASURED_OVER_ESTIMATED = {"allocated": 1.01, "reserved": 1.03, "device": 1.07}
NODES = 4


def estimate(client: TestClient, job: dict[str, Any]) -> dict[str, Any]:
    response = client.post("/v1/estimates", json=job)
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def upload_identical_runs(client: TestClient, app: FastAPI) -> dict[str, int]:
    """Four uploads, one per node with the node's own key, of the same measured peaks;
    returns what was measured."""
    estimated = estimate(client, QWEN_JOB)["estimated"]
    measured = {
        f"{level}_bytes": round(estimated[f"{level}_bytes"] * ratio)
        for level, ratio in MEASURED_OVER_ESTIMATED.items()
    }
    for node in range(NODES):
        token = issue_key(app, KeyScope.UPLOAD, nodes=[f"node-{node}"])
        body = {
            "job": QWEN_JOB,
            "gpu": {"name": A100_DRIVER_NAME, "memory_total_bytes": A100_BYTES},
            "measured": measured,
            "environment": {"torch": "2.5.1+cu124", "cuda": "12.4", "driver": "550.54.15"},
            "node_id": f"node-{node}",
            "run_id": f"job-4711-node-{node}-rank0",
        }
        response = client.post("/v1/calibrations", json=body, headers=bearer(token))
        assert response.status_code == 201, response.text
    return measured


def test_four_identical_uploads_keep_a_safe_margin_and_stay_with_their_model(
    store_app: FastAPI, store_client: TestClient
) -> None:
    reloaded_factors(store_client, store_app)
    llama_before = estimate(store_client, LLAMA_JOB)
    assert llama_before["calibration"]["applied"] is False
    assert llama_before["assumptions"][-1].startswith("calibration: none applied")

    measured = upload_identical_runs(store_client, store_app)
    factors = reloaded_factors(store_client, store_app)["factors"]
    assert {(f["scope"], f["model"]) for f in factors} == {("model", "Qwen/Qwen2.5-7B")}

    qwen = estimate(store_client, QWEN_JOB)
    peak, calibration = qwen["peak"], qwen["calibration"]
    assert calibration["applied"] is True and calibration["scope"] == "model"
    # Each level is fitted on its own ratios.
    assert {c["level"]: c["factor"] for c in calibration["levels"]} == pytest.approx(
        MEASURED_OVER_ESTIMATED, rel=1e-6
    )
    assert {(c["scope"], c["samples"], c["nodes"]) for c in calibration["levels"]} == {
        ("model", NODES, NODES)
    }
    # Four identical samples are not proof of zero spread.
    assert peak["device_bytes"] >= measured["device_bytes"]
    assert peak["device_bytes_upper"] >= 1.05 * peak["device_bytes"]
    assert peak["device_bytes_upper"] > measured["device_bytes"]
    # The margin the answer states is the calibrated one.
    assert qwen["upper_margin"] == pytest.approx(calibration["upper_multiplier"] - 1)
    assert qwen["upper_margin"] == pytest.approx(
        peak["device_bytes_upper"] / peak["device_bytes"] - 1, abs=1e-6
    )
    # The answer says what it applied, level by level, and nothing says otherwise.
    note = qwen["assumptions"][-1]
    assert note.startswith("calibration applied:")
    for level, ratio in MEASURED_OVER_ESTIMATED.items():
        assert f"{level} x{ratio:.3f} from the model factor ({NODES} runs on {NODES} nodes)" in note
    assert f"safe bound +{qwen['upper_margin']:.1%} over the device level" in note
    assert not any("no calibration" in a or "none applied" in a for a in qwen["assumptions"])

    # Another model family's estimate is what it was before the uploads, under the new table.
    llama_after = estimate(store_client, LLAMA_JOB)
    table_after = llama_after["calibration"].pop("table_id")
    assert table_after != llama_before["calibration"].pop("table_id")
    assert llama_after == llama_before
    fit = store_client.post("/v1/fit-checks", json={"job": QWEN_JOB, "gpus": ["A100-80GB"]})
    assert fit.json()["results"][0]["required_bytes"] == peak["device_bytes_upper"]
