"""Estimates of a job's peak memory: one, or a batch."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from service.api.answers import Answer
from service.api.body import is_json, request_body, require_json, validate_body
from service.api.deps import EstimationDep, estimation_for, services_of
from service.api.problems import responses
from service.api.responses import JSON_MEDIA_TYPE, json_response
from service.api.schemas import BatchIn, BatchOut, EstimateOut, JobSpec

router = APIRouter(prefix="/v1", tags=["estimates"])


@router.post(
    "/estimates",
    response_model=EstimateOut,
    summary="Estimate a job's peak GPU memory",
    description="The peak of one GPU of the job at the allocated, reserved and device levels, "
    "the safe bound, where the bytes go and when the peak happens.",
    responses=responses(404, 413, 415, 422),
    openapi_extra=request_body(JobSpec),
)
async def create_estimate(request: Request) -> Response:
    # Schedulers call this before every placement: the body is parsed by pydantic-core in one
    # pass, the services are read directly (FastAPI's body and dependency resolution would cost
    # more than the estimate), and a body asked before under the same calibration factors gets
    # its kept answer.
    services = services_of(request)
    body = await request.body()
    content_type = request.headers.get("content-type")
    cacheable = is_json(content_type)
    generation = services.factors.generation()
    if cacheable:
        kept = services.answers.get(body, generation)
        if kept is not None:
            services.metrics.count_estimate(kept.model)
            return Response(kept.content, media_type=JSON_MEDIA_TYPE)
    job = validate_body(body, content_type, JobSpec)
    out = estimation_for(services).estimate(job)
    content = out.__pydantic_serializer__.to_json(out)
    if cacheable:
        services.answers.put(body, Answer(content, out.model, generation))
    return Response(content, media_type=JSON_MEDIA_TYPE)


@router.post(
    "/estimates:batch",
    response_model=BatchOut,
    summary="Estimate up to 1000 jobs in one call",
    description="Results come in the jobs' order; a job that fails gets its own problem entry "
    "(status 404 or 422) and the others are still answered.",
    responses=responses(413, 415, 422),
    dependencies=[Depends(require_json)],
)
def create_estimates_batch(body: BatchIn, estimation: EstimationDep) -> Response:
    return json_response(estimation.batch(body))
