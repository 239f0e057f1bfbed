"""Estimates of a job's peak memory: one, or a batch."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic_core import to_json
from starlette.concurrency import run_in_threadpool

from service.api.answers import Answer
from service.api.body import is_json, request_body, validate_body, validate_body_or
from service.api.deps import estimation_for, services_of
from service.api.problems import responses
from service.api.responses import JSON_MEDIA_TYPE
from service.api.schemas import BatchIn, BatchOut, EstimateOut, JobsIn, JobSpec

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
    # The answer's values are encoded in one pass, as the response model would write them.
    values = estimation_for(services).values(job)
    content = to_json(values)
    if cacheable:
        services.answers.put(body, Answer(content, values["model"], generation))
    return Response(content, media_type=JSON_MEDIA_TYPE)


@router.post(
    "/estimates:batch",
    response_model=BatchOut,
    summary="Estimate up to 1000 jobs in one call",
    description="Results come in the jobs' order; a job that fails gets its own problem entry "
    "(status 404 or 422) and the others are still answered.",
    responses=responses(413, 415, 422),
    openapi_extra=request_body(BatchIn),
)
async def create_estimates_batch(request: Request) -> Response:
    # One pass of pydantic-core reads a batch whose jobs are all valid; any other is read as
    # FastAPI reads a `BatchIn` body, each job failing on its own. The estimates share the
    # request's lookups and are encoded in one pass; the work runs in the thread pool, as a
    # plain route's would, so that the event loop keeps answering meanwhile.
    services = services_of(request)
    body = await request.body()
    content_type = request.headers.get("content-type")
    estimation = estimation_for(services)

    def answer() -> bytes:
        jobs = validate_body_or(body, content_type, JobsIn, BatchIn).jobs
        return to_json(estimation.batch(jobs))

    return Response(await run_in_threadpool(answer), media_type=JSON_MEDIA_TYPE)
