"""The estimate and fit-check routes encode plain values in one pass: the bytes the response
models write.

`estimate_values`, `Estimation.batch` and `Estimation.fit_check_values` stand in for building
`EstimateOut`, `BatchOut` and `FitCheckOut` per answer; these tests hold their encoding to the
models' own serialisers, byte for byte, and the routes' answers to the models' schema.
"""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient
from pydantic_core import to_json

from service.api.app import create_app
from service.api.deps import estimation_for
from service.api.estimation import Estimation
from service.api.schemas import BatchOut, EstimateOut, FitCheckIn, FitCheckOut, JobSpec
from service.api.settings import Settings
from service.calibration.factors import FactorState
from service.calibration.provider import (
    CachedFactors,
    CalibratedPeaks,
    FactorProvider,
    applied_calibration,
)
from service.core.calibration import AppliedFactor, Factor, GroupKey, Level, Scope
from service.core.result import Levels
from tests.api.conftest import FULL_JOB, SMALL_JOB

CONFIG = {
    "model_type": "llama",
    "hidden_size": 512,
    "intermediate_size": 1376,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "vocab_size": 32000,
    "max_position_embeddings": 2048,
}
JOBS: list[dict[str, Any]] = [
    SMALL_JOB,
    FULL_JOB,
    {**SMALL_JOB, "gpu": "A100-80GB"},
    {**SMALL_JOB, "gpu": "Tesla T4"},  # a bf16 warning
    {**SMALL_JOB, "gpu": {"memory_mib": 81920}},
    {**SMALL_JOB, "gpu": {"memory_mib": 50000}},  # no catalog GPU has this much
    {**SMALL_JOB, "method": "full", "optim": "adamw_torch"},
    {"model": {"hf_config": CONFIG}, "batch_size": 1, "seq_len": 256},
]


class Calibrated(FactorProvider):
    """The store's factors, with a device-level and an allocated-level factor applied to
    every job (as a replica whose store holds measurements of the model would)."""

    def __init__(self, factors: CachedFactors) -> None:
        self.factors = factors

    def generation(self) -> object:
        return self.factors.generation()

    def peaks(
        self, estimate: Levels, *, model: str, method: str, gpu: str | None
    ) -> CalibratedPeaks:
        base = self.factors.peaks(estimate, model=model, method=method, gpu=gpu)
        applied = {
            level: AppliedFactor(
                key=GroupKey(scope=Scope.MODEL, method=method, level=level, model=model),
                factor=Factor(
                    ratio=ratio,
                    upper_multiplier=1.07,
                    nodes=3,
                    models=1,
                    rejected_nodes=(),
                    runs=12,
                    oom_runs=0,
                    log_spread=0.02,
                    clamped=False,
                ),
            )
            for level, ratio in ((Level.ALLOCATED, 0.97), (Level.DEVICE, 1.04))
        }
        return CalibratedPeaks(
            allocated_bytes=base.allocated_bytes,
            reserved_bytes=base.reserved_bytes,
            device_bytes=round(base.device_bytes * 1.04),
            device_bytes_upper=round(base.device_bytes * 1.04 * 1.07),
            calibration=applied_calibration(applied, FactorState.FRESH),
        )


# Fit-checks whose answers hold every part: GPUs that fit and GPUs that do not (suggestions,
# single and stacked), prices (the cheapest), counts, GPUs by memory (in the catalog and not),
# and a placement.
FIT_CHECKS: list[dict[str, Any]] = [
    {"job": SMALL_JOB, "gpus": ["L4", "H100-SXM", "A100-80GB"]},
    {
        "job": FULL_JOB,
        "gpus": [
            "T4",
            {"name": "L4", "price_per_hour": 0.8},
            {"name": "A100-80GB", "count": 2, "price_per_hour": 1.9},
            {"memory_mib": 81920},
            {"memory_mib": 50000},
        ],
    },
    {
        "job": {
            **{k: v for k, v in FULL_JOB.items() if k not in ("lora", "quantization")},
            "method": "full",
            "optim": "adamw_torch",
        },
        "gpus": ["L4", "H200"],
    },
    {
        "job": {**SMALL_JOB, "batch_size": 8, "seq_len": 4096},
        "gpus": ["T4", {"name": "L4", "price_per_hour": 0.8}],
        "placement": {"strategies": ["ddp", "zero3"], "max_gpus": 8},
    },
]


def _model_bytes(
    values: dict[str, Any], model: type[EstimateOut] | type[BatchOut] | type[FitCheckOut]
) -> bytes:
    validated = model.model_validate(values)
    return validated.__pydantic_serializer__.to_json(validated)


