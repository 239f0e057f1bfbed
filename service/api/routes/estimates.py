"""Estimates of a job's peak memory: one, or a batch."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response

from service.api.deps import EstimationDep
from service.api.problems import responses
from service.api.responses import json_response
from service.api.schemas import BatchIn, BatchOut, EstimateOut, JobSpec

router = APIRouter(prefix="/v1", tags=["estimates"])


@router.post(
    "/estimates",
    response_model=EstimateOut,
    summary="Estimate a job's peak GPU memory",
    description="The peak of one GPU of the job at the allocated, reserved and device levels, "
    "the safe bound, where the bytes go and when the peak happens.",
    responses=responses(404, 413, 422),
)
async def create_estimate(job: JobSpec, estimation: EstimationDep) -> Response:
    return json_response(estimation.estimate(job))


@router.post(
    "/estimates:batch",
    response_model=BatchOut,
    summary="Estimate up to 1000 jobs in one call",
    description="Results come in the jobs' order; a job that fails gets its own problem entry "
    "(status 404 or 422) and the others are still answered.",
    responses=responses(413, 422),
)
def create_estimates_batch(body: BatchIn, estimation: EstimationDep) -> Response:
    return json_response(estimation.batch(body))
