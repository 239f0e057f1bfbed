"""Whether a job fits GPU types, how far it can grow, and what makes it fit."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import Response

from service.api.body import require_json
from service.api.deps import EstimationDep
from service.api.problems import responses
from service.api.responses import json_response
from service.api.schemas import FitCheckIn, FitCheckOut

router = APIRouter(prefix="/v1", tags=["fit-checks"])


@router.post(
    "/fit-checks",
    response_model=FitCheckOut,
    summary="Check a job against GPU types",
    description="Per GPU type: fits, usable and required bytes, headroom, the largest "
    "micro-batch and sequence that fit (solved), ranked changes that make the job fit, and "
    "with prices the cheapest GPU that fits.",
    responses=responses(404, 413, 415, 422),
    dependencies=[Depends(require_json)],
)
def create_fit_check(body: FitCheckIn, estimation: EstimationDep) -> Response:
    return json_response(estimation.fit_check(body))