def _estimation(calibrated: bool) -> Estimation:
    """An app's estimation, with the store's factors or with `Calibrated`'s."""
    app = create_app(Settings(database_url="sqlite://"))
    if calibrated:
        plain = app.state.services.factors
        app = create_app(Settings(database_url="sqlite://"), factor_provider=Calibrated(plain))
    return estimation_for(app.state.services)


@pytest.mark.parametrize("calibrated", [False, True], ids=["uncalibrated", "calibrated"])
def test_estimate_values_encode_as_the_model_does(calibrated: bool) -> None:
    estimation = _estimation(calibrated)
    for job in JOBS:
        values = estimation.values(JobSpec.model_validate(job))
        assert to_json(values) == _model_bytes(values, EstimateOut), job
        assert values["calibration"]["applied"] is calibrated
    # Answers share their calibration's description: encoding it twice gives the same bytes.
    again = estimation.values(JobSpec.model_validate(SMALL_JOB))
    assert to_json(again) == to_json(estimation.values(JobSpec.model_validate(SMALL_JOB)))


def test_batch_values_encode_as_the_model_does() -> None:
    app = create_app(Settings(database_url="sqlite://"))
    estimation = estimation_for(app.state.services)
    jobs = [
        *(JobSpec.model_validate(job) for job in JOBS),
        JobSpec.model_validate({**SMALL_JOB, "model": "Qwen/Qwen2.5-7B-Instrct"}),  # 404
        JobSpec.model_validate({**SMALL_JOB, "method": "full", "lora": {"r": 4}}),  # 422
    ]
    values = estimation.batch(jobs)
    assert values["failed"] == 2 and values["succeeded"] == len(JOBS)
    assert to_json(values) == _model_bytes(values, BatchOut)


@pytest.mark.parametrize("calibrated", [False, True], ids=["uncalibrated", "calibrated"])
def test_fit_check_values_encode_as_the_model_does(calibrated: bool) -> None:
    estimation = _estimation(calibrated)
    seen = set()
    for body in FIT_CHECKS:
        values = estimation.fit_check_values(FitCheckIn.model_validate(body))
        assert to_json(values) == _model_bytes(values, FitCheckOut), body
        for result in values["results"]:
            seen.add("fits" if result["fits"] else "does not fit")
            seen.update(f"{len(s['changes'])} changes" for s in result["suggestions"])
        seen.update(part for part in ("cheapest", "placement") if values[part] is not None)
    # (the checks hold each part of an answer)
    assert {"fits", "does not fit", "1 changes", "2 changes", "cheapest", "placement"} <= seen


def test_the_routes_answer_what_the_models_write() -> None:
    with TestClient(create_app(Settings(database_url="sqlite://"))) as client:
        singles = [client.post("/v1/estimates", json=job) for job in JOBS]
        batch = client.post("/v1/estimates:batch", json={"jobs": JOBS})
        checks = [client.post("/v1/fit-checks", json=body) for body in FIT_CHECKS]
    for response in checks:
        assert response.status_code == 200, response.text
        checked = FitCheckOut.model_validate_json(response.content)
        assert response.content == checked.__pydantic_serializer__.to_json(checked)
    for response in singles:
        assert response.status_code == 200
        out = EstimateOut.model_validate_json(response.content)
        assert response.content == out.__pydantic_serializer__.to_json(out)
    assert batch.status_code == 200
    out_batch = BatchOut.model_validate_json(batch.content)
    assert batch.content == out_batch.__pydantic_serializer__.to_json(out_batch)
    # Each job of the batch is answered as it is alone.
    assert [r.estimate for r in out_batch.results] == [
        EstimateOut.model_validate_json(r.content) for r in singles
    ]


def test_a_batch_with_a_bad_job_answers_its_good_jobs_alike() -> None:
    """A batch whose jobs all pass the schema is read in one pass; one with a job that fails
    it is read job by job: the good jobs' answers are the same either way."""
    bad = {**SMALL_JOB, "batch_size": "many"}
    with TestClient(create_app(Settings(database_url="sqlite://"))) as client:
        good = client.post("/v1/estimates:batch", json={"jobs": JOBS}).json()
        mixed = client.post("/v1/estimates:batch", json={"jobs": [*JOBS, bad]}).json()
    assert mixed["results"][: len(JOBS)] == good["results"]
    assert mixed["results"][-1]["status"] == 422
    assert mixed["results"][-1]["problem"]["errors"][0]["loc"] == [
        "body",
        "jobs",
        len(JOBS),
        "batch_size",
    ]
