"""Calibration on published peaks over HTTP, on SQLite and PostgreSQL: the published rows go
in through POST /v1/calibrations (each source a node with its own key), and the calibrated
estimates that POST /v1/estimates gives for the rows held back come closer to what was measured
wherever a factor moves them (their model's own, or one that several models agree on, by what its
median shows beyond its standard error), and stay as they were where none does.

The same folds as tests/store/test_published_calibration.py, which checks the service layer.
"""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from service.api.schemas import JobSpec
from service.core.calibration import MIN_MODELS, MIN_NODES
from service.core.codec import spec_to_dict
from service.store.keys import KeyScope
from tests.api.conftest import issue_key
from tests.api.test_calibrations import bearer, reloaded_factors
from tests.published_rows import Row
from tests.store.test_published_calibration import FOLDS, as_upload, published, split


def job_body(row: Row) -> dict[str, Any]:
    """The row's spec as the JSON of an estimate request."""
    job: dict[str, Any] = {"model": row.model, **json.loads(json.dumps(spec_to_dict(row.spec)))}
    assert JobSpec.model_validate(job).to_spec() == row.spec
    return job


def upload_body(row: Row, gpu: str) -> dict[str, Any]:
    upload = as_upload(row, gpu)
    return {
        "job": job_body(row),
        "gpu": {"name": upload.gpu_name, "memory_total_bytes": upload.gpu_memory_total_bytes},
        "measured": {f"{row.level}_bytes": upload.measured.at(*upload.measured.levels())},
        "node_id": upload.node_id,
        "run_id": upload.run_id,
    }


def log_error(predicted: int, measured: int) -> float:
    return abs(math.log(predicted / measured))


@pytest.mark.parametrize("fold", range(FOLDS))
def test_calibrated_estimates_of_held_back_rows_are_closer(
    store_app: FastAPI, store_client: TestClient, fold: int
) -> None:
    rows, _estimates, gpus = published()
    uploaded, held_back = split(rows, fold)
    tokens: dict[str, str] = {}
    for row in uploaded:
        body = upload_body(row, gpus[row.id])
        node = body["node_id"]
        if node not in tokens:
            tokens[node] = issue_key(store_app, KeyScope.UPLOAD, nodes=[node])
        response = store_client.post("/v1/calibrations", json=body, headers=bearer(tokens[node]))
        assert response.status_code == 201, response.text
        assert response.json()["ratios"], f"{row.id}: no ratio derived"
    for factor in reloaded_factors(store_client, store_app)["factors"]:
        assert factor["nodes"] >= MIN_NODES
        assert factor["models"] >= (MIN_MODELS if factor["scope"] == "global" else 1)

    uncalibrated = calibrated = 0.0
    better = worse = reached = moved = 0
    for row in held_back:
        body = store_client.post("/v1/estimates", json=job_body(row)).json()
        assert body["calibration"]["state"] == "fresh"
        reached += any(level["level"] == row.level for level in body["calibration"]["levels"])
        moved += body["peak"][f"{row.level}_bytes"] != body["estimated"][f"{row.level}_bytes"]
        before = log_error(body["estimated"][f"{row.level}_bytes"], row.measured_bytes)
        after = log_error(body["peak"][f"{row.level}_bytes"], row.measured_bytes)
        uncalibrated += before
        calibrated += after
        better += after < before - 1e-9
        worse += after > before + 1e-9
    assert moved <= reached  # only a factor moves an estimate
    if moved:
        assert calibrated < uncalibrated
        assert better > worse
    else:
        assert (calibrated, better, worse) == (uncalibrated, 0, 0)
