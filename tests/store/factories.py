"""Builders for store tests: uploads, and a stand-in estimator that reads its answer off the job."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.calibration.uploads import NewUpload, UploadReceipt
from service.core.calibration import Measured, Outcome
from service.core.errors import UnknownModelError
from service.core.result import Estimate, ParamCounts, Phase
from service.core.units import GIB
from service.store.keys import KeyScope, create_key
from service.store.models import ApiKey

A100_80GB = 85_899_345_920
VERSION = "test-1"
KEY_MADE_AT = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)


def node_key(session: Session, node_id: str) -> ApiKey:
    """The upload key of one node (made on first use): a node votes once, through its key."""
    name = f"node {node_id}"
    found = session.scalars(select(ApiKey).where(ApiKey.name == name)).first()
    if found is not None:
        return found
    return create_key(
        session, scopes=[KeyScope.UPLOAD], name=name, now=KEY_MADE_AT, nodes=[node_id]
    ).key


def fake_estimate(job: Mapping[str, Any], *, version: str = VERSION) -> Estimate:
    """An estimate whose levels are `job["estimate_gib"]` GiB (allocated), +10 %, +20 %."""
    if job.get("model") == "unknown/model":
        raise UnknownModelError("unknown/model")
    allocated = int(float(job["estimate_gib"]) * GIB)
    reserved = allocated * 11 // 10
    device = allocated * 12 // 10
    return Estimate(
        allocated_bytes=allocated,
        reserved_bytes=reserved,
        device_bytes=device,
        device_bytes_upper=device * 115 // 100,
        components={},
        overheads={},
        peak_step=2,
        peak_phase=Phase.BACKWARD_START,
        phases=(),
        params=ParamCounts(total=1, trainable=1),
        upper_margin=0.15,
        assumptions=(),
        warnings=(),
        estimator_version=version,
    )


def new_upload(
    *,
    model: str = "meta-llama/Llama-3.1-8B",
    estimate_gib: float = 20.0,
    device_gib: float | None = 24.0,
    allocated_gib: float | None = None,
    reserved_gib: float | None = None,
    node_id: str = "gpu-node-17",
    run_id: str = "job-4711-rank0",
    outcome: Outcome = Outcome.COMPLETED,
    gpu_name: str = "NVIDIA A100-SXM4-80GB",
    torch: str = "2.5.1",
) -> NewUpload:
    def gib(value: float | None) -> int | None:
        return None if value is None else int(value * GIB)

    return NewUpload(
        job={"model": model, "method": "lora", "batch_size": 1, "estimate_gib": estimate_gib},
        model=model,
        method="lora",
        gpu_name=gpu_name,
        gpu_memory_total_bytes=A100_80GB,
        measured=Measured(
            allocated_bytes=gib(allocated_gib),
            reserved_bytes=gib(reserved_gib),
            device_bytes=gib(device_gib),
        ),
        outcome=outcome,
        environment={"torch": torch, "cuda": "12.4", "driver": "550.54.15", "world_size": 1},
        node_id=node_id,
        run_id=run_id,
    )


def render(receipt: UploadReceipt) -> dict[str, Any]:
    """A response body the way the API could render a receipt."""
    return {
        "id": receipt.upload_id,
        "received_at": receipt.received_at.isoformat(),
        "estimator_version": receipt.estimator_version,
        "estimate_error": receipt.estimate_error,
        "ratios": [
            {
                "level": ratio.level.value,
                "ratio": ratio.ratio,
                "outlier": ratio.outlier_reason,
            }
            for ratio in receipt.ratios
        ],
    }
