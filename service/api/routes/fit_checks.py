"""Whether a job fits GPU types, how far it can grow, and what makes it fit."""

from __future__ import annotations

from functools import partial

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic_core import to_json
from starlette.concurrency import run_in_threadpool

from service.api.body import request_body, validate_body_or
from service.api.deps import estimation_for, services_of
from service.api.problems import responses
from service.api.responses import JSON_MEDIA_TYPE
from service.api.schemas import FitCheckIn, FitCheckOut
from service.core.cold import ColdWorkRefused, refusing_cold_work

router = APIRouter(prefix="/v1", tags=["fit-checks"])


@router.post(
    "/fit-checks",
    response_model=FitCheckOut,
    summary="Check a job against GPU types",
    description="Per GPU type: fits, usable and required bytes, headroom, the largest "
    "micro-batch and sequence that fit (solved), ranked changes that make the job fit, and "
    "with prices the cheapest GPU that fits.",
    responses=responses(404, 413, 415, 422, 429, 503),
    openapi_extra=request_body(FitCheckIn),
)
async def create_fit_check(request: Request) -> Response:
    # The body is read by pydantic-core in one pass from its bytes (a body it refuses is read
    # again as FastAPI reads a declared body, for FastAPI's errors). A warm check (its jobs'
    # steps compiled, their replays remembered) is answered on the event loop, as an estimate
    # is; one that would run a step or replay the allocator (seconds, for a new job) runs in
    # the thread pool, as a plain route's would, the event loop answering meanwhile, within a
    # slot and the time for cold work (`budget`).
    services = services_of(request)
    estimation = estimation_for(services)
    body = await request.body()
    asked = validate_body_or(body, request.headers.get("content-type"), FitCheckIn, FitCheckIn)

    def answer() -> bytes:
        return to_json(estimation.fit_check_values(asked))

    try:
        with refusing_cold_work():
            content = answer()
    except ColdWorkRefused:
        async with services.cold_work.claim(request.headers.get("authorization")) as claim:
            await claim.admit()
            content = await run_in_threadpool(partial(claim.run, answer))
    return Response(content, media_type=JSON_MEDIA_TYPE)
